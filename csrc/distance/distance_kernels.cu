// CUDA kernels of the fused distance family (torch-free; see distance_kernels.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/scalar_math.h"
#include "distance/distance_kernels.h"
#include "distance/distance_math.h"

namespace fused {
namespace cuda {
namespace distance {
namespace {

constexpr int kThreadsX = 32, kThreadsY = 8;       // 256 threads
constexpr int kRowsPerThread = 8, kColsPerThread = 4;
constexpr int kTileN = kThreadsY * kRowsPerThread;  // 64 rows of a
constexpr int kTileM = kThreadsX * kColsPerThread;  // 128 rows of b
constexpr int kChunkD = 16;                         // coordinates staged in shared memory at a time

// One block: a 64 x 128 output tile of batch blockIdx.z. Coordinates are staged kChunkD at a time: a as
// [64][kChunkD] (a warp reads one row: broadcast), b transposed as [kChunkD][128] (a warp reads consecutive
// columns: no bank conflicts). Thread (tx, ty) owns rows ty + 8 r and columns tx + 32 c, so each store of a
// warp covers 32 consecutive outputs.
template <typename T, Metric MT>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    direct_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t N, int64_t M,
                  int64_t D, int64_t row0, typename MathType<T>::type p, typename MathType<T>::type inv_p,
                  bool squared) {
  using Acc = typename MathType<T>::type;
  const MetricParams<Acc> prm{p, inv_p, p - Acc(1), squared};
  __shared__ Acc as[kTileN][kChunkD + 1];
  __shared__ Acc bs[kChunkD][kTileM];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreadsX + tx;
  const int64_t i0 = row0 + static_cast<int64_t>(blockIdx.y) * kTileN, j0 = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t batch = blockIdx.z;
  const T* ab = a + batch * N * D;
  const T* bb = b + batch * M * D;
  Acc acc[kRowsPerThread][kColsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) acc[r][c] = Acc(0);
  for (int64_t d0 = 0; d0 < D; d0 += kChunkD) {
    const int dc = static_cast<int>(D - d0 < kChunkD ? D - d0 : kChunkD);
    for (int e = tid; e < kTileN * kChunkD; e += kThreadsX * kThreadsY) {
      const int r = e / kChunkD, d = e % kChunkD;
      const int64_t i = i0 + r;
      as[r][d] = (i < N && d < dc) ? to_math(ab[i * D + d0 + d]) : Acc(0);
    }
    for (int e = tid; e < kTileM * kChunkD; e += kThreadsX * kThreadsY) {
      const int c = e / kChunkD, d = e % kChunkD;
      const int64_t j = j0 + c;
      bs[d][c] = (j < M && d < dc) ? to_math(bb[j * D + d0 + d]) : Acc(0);
    }
    __syncthreads();
    for (int d = 0; d < dc; ++d) {
      Acc bv[kColsPerThread];
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) bv[c] = bs[d][tx + kThreadsX * c];
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const Acc av = as[ty + kThreadsY * r][d];
#pragma unroll
        for (int c = 0; c < kColsPerThread; ++c) acc[r][c] = metric_accumulate<MT>(acc[r][c], av - bv[c], prm);
      }
    }
    __syncthreads();
  }
  T* ob = out + batch * N * M;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int64_t i = i0 + ty + kThreadsY * r;
    if (i >= N) continue;
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
      const int64_t j = j0 + tx + kThreadsX * c;
      if (j < M) ob[i * M + j] = from_math<T>(metric_finish<MT>(acc[r][c], prm));
    }
  }
}

