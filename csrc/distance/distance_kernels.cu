// CUDA kernels of the fused distance family (torch-free; see distance_kernels.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/scalar_math.h"
#include "distance/distance_kernels.h"
#include "distance/distance_math.h"

namespace fused {
namespace cuda {
namespace distance {
namespace {

constexpr int kThreadsX = 32, kThreadsY = 8;  // 256 threads
constexpr int kRowsPerThread = 8, kColsPerThread = 4;
constexpr int kTileN = kThreadsY * kRowsPerThread;  // 64 rows of a
constexpr int kTileM = kThreadsX * kColsPerThread;  // 128 rows of b
constexpr int kChunkD = 16;                         // coordinates staged in shared memory at a time

// One block: a 64 x 128 output tile of batch blockIdx.z. Coordinates are staged kChunkD at a time: a as
// [64][kChunkD] (a warp reads one row: broadcast), b transposed as [kChunkD][128] (a warp reads consecutive
// columns: no bank conflicts). Thread (tx, ty) owns rows ty + 8 r and columns tx + 32 c, so each store of a
// warp covers 32 consecutive outputs. Pairs with a padded row (past la / lb) are written as 0.
template <typename T, Metric MT>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    direct_kernel(const T* __restrict__ a, const T* __restrict__ b, const int64_t* __restrict__ la,
                  const int64_t* __restrict__ lb, T* __restrict__ out, int64_t N, int64_t M, int64_t D, int64_t row0,
                  typename MathType<T>::type p, typename MathType<T>::type inv_p, bool squared) {
  using Acc = typename MathType<T>::type;
  const MetricParams<Acc> prm{p, inv_p, p - Acc(1), squared};
  __shared__ Acc as[kTileN][kChunkD + 1];
  __shared__ Acc bs[kChunkD][kTileM];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreadsX + tx;
  const int64_t i0 = row0 + static_cast<int64_t>(blockIdx.y) * kTileN, j0 = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t batch = blockIdx.z;
  const int64_t n_valid = la ? la[batch] : N, m_valid = lb ? lb[batch] : M;
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
      as[r][d] = (i < n_valid && d < dc) ? to_math(ab[i * D + d0 + d]) : Acc(0);
    }
    for (int e = tid; e < kTileM * kChunkD; e += kThreadsX * kThreadsY) {
      const int c = e / kChunkD, d = e % kChunkD;
      const int64_t j = j0 + c;
      bs[d][c] = (j < m_valid && d < dc) ? to_math(bb[j * D + d0 + d]) : Acc(0);
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
      if (j < M) ob[i * M + j] = from_math<T>(i < n_valid && j < m_valid ? metric_finish<MT>(acc[r][c], prm) : Acc(0));
    }
  }
}

// The gradient kernels (grad_kernel, select_grad_a_kernel): one thread per element of the gradient, in blocks of
// kGradThreads.
constexpr int kGradThreads = 256;

template <typename T, Metric MT>
__global__ void grad_kernel(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ grad,
                            const T* __restrict__ dist, const int64_t* __restrict__ lr, const int64_t* __restrict__ lc,
                            typename MathType<T>::type* __restrict__ gx, int64_t R, int64_t C, int64_t D, int64_t s_r,
                            int64_t s_c, typename MathType<T>::type p, bool squared) {
  using Acc = typename MathType<T>::type;
  const MetricParams<Acc> prm{p, Acc(0), p - Acc(1), squared};  // inv_p: unused by the gradient
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t batch = blockIdx.y;
  if (e >= R * D) return;
  const int64_t r = e / D, d = e % D;
  if (r >= (lr ? lr[batch] : R)) {  // a padded row
    gx[batch * R * D + e] = Acc(0);
    return;
  }
  const int64_t c_valid = lc ? lc[batch] : C;
  const Acc xv = to_math(x[batch * R * D + e]);
  const T* yb = y + batch * C * D + d;
  const int64_t pair0 = batch * R * C + r * s_r;
  Acc acc = 0;
  for (int64_t c = 0; c < c_valid; ++c) {
    const Acc g = to_math(grad[pair0 + c * s_c]), dv = to_math(dist[pair0 + c * s_c]);
    acc += grad_term<MT>(xv - to_math(yb[c * D]), pair_weight<MT>(g, dv, prm), dv, prm);
  }
  gx[batch * R * D + e] = acc;
}

// ---- select: a running k-best per row of a ----
// A candidate's rank, smaller first: (flag, key, index) with flag 0 for numbers and 1 for NaN (swapped when
// largest: torch.topk ranks NaN as the largest value) and key the value (negated when largest).
template <typename Acc> struct Rank {
  int flag;
  Acc key;
  int64_t index;
};
template <typename Acc> __device__ __forceinline__ bool before(const Rank<Acc>& x, const Rank<Acc>& y) {
  if (x.flag != y.flag) return x.flag < y.flag;
  if (x.key != y.key) return x.key < y.key;
  return x.index < y.index;
}

constexpr int kSelectThreads = 128;  // rows of a per block, one per thread
template <typename Acc> constexpr int64_t kSelectTile = kSelectTileBytes / sizeof(Acc);  // coordinates

// One thread per row of a keeps its k best candidates (k <= KMAX) sorted in `best`; the block stages tiles of b
// (all D coordinates of tile_rows rows, in the math type) in shared memory. Columns arrive in increasing order, so
// a candidate that ties the k-th best on value loses (ties to the lower index).
template <typename T, Metric MT, int KMAX>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const T* __restrict__ a, const T* __restrict__ b, const int64_t* __restrict__ la,
                  const int64_t* __restrict__ lb, T* __restrict__ values, int64_t* __restrict__ indices, int64_t N,
                  int64_t M, int64_t D, int k, int64_t width, int64_t tile_rows, bool largest, bool within,
                  typename MathType<T>::type bound, typename MathType<T>::type p, typename MathType<T>::type inv_p,
                  bool squared) {
  using Acc = typename MathType<T>::type;
  __shared__ Acc tile[kSelectTile<Acc>];
  const MetricParams<Acc> prm{p, inv_p, p - Acc(1), squared};
  const int64_t batch = blockIdx.y, i = static_cast<int64_t>(blockIdx.x) * kSelectThreads + threadIdx.x;
  const int64_t n_valid = la ? la[batch] : N, m_valid = lb ? lb[batch] : M;
  const bool active = i < n_valid;
  const T* arow = a + (batch * N + (active ? i : 0)) * D;
  const int nan_flag = largest ? 0 : 1;
  Rank<Acc> best[KMAX];
  int n = 0;
  for (int64_t j0 = 0; j0 < m_valid; j0 += tile_rows) {
    const int64_t rows = m_valid - j0 < tile_rows ? m_valid - j0 : tile_rows;
    __syncthreads();  // the previous tile is done with
    const T* src = b + (batch * M + j0) * D;
    for (int64_t e = threadIdx.x; e < rows * D; e += kSelectThreads) tile[e] = to_math(src[e]);
    __syncthreads();
    if (!active) continue;
    for (int64_t c = 0; c < rows; ++c) {
      Acc acc(0);
      for (int64_t d = 0; d < D; ++d) acc = metric_accumulate<MT>(acc, to_math(arow[d]) - tile[c * D + d], prm);
      const Acc v = to_math(from_math<T>(metric_finish<MT>(acc, prm)));  // ranked as returned
      if (within && !(v <= bound)) continue;
      const bool nan = v != v;
      const Rank<Acc> x{nan ? nan_flag : 1 - nan_flag, nan ? Acc(0) : largest ? -v : v, j0 + c};
      if (n == k && !before(x, best[k - 1])) continue;
      if constexpr (KMAX == 1) {  // constant indices: the list stays in registers
        best[0] = x;
        n = 1;
      } else {
        int pos = n < k ? n++ : k - 1;  // the slot freed: a new one, or the worst's
        for (; pos > 0 && before(x, best[pos - 1]); --pos) best[pos] = best[pos - 1];
        best[pos] = x;
      }
    }
  }
  if (i >= N) return;
  T* vrow = values + (batch * N + i) * width;
  int64_t* irow = indices + (batch * N + i) * width;
  for (int64_t t = 0; t < width; ++t) {
    if (t < n) {
      const Rank<Acc>& r = best[KMAX == 1 ? 0 : t];
      vrow[t] = from_math<T>(r.flag == nan_flag ? std::numeric_limits<Acc>::quiet_NaN() : largest ? -r.key : r.key);
      irow[t] = r.index;
    } else {  // missing
      vrow[t] = from_math<T>(largest ? -std::numeric_limits<Acc>::infinity() : std::numeric_limits<Acc>::infinity());
      irow[t] = -1;
    }
  }
}

// ---- gradient through the selected pairs ----
template <typename T, Metric MT>
__global__ void select_grad_a_kernel(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ grad,
                                     const T* __restrict__ values, const int64_t* __restrict__ indices,
                                     typename MathType<T>::type* __restrict__ ga, int64_t N, int64_t M, int64_t D,
                                     int64_t k, typename MathType<T>::type p, bool squared) {
  using Acc = typename MathType<T>::type;
  const MetricParams<Acc> prm{p, Acc(0), p - Acc(1), squared};  // inv_p: unused by the gradient
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, batch = blockIdx.y;
  if (e >= N * D) return;
  const int64_t r = e / D, d = e % D, pair0 = (batch * N + r) * k;
  const Acc av = to_math(a[batch * N * D + e]);
  Acc acc(0);
  for (int64_t t = 0; t < k; ++t) {
    const int64_t j = indices[pair0 + t];
    if (j < 0) continue;  // a missing neighbour
    const Acc v = to_math(values[pair0 + t]);
    acc += grad_term<MT>(av - to_math(b[(batch * M + j) * D + d]), pair_weight<MT>(to_math(grad[pair0 + t]), v, prm), v,
                         prm);
  }
  ga[batch * N * D + e] = acc;
}

template <typename T, Metric MT>
__global__ void select_grad_b_kernel(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ grad,
                                     const T* __restrict__ values, const int64_t* __restrict__ keys,
                                     const int64_t* __restrict__ order, typename MathType<T>::type* __restrict__ gb,
                                     int64_t pairs, int64_t B, int64_t N, int64_t M, int64_t D, int64_t k,
                                     typename MathType<T>::type p, bool squared) {
  using Acc = typename MathType<T>::type;
  const MetricParams<Acc> prm{p, Acc(0), p - Acc(1), squared};
  const int64_t e = blockIdx.x;
  const int64_t key = keys[e];
  if (key >= B * M || (e > 0 && keys[e - 1] == key)) return;  // a missing pair, or not the start of a run
  const int64_t batch = key / M;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const Acc bv = to_math(b[key * D + d]);
    Acc acc(0);
    for (int64_t f = e; f < pairs && keys[f] == key; ++f) {
      const int64_t pair = order[f], i = pair / k % N;
      const Acc v = to_math(values[pair]);
      acc -=
          grad_term<MT>(to_math(a[(batch * N + i) * D + d]) - bv, pair_weight<MT>(to_math(grad[pair]), v, prm), v, prm);
    }
    gb[key * D + d] = acc;
  }
}

