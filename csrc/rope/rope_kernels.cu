// CUDA kernels of the rope family (launcher declared in rope_kernels.h), torch-free. A block takes one position
// (b, s); its threads stride over (head, rotary pair) of q's heads then k's, consecutive threads on consecutive
// features of a head (coalesced), then over the features past r, copied. The cos / sin row is read by every head
// from L1.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "rope/rope_kernels.h"

namespace fused {
namespace cuda {
namespace rope {
namespace {

constexpr int kMaxThreads = 256;

template <typename S, bool kInterleaved, bool kBackward>
__global__ void __launch_bounds__(kMaxThreads)
    rope_kernel(Heads q, Heads k, const S* __restrict__ cos, const S* __restrict__ sin, int64_t s, int64_t d, int64_t r,
                int64_t cos_batch_stride) {
  using T = typename MathType<S>::type;
  const int64_t pos = blockIdx.x, bi = pos / s, si = pos % s;
  const S* c = cos + bi * cos_batch_stride + si * r;
  const S* sn = sin + bi * cos_batch_stride + si * r;
  const int64_t half = r / 2, heads = q.heads + k.heads;
  // the row of head h (q's first, then k's) at this position, in x and in out; fields picked one by one (a
  // reference to q or k would copy both into local memory)
  auto rows = [&](int64_t h, const S*& x, S*& out) {
    const bool in_q = h < q.heads;
    const int64_t hh = in_q ? h : h - q.heads;
    x = static_cast<const S*>(in_q ? q.x : k.x) + bi * (in_q ? q.x_strides[0] : k.x_strides[0]) +
        hh * (in_q ? q.x_strides[1] : k.x_strides[1]) + si * (in_q ? q.x_strides[2] : k.x_strides[2]);
    out = static_cast<S*>(in_q ? q.out : k.out) + bi * (in_q ? q.out_strides[0] : k.out_strides[0]) +
          hh * (in_q ? q.out_strides[1] : k.out_strides[1]) + si * (in_q ? q.out_strides[2] : k.out_strides[2]);
  };
  for (int64_t idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int64_t h = idx / half, i = idx % half;
    const S* x;
    S* out;
    rows(h, x, out);
    const int64_t j1 = kInterleaved ? 2 * i : i, j2 = kInterleaved ? 2 * i + 1 : i + half;
    const T c1 = to_math(c[i]), c2 = kInterleaved ? c1 : to_math(c[half + i]);
    T s1 = to_math(sn[i]), s2 = kInterleaved ? s1 : to_math(sn[half + i]);
    if (kBackward) {  // the transpose: rotate_half's sin halves swapped and negated (-sin for pairs)
      const T t1 = s1;
      s1 = -s2;
      s2 = -t1;
    }
    const T x1 = to_math(x[j1]), x2 = to_math(x[j2]);
    out[j1] = from_math<S>(x1 * c1 - x2 * s1);
    out[j2] = from_math<S>(x2 * c2 + x1 * s2);
  }
  const int64_t pass = d - r;
  for (int64_t idx = threadIdx.x; idx < heads * pass; idx += blockDim.x) {
    const int64_t h = idx / pass, j = r + idx % pass;
    const S* x;
    S* out;
    rows(h, x, out);
    out[j] = x[j];
  }
}

int threads_for(int64_t work) {
  int t = 32;
  while (t < kMaxThreads && t < work) t *= 2;
  return t;
}

template <typename S, bool kInterleaved, bool kBackward>
cudaError_t launch(const Heads& q, const Heads& k, const void* cos, const void* sin, int64_t b, int64_t s, int64_t d,
                   int64_t r, int64_t cos_batch_stride, cudaStream_t stream) {
  const int threads = threads_for((q.heads + k.heads) * (d - r / 2));
  FUSED_LAUNCH(unsigned(b * s), threads, 0, stream, rope_kernel<S, kInterleaved, kBackward>)(
      q, k, static_cast<const S*>(cos), static_cast<const S*>(sin), s, d, r, cos_batch_stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope(DType dtype, const Heads& q, const Heads& k, const void* cos, const void* sin, int64_t b, int64_t s,
                 int64_t d, int64_t r, int64_t cos_batch_stride, bool interleaved, bool backward, cudaStream_t stream) {
  if (b * s <= 0 || d <= 0) return cudaSuccess;
  if (b * s > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    const auto f = interleaved ? (backward ? launch<S, true, true> : launch<S, true, false>)
                               : (backward ? launch<S, false, true> : launch<S, false, false>);
    return f(q, k, cos, sin, b, s, d, r, cos_batch_stride, stream);
  });
}

}  // namespace rope
}  // namespace cuda
}  // namespace fused