template <typename T, Metric MT>
__global__ void grad_kernel(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ grad,
                            const T* __restrict__ dist, typename MathType<T>::type* __restrict__ gx, int64_t R,
                            int64_t C, int64_t D, int64_t s_r, int64_t s_c, typename MathType<T>::type p,
                            bool squared) {
  using Acc = typename MathType<T>::type;
  const MetricParams<Acc> prm{p, Acc(0), p - Acc(1), squared};  // inv_p: unused by the gradient
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t batch = blockIdx.y;
  if (e >= R * D) return;
  const int64_t r = e / D, d = e % D;
  const Acc xv = to_math(x[batch * R * D + e]);
  const T* yb = y + batch * C * D + d;
  const int64_t pair0 = batch * R * C + r * s_r;
  Acc acc = 0;
  for (int64_t c = 0; c < C; ++c) {
    const Acc g = to_math(grad[pair0 + c * s_c]), dv = to_math(dist[pair0 + c * s_c]);
    acc += grad_term<MT>(xv - to_math(yb[c * D]), pair_weight<MT>(g, dv, prm), dv, prm);
  }
  gx[batch * R * D + e] = acc;
}

// f(T(), tag) with T the storage type of dtype and tag the metric as a compile-time code.
template <typename F> cudaError_t visit(DType dtype, Metric metric, const F& f) {
  return visit_dtype(dtype, [&](auto type) {
    return visit_metric(metric, [&](auto tag) { return f(typename decltype(type)::type(), tag); });
  });
}

}  // namespace

cudaError_t pairwise_distances_direct(DType dtype, Metric metric, double p, bool squared, const void* a,
                                      const void* b, void* out, int64_t B, int64_t N, int64_t M, int64_t D,
                                      cudaStream_t stream) {
  if (B == 0 || N == 0 || M == 0) return cudaSuccess;
  return visit(dtype, metric, [&](auto type_tag, auto metric_tag) {
    using T = decltype(type_tag);
    using Acc = typename MathType<T>::type;
    constexpr Metric MT = decltype(metric_tag)::value;
    const dim3 block(kThreadsX, kThreadsY);
    const int64_t gx = (M + kTileM - 1) / kTileM, row_tiles = (N + kTileN - 1) / kTileN;
    if (gx > 2147483647) return cudaErrorInvalidConfiguration;
    return for_grid_slices(B, [&](int64_t b0, int64_t nb) {  // batches on grid z, row tiles on grid y
      return for_grid_slices(row_tiles, [&](int64_t t0, int64_t gy) {
        const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(nb));
        FUSED_LAUNCH(grid, block, 0, stream, direct_kernel<T, MT>)(
            static_cast<const T*>(a) + b0 * N * D, static_cast<const T*>(b) + b0 * M * D,
            static_cast<T*>(out) + b0 * N * M, N, M, D, t0 * kTileN, Acc(p), Acc(p > 0 ? 1.0 / p : 0.0), squared);
        return cudaSuccess;
      });
    });
  });
}

cudaError_t pairwise_distances_grad(DType dtype, Metric metric, double p, bool squared, const void* x,
                                    const void* y, const void* grad, const void* dist, void* grad_x, int64_t B,
                                    int64_t R, int64_t C, int64_t D, int64_t s_r, int64_t s_c,
                                    cudaStream_t stream) {
  if (B == 0 || R == 0 || D == 0) return cudaSuccess;
  return visit(dtype, metric, [&](auto type_tag, auto metric_tag) {
    using T = decltype(type_tag);
    using Acc = typename MathType<T>::type;
    constexpr Metric MT = decltype(metric_tag)::value;
    constexpr int threads = 256;
    const int64_t blocks = (R * D + threads - 1) / threads;
    if (blocks > 2147483647) return cudaErrorInvalidConfiguration;
    return for_grid_slices(B, [&](int64_t b0, int64_t nb) {  // batches on grid y
      const int64_t pair_off = b0 * R * C;
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(nb));
      FUSED_LAUNCH(grid, threads, 0, stream, grad_kernel<T, MT>)(
          static_cast<const T*>(x) + b0 * R * D, static_cast<const T*>(y) + b0 * C * D,
          static_cast<const T*>(grad) + pair_off, static_cast<const T*>(dist) + pair_off,
          static_cast<Acc*>(grad_x) + b0 * R * D, R, C, D, s_r, s_c, Acc(p), squared);
      return cudaSuccess;
    });
  });
}

}  // namespace distance
}  // namespace cuda
}  // namespace fused