// f(T(), tag) with T the storage type of dtype and tag the metric as a compile-time code.
template <typename F> cudaError_t visit(DType dtype, Metric metric, const F& f) {
  return visit_dtype(dtype, [&](auto type) {
    return visit_metric(metric, [&](auto tag) { return f(typename decltype(type)::type(), tag); });
  });
}

}  // namespace

cudaError_t pairwise_distances_direct(DType dtype, Metric metric, double p, bool squared, const void* a, const void* b,
                                      const int64_t* la, const int64_t* lb, void* out, int64_t B, int64_t N, int64_t M,
                                      int64_t D, cudaStream_t stream) {
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
            static_cast<const T*>(a) + b0 * N * D, static_cast<const T*>(b) + b0 * M * D, la ? la + b0 : nullptr,
            lb ? lb + b0 : nullptr, static_cast<T*>(out) + b0 * N * M, N, M, D, t0 * kTileN, Acc(p),
            Acc(p > 0 ? 1.0 / p : 0.0), squared);
        return cudaSuccess;
      });
    });
  });
}

cudaError_t pairwise_distances_grad(DType dtype, Metric metric, double p, bool squared, const void* x, const void* y,
                                    const void* grad, const void* dist, const int64_t* lr, const int64_t* lc,
                                    void* grad_x, int64_t B, int64_t R, int64_t C, int64_t D, int64_t s_r, int64_t s_c,
                                    cudaStream_t stream) {
  if (B == 0 || R == 0 || D == 0) return cudaSuccess;
  return visit(dtype, metric, [&](auto type_tag, auto metric_tag) {
    using T = decltype(type_tag);
    using Acc = typename MathType<T>::type;
    constexpr Metric MT = decltype(metric_tag)::value;
    const int64_t blocks = (R * D + kGradThreads - 1) / kGradThreads;
    if (blocks > 2147483647) return cudaErrorInvalidConfiguration;
    return for_grid_slices(B, [&](int64_t b0, int64_t nb) {  // batches on grid y
      const int64_t pair_off = b0 * R * C;
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(nb));
      FUSED_LAUNCH(grid, kGradThreads, 0, stream, grad_kernel<T, MT>)(
          static_cast<const T*>(x) + b0 * R * D, static_cast<const T*>(y) + b0 * C * D,
          static_cast<const T*>(grad) + pair_off, static_cast<const T*>(dist) + pair_off, lr ? lr + b0 : nullptr,
          lc ? lc + b0 : nullptr, static_cast<Acc*>(grad_x) + b0 * R * D, R, C, D, s_r, s_c, Acc(p), squared);
      return cudaSuccess;
    });
  });
}

