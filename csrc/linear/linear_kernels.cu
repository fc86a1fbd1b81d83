// CUDA kernels of the fused linear family; see linear_kernels.h. Math in float (double for double).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/scalar_math.h"
#include "linear/linear_kernels.h"
#include "linear/linear_math.h"

namespace fused {
namespace linear {
namespace {

constexpr int kThreads = 256;
// act_grad_bias tiles: 32 columns (one warp wide) x kRowLanes rows per block, kRowsPerChunk rows per partial sum.
constexpr int kCols = 32, kRowLanes = 8;
constexpr int64_t kRowsPerChunk = 128;

// Blocks stride over rows, threads over the columns of a row: the bias index needs no division.
template <Act A, typename T>
__global__ void bias_act_epilogue_kernel(T* __restrict__ y, T* __restrict__ pre, const T* __restrict__ bias, int64_t M,
                                         int64_t N) {
  using MT = typename MathType<T>::type;
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x) {
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) {
      const int64_t i = r * N + c;
      MT v = to_math(y[i]);
      if (bias) v += to_math(bias[c]);
      if (pre) pre[i] = from_math<T>(v);
      y[i] = from_math<T>(act_fwd<A>(v));
    }
  }
}

// Block (chunk, column tile): grad_pre for its rows; the column sums of its rows into partial[chunk][col].
template <Act A, typename T>
__global__ void act_grad_bias_kernel(const T* __restrict__ grad, const T* __restrict__ saved, T* __restrict__ grad_pre,
                                     typename MathType<T>::type* __restrict__ partial, int64_t M, int64_t N,
                                     int64_t col0) {
  using MT = typename MathType<T>::type;
  __shared__ MT sums[kRowLanes][kCols + 1];
  const int64_t col = col0 + int64_t(blockIdx.y) * kCols + threadIdx.x;
  const int64_t row0 = int64_t(blockIdx.x) * kRowsPerChunk;
  const int64_t row1 = row0 + kRowsPerChunk < M ? row0 + kRowsPerChunk : M;
  MT acc = MT(0);
  if (col < N) {
    for (int64_t r = row0 + threadIdx.y; r < row1; r += kRowLanes) {
      const int64_t i = r * N + col;
      MT g = to_math(grad[i]);
      if constexpr (A != Act::identity) g = act_backward_from_saved<A>(g, to_math(saved[i]));
      grad_pre[i] = from_math<T>(g);
      acc += g;
    }
  }
  if (!partial) return;
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) {
    MT total = MT(0);
    for (int j = 0; j < kRowLanes; ++j) total += sums[j][threadIdx.x];  // fixed order
    partial[int64_t(blockIdx.x) * N + col] = total;
  }
}

template <typename T>
__global__ void sum_partials_kernel(const typename MathType<T>::type* __restrict__ partial, T* __restrict__ out,
                                    int64_t chunks, int64_t N) {
  const int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (col >= N) return;
  typename MathType<T>::type total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c * N + col];  // fixed order
  out[col] = from_math<T>(total);
}

}  // namespace

cudaError_t launch_bias_act_epilogue(void* y, void* pre, const void* bias, int64_t M, int64_t N, Act act, DType dtype,
                                     cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(M < 65536 * 4 ? M : 65536 * 4);  // row-stride loop beyond
  const int threads = N >= kThreads ? kThreads : static_cast<int>((N + 31) / 32 * 32);
  return visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    return visit_act(act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      FUSED_LAUNCH(blocks, threads, 0, stream, bias_act_epilogue_kernel<A, T>)(static_cast<T*>(y), static_cast<T*>(pre),
                                                                               static_cast<const T*>(bias), M, N);
      return cudaGetLastError();
    });
  });
}

size_t act_grad_bias_workspace_bytes(int64_t M, int64_t N, DType dtype) {
  const int64_t chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  return static_cast<size_t>(chunks * N) * (dtype == DType::f64 ? sizeof(double) : sizeof(float));
}

cudaError_t launch_act_grad_bias(const void* grad, const void* saved, void* grad_pre, void* grad_bias, void* workspace,
                                 int64_t M, int64_t N, Act act, DType dtype, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  const int64_t chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  const int64_t col_tiles = (N + kCols - 1) / kCols;
  if (chunks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 block(kCols, kRowLanes);
  return visit_dtype(dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    using MT = typename MathType<T>::type;
    MT* partial = grad_bias ? static_cast<MT*>(workspace) : nullptr;
    cudaError_t err = visit_act(act, [&](auto tag) {
      constexpr Act A = decltype(tag)::value;
      return for_grid_slices(col_tiles, [&](int64_t t0, int64_t tiles) {  // column tiles on grid y
        const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(tiles));
        FUSED_LAUNCH(grid, block, 0, stream, act_grad_bias_kernel<A, T>)(
            static_cast<const T*>(grad), static_cast<const T*>(saved), static_cast<T*>(grad_pre), partial, M, N,
            t0 * kCols);
        return cudaSuccess;
      });
    });
    if (err != cudaSuccess || !grad_bias) return err;
    const unsigned blocks = static_cast<unsigned>((N + kThreads - 1) / kThreads);
    FUSED_LAUNCH(blocks, kThreads, 0, stream, sum_partials_kernel<T>)(partial, static_cast<T*>(grad_bias), chunks, N);
    return cudaGetLastError();
  });
}

}  // namespace linear
}  // namespace fused