cudaError_t select_direct(DType dtype, Metric metric, double p, bool squared, bool largest, bool within, double radius,
                          const void* a, const void* b, const int64_t* la, const int64_t* lb, void* values,
                          int64_t* indices, int64_t B, int64_t N, int64_t M, int64_t D, int64_t k, int64_t width,
                          cudaStream_t stream) {
  if (B == 0 || N == 0 || width == 0) return cudaSuccess;
  if (k < 1 || k > kMaxSelect) return cudaErrorInvalidValue;
  return visit(dtype, metric, [&](auto type_tag, auto metric_tag) {
    using T = decltype(type_tag);
    using Acc = typename MathType<T>::type;
    constexpr Metric MT = decltype(metric_tag)::value;
    // Values are compared in Acc: the bound is the largest Acc not above the radius.
    Acc bound = static_cast<Acc>(radius);
    if (static_cast<double>(bound) > radius) bound = std::nextafter(bound, -std::numeric_limits<Acc>::infinity());
    const int64_t tile_rows = kSelectTile<Acc> / (D > 0 ? D : 1);
    if (tile_rows < 1) return cudaErrorInvalidValue;  // D too large for one row of b in the tile
    const int64_t blocks = (N + kSelectThreads - 1) / kSelectThreads;
    if (blocks > 2147483647) return cudaErrorInvalidConfiguration;
    auto launch = [&](auto kmax) {
      constexpr int KMAX = decltype(kmax)::value;
      return for_grid_slices(B, [&](int64_t b0, int64_t nb) {  // batches on grid y
        const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(nb));
        FUSED_LAUNCH(grid, kSelectThreads, 0, stream, select_kernel<T, MT, KMAX>)(
            static_cast<const T*>(a) + b0 * N * D, static_cast<const T*>(b) + b0 * M * D, la ? la + b0 : nullptr,
            lb ? lb + b0 : nullptr, static_cast<T*>(values) + b0 * N * width, indices + b0 * N * width, N, M, D,
            static_cast<int>(k), width, tile_rows, largest, within, bound, Acc(p), Acc(p > 0 ? 1.0 / p : 0.0), squared);
        return cudaSuccess;
      });
    };
    // The list lives in registers for k = 1 (chamfer), in local memory above.
    if (k == 1) return launch(std::integral_constant<int, 1>());
    if (k <= 16) return launch(std::integral_constant<int, 16>());
    return launch(std::integral_constant<int, kMaxSelect>());
  });
}

cudaError_t select_grad(DType dtype, Metric metric, double p, bool squared, const void* a, const void* b,
                        const void* grad, const void* values, const int64_t* indices, const int64_t* keys,
                        const int64_t* order, void* grad_a, void* grad_b, int64_t B, int64_t N, int64_t M, int64_t D,
                        int64_t k, cudaStream_t stream) {
  const int64_t pairs = B * N * k;
  if (pairs == 0 || D == 0) return cudaSuccess;
  return visit(dtype, metric, [&](auto type_tag, auto metric_tag) {
    using T = decltype(type_tag);
    using Acc = typename MathType<T>::type;
    constexpr Metric MT = decltype(metric_tag)::value;
    const int64_t blocks = (N * D + kGradThreads - 1) / kGradThreads;
    if (blocks > 2147483647 || pairs > 2147483647) return cudaErrorInvalidConfiguration;
    const T *at = static_cast<const T*>(a), *bt = static_cast<const T*>(b), *gt = static_cast<const T*>(grad),
            *vt = static_cast<const T*>(values);
    cudaError_t err = for_grid_slices(B, [&](int64_t b0, int64_t nb) {  // batches on grid y
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(nb));
      FUSED_LAUNCH(grid, kGradThreads, 0, stream, select_grad_a_kernel<T, MT>)(
          at + b0 * N * D, bt + b0 * M * D, gt + b0 * N * k, vt + b0 * N * k, indices + b0 * N * k,
          static_cast<Acc*>(grad_a) + b0 * N * D, N, M, D, k, Acc(p), squared);
      return cudaSuccess;
    });
    if (err != cudaSuccess) return err;
    FUSED_LAUNCH(dim3(static_cast<unsigned>(pairs)), 32, 0, stream, select_grad_b_kernel<T, MT>)(
        at, bt, gt, vt, keys, order, static_cast<Acc*>(grad_b), pairs, B, N, M, D, k, Acc(p), squared);
    return cudaGetLastError();
  });
}

}  // namespace distance
}  // namespace cuda
}  // namespace fused
