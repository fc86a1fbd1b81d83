// CUDA kernels of the fused elementwise family (launchers declared in elementwise_kernels.h), torch-free.
// Memory-bound: each thread handles groups of N consecutive elements (16 bytes; 32 for double dropout), read
// and written with vector accesses when every pointer is 16-byte aligned (scalar accesses otherwise),
// grid-stride loops with 64-bit indices. The math is csrc/common/pointwise_math.h, shared with the CPU kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common/cuda_convert.cuh"
#include "common/cuda_host.h"
#include "common/philox.h"
#include "common/scalar_math.h"
#include "elementwise/elementwise_kernels.h"

namespace fused {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // one wave at full occupancy; the grid-stride loops cover the rest

template <typename S> using Math = typename MathType<S>::type;
template <typename S> constexpr int kVec = 16 / sizeof(S);  // elements per 16-byte access

// N elements moved as one (or, above 16 bytes, several) vector accesses.
template <typename S, int N> struct alignas(sizeof(S) * N < 16 ? sizeof(S) * N : 16) Pack {
  S v[N];
};

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// v[k] = p[k] for k < len (0 beyond): one vector load when `vec` and the group is full.
template <int N, typename T, typename S>
__device__ __forceinline__ void load(T (&v)[N], const S* __restrict__ p, int len, bool vec) {
  if (vec && len == N) {
    const Pack<S, N> pk = *reinterpret_cast<const Pack<S, N>*>(p);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = to_math(pk.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = k < len ? to_math(p[k]) : T(0);
  }
}

// p[k] = v[k] for k < len.
template <int N, typename T, typename S>
__device__ __forceinline__ void store(S* __restrict__ p, const T (&v)[N], int len, bool vec) {
  if (vec && len == N) {
    Pack<S, N> pk;
#pragma unroll
    for (int k = 0; k < N; ++k) pk.v[k] = from_math<S>(v[k]);
    *reinterpret_cast<Pack<S, N>*>(p) = pk;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (k < len) p[k] = from_math<S>(v[k]);
  }
}

// v[k] += bias[col + k], wrapping to column 0 at the end of a row of width C.
template <int N, typename T, typename S>
__device__ __forceinline__ void add_bias(T (&v)[N], const S* __restrict__ bias, int64_t col, int64_t C, int len) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < len) {
      v[k] += to_math(bias[col]);
      if (++col == C) col = 0;
    }
  }
}

__device__ __forceinline__ uint32_t philox_word(const Philox4& r, uint32_t w) {
  return w == 0 ? r.v[0] : w == 1 ? r.v[1] : w == 2 ? r.v[2] : r.v[3];
}

// keep[k] = scale if element i + k survives dropout, else 0 (csrc/common/philox.h): one Philox call per
// counter (i + k) / 4 touched, whatever the alignment of i.
template <int N, typename T>
__device__ __forceinline__ void dropout_scale(T (&keep)[N], int64_t i, int len, const Dropout& d) {
  const T scale = static_cast<T>(d.scale);
  const uint64_t first = static_cast<uint64_t>(i), last = first + len - 1;
#pragma unroll
  for (int k = 0; k < N; ++k) keep[k] = T(0);
#pragma unroll 1
  for (uint64_t ctr = first >> 2; ctr <= last >> 2; ++ctr) {
    const Philox4 r = philox4x32_10(ctr, d.seed);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const uint64_t e = first + k;
      if (k < len && (e >> 2) == ctr) keep[k] = philox_word(r, uint32_t(e & 3)) >= d.threshold ? scale : T(0);
    }
  }
}

// f(tag, s, j) for op j of the chain, in order: decltype(tag)::value is the op, s its scalar in T.
template <typename T, typename F> __device__ __forceinline__ void for_each_op(const UnaryChain& chain, const F& f) {
  for (int j = 0; j < chain.len; ++j) {
    const T s = static_cast<T>(chain.scalars[j]);
    visit_unary(chain.ops[j], [&](auto tag) { f(tag, s, j); });
  }
}

// ---- per-group bodies: body(v, i, col, len, vec) handles elements [i, i + len) (column col of the first,
// in rows of width C), writes its outputs, and leaves in v the values the bias gradient sums (grad_x). ----

template <typename S, int N, Act A> struct BiasActFwd {
  const S* x;
  const S* bias;  // may be null
  S* y;
  int64_t C;
  __device__ void operator()(Math<S> (&v)[N], int64_t i, int64_t col, int len, bool vec) const {
    load(v, x + i, len, vec);
    if (bias) add_bias(v, bias, col, C, len);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = act_fwd<A>(v[k]);
    store(y + i, v, len, vec);
  }
};

template <typename S, int N, Act A> struct BiasActGrad {
  const S* grad;
  const S* x;
  const S* bias;  // may be null
  S* grad_x;
  int64_t C;
  __device__ void operator()(Math<S> (&v)[N], int64_t i, int64_t col, int len, bool vec) const {
    Math<S> g[N];
    load(v, x + i, len, vec);
    load(g, grad + i, len, vec);
    if (bias) add_bias(v, bias, col, C, len);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = act_backward<A>(g[k], v[k]);
    store(grad_x + i, v, len, vec);
  }
};

template <typename S, int N> struct BiasDropoutAdd {
  const S* x;
  const S* bias;  // may be null
  const S* residual;
  S* y;
  int64_t C;
  Dropout dropout;
  __device__ void operator()(Math<S> (&v)[N], int64_t i, int64_t col, int len, bool vec) const {
    Math<S> r[N], keep[N];
    load(v, x + i, len, vec);
    load(r, residual + i, len, vec);
    if (bias) add_bias(v, bias, col, C, len);
    dropout_scale(keep, i, len, dropout);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = r[k] + mul_rn(v[k], keep[k]);  // the CPU's rounding: no fused multiply-add
    store(y + i, v, len, vec);
  }
};

// One input, one output: v = in[i, i + len), f(v, i, len) rewrites v, out[i, i + len) = v.
template <typename S, int N, typename F> struct MapInOut {
  const S* in;
  S* out;
  F f;
  __device__ void operator()(Math<S> (&v)[N], int64_t i, int64_t, int len, bool vec) const {
    load(v, in + i, len, vec);
    f(v, i, len);
    store(out + i, v, len, vec);
  }
};

// grad_x = grad * keep: dropout_backward.
struct DropoutMask {
  Dropout dropout;
  template <int N, typename T> __device__ void operator()(T (&v)[N], int64_t i, int len) const {
    T keep[N];
    dropout_scale(keep, i, len, dropout);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] *= keep[k];
  }
};
template <typename S, int N> using DropoutGrad = MapInOut<S, N, DropoutMask>;

// y = op_last(... op_0(x)): unary_chain.
struct ChainOps {
  UnaryChain chain;
  template <int N, typename T> __device__ void operator()(T (&v)[N], int64_t, int) const {
    for_each_op<T>(chain, [&](auto tag, T s, int) {
      constexpr UnaryOp O = decltype(tag)::value;
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = unary_fwd<O>(v[k], s);
    });
  }
};
template <typename S, int N> using UnaryChainFwd = MapInOut<S, N, ChainOps>;

// grad_x = grad * prod_j op_j'(input of op j), the chain recomputed alongside.
template <typename S, int N> struct UnaryChainGrad {
  const S* grad;
  const S* x;
  S* grad_x;
  UnaryChain chain;
  __device__ void operator()(Math<S> (&v)[N], int64_t i, int64_t, int len, bool vec) const {
    using T = Math<S>;
    T g[N];
    load(v, x + i, len, vec);
    load(g, grad + i, len, vec);
    for_each_op<T>(chain, [&](auto tag, T s, int j) {
      constexpr UnaryOp O = decltype(tag)::value;
      const bool zero_grad = O == UnaryOp::pow && chain.scalars[j] == 0.0;  // d/dx x^0 = 0
#pragma unroll
      for (int k = 0; k < N; ++k) {
        g[k] = zero_grad ? T(0) : unary_backward<O>(g[k], v[k], s);
        v[k] = unary_fwd<O>(v[k], s);
      }
    });
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = g[k];
    store(grad_x + i, v, len, vec);
  }
};

// ---- kernels ----

// Flat: body over groups of N elements covering [0, n), grid-stride. The column of each group's first element
// in rows of width C (C = 1 without bias) advances by a fixed step, so no division per group.
template <typename T, int N, typename Body>
__global__ void __launch_bounds__(kThreads) map_kernel(Body body, int64_t n, int64_t C, bool vec) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t col = (g * N) % C;
  const int64_t step = (stride * N) % C;
  for (; g * N < n; g += stride) {
    const int64_t i = g * N;
    T v[N];
    body(v, i, col, static_cast<int>(n - i < N ? n - i : N), vec);
    col += step;
    if (col >= C) col -= C;
  }
}

// Rows x C, body per group of N columns of one row, and the column sums of what body leaves in v: block
// (x, y) sums rows [y * rows_per_chunk, (y + 1) * rows_per_chunk) of its columns in a fixed order (registers,
// then a tree over threadIdx.y) into partial[y * C + col]. Fixed chunks and order: deterministic, no atomics.
template <typename T, int N, typename Body>
__global__ void __launch_bounds__(kThreads)
    column_sum_kernel(Body body, T* __restrict__ partial, int64_t rows, int64_t C, int64_t rows_per_chunk, bool vec) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  const int len = col < C ? static_cast<int>(C - col < N ? C - col : N) : 0;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = rows < r0 + rows_per_chunk ? rows : r0 + rows_per_chunk;
  T acc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = T(0);
  if (len > 0) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
      T v[N];
      body(v, r * C + col, col, len, vec);
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += v[k];
    }
  }
  __shared__ T sums[N][kThreads];
#pragma unroll
  for (int k = 0; k < N; ++k) sums[k][tid] = acc[k];
  __syncthreads();
  for (int half = blockDim.y / 2; half > 0; half /= 2) {
    if (threadIdx.y < half) {
#pragma unroll
      for (int k = 0; k < N; ++k) sums[k][tid] += sums[k][tid + half * blockDim.x];
    }
    __syncthreads();
  }
  if (threadIdx.y == 0) {
    for (int k = 0; k < len; ++k) partial[int64_t(blockIdx.y) * C + col + k] = sums[k][threadIdx.x];
  }
}

// out[c] = sum over chunks of partial[chunk * C + c], in chunk order.
template <typename S, typename T>
__global__ void __launch_bounds__(kThreads)
    column_sum_finish_kernel(const T* __restrict__ partial, S* __restrict__ out, int64_t chunks, int64_t C) {
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < C; c += int64_t(gridDim.x) * blockDim.x) {
    T s = T(0);
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * C + c];
    out[c] = from_math<S>(s);
  }
}

// Rows x cols with row strides: f(r, c, len) per group of N columns, grid-stride over a 2-D grid.
template <int N, typename F> __device__ __forceinline__ void for_each_row_group(int64_t rows, int64_t cols, F&& f) {
  const int64_t groups = ceil_div(cols, N);
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += int64_t(gridDim.y) * blockDim.y)
    for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < groups; p += int64_t(gridDim.x) * blockDim.x) {
      const int64_t c = p * N;
      f(r, c, static_cast<int>(cols - c < N ? cols - c : N));
    }
}

template <typename S, Act A>
__global__ void __launch_bounds__(kThreads)
    glu_kernel(const S* __restrict__ gate, int64_t gate_stride, const S* __restrict__ up, int64_t up_stride,
               S* __restrict__ y, int64_t rows, int64_t cols, bool vec) {
  using T = Math<S>;
  constexpr int N = kVec<S>;
  for_each_row_group<N>(rows, cols, [&](int64_t r, int64_t c, int len) {
    T g[N], u[N];
    load(g, gate + r * gate_stride + c, len, vec);
    load(u, up + r * up_stride + c, len, vec);
#pragma unroll
    for (int k = 0; k < N; ++k) g[k] = act_fwd<A>(g[k]) * u[k];
    store(y + r * cols + c, g, len, vec);
  });
}

template <typename S, Act A>
__global__ void __launch_bounds__(kThreads)
    glu_backward_kernel(const S* __restrict__ grad, const S* __restrict__ gate, int64_t gate_stride,
                        const S* __restrict__ up, int64_t up_stride, S* __restrict__ grad_gate, S* __restrict__ grad_up,
                        int64_t rows, int64_t cols, bool vec) {
  using T = Math<S>;
  constexpr int N = kVec<S>;
  for_each_row_group<N>(rows, cols, [&](int64_t r, int64_t c, int len) {
    T g[N], u[N], d[N];
    load(g, gate + r * gate_stride + c, len, vec);
    load(u, up + r * up_stride + c, len, vec);
    load(d, grad + r * cols + c, len, vec);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      T y, dy;
      act_fwd_and_grad<A>(g[k], y, dy);                 // one erf / sigmoid for both
      u[k] = times_act_grad<A>(d[k] * u[k], g[k], dy);  // grad_gate
      d[k] = d[k] * y;                                  // grad_up
    }
    store(grad_gate + r * cols + c, u, len, vec);
    store(grad_up + r * cols + c, d, len, vec);
  });
}

// ---- launch helpers ----

bool aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Blocks for one wave of kThreads-thread blocks on the current device.
cudaError_t wave_blocks(int* blocks) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  *blocks = sms * kBlocksPerSm;
  return err;
}

// Flat launch over n elements in groups of N; vec when every pointer is 16-byte aligned.
template <typename T, int N, typename Body>
cudaError_t launch_map(const Body& body, int64_t n, int64_t C, bool vec, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  int wave = 0;
  if (cudaError_t err = wave_blocks(&wave)) return err;
  const int64_t blocks = ceil_div(ceil_div(n, N), kThreads);
  const unsigned grid = static_cast<unsigned>(blocks < wave ? blocks : wave);
  FUSED_LAUNCH(grid, kThreads, 0, stream, map_kernel<T, N>)(body, n, C, vec);
  return cudaGetLastError();
}

struct Chunks {
  int64_t count, rows;
};

// Row chunks of the column sums, fixed by (rows, C) alone so that results do not depend on the device:
// about 2048 blocks in all, at least 16 rows each.
Chunks column_chunks(int64_t rows, int64_t C) {
  const int64_t col_tiles = ceil_div(C, 256);
  const int64_t target = col_tiles < 2048 ? 2048 / col_tiles : 1;
  const int64_t rows_per_chunk = std::max<int64_t>(16, ceil_div(rows, target));
  return {ceil_div(rows, rows_per_chunk), rows_per_chunk};
}

// Column-sum launch over rows x C, then the fixed-order sum of the partials into grad_bias.
template <typename S, typename Body>
cudaError_t launch_column_sum(const Body& body, S* grad_bias, void* workspace, int64_t rows, int64_t C, bool vec,
                              cudaStream_t stream) {
  using T = Math<S>;
  constexpr int N = kVec<S>;
  if (rows <= 0 || C <= 0) return cudaSuccess;
  const Chunks chunks = column_chunks(rows, C);
  const int64_t groups = ceil_div(C, N);
  int bx = 1;
  while (bx < 32 && bx < groups) bx *= 2;
  const int64_t col_blocks = ceil_div(groups, bx);
  if (col_blocks > INT_MAX || chunks.count > 65535) return cudaErrorInvalidConfiguration;
  T* partial = static_cast<T*>(workspace);
  const dim3 grid(unsigned(col_blocks), unsigned(chunks.count)), block(bx, kThreads / bx);
  FUSED_LAUNCH(grid, block, 0, stream, column_sum_kernel<T, N>)(body, partial, rows, C, chunks.rows, vec);
  if (cudaError_t err = cudaGetLastError()) return err;
  const int64_t finish_blocks = std::min<int64_t>(ceil_div(C, kThreads), 65535);
  FUSED_LAUNCH(unsigned(finish_blocks), kThreads, 0, stream, column_sum_finish_kernel<S, T>)(partial, grad_bias,
                                                                                             chunks.count, C);
  return cudaGetLastError();
}

// 2-D launch over rows x cols in groups of N columns: blocks as wide as a row's groups (up to kThreads).
template <int N> cudaError_t rows_grid(int64_t rows, int64_t cols, dim3* grid, dim3* block) {
  int wave = 0;
  if (cudaError_t err = wave_blocks(&wave)) return err;
  const int64_t groups = ceil_div(cols, N);
  int bx = 1;
  while (bx < kThreads && bx < groups) bx *= 2;
  const int by = kThreads / bx;
  const int64_t gx = std::min<int64_t>(ceil_div(groups, bx), wave);
  const int64_t gy = std::min<int64_t>({ceil_div(rows, by), 65535, std::max<int64_t>(1, wave / gx)});
  *grid = dim3(unsigned(gx), unsigned(gy));
  *block = dim3(bx, by);
  return cudaSuccess;
}

// The glu launchers' frame: nothing for empty rows, else f(type, tag, grid, block, vec) for the dtype and the
// act, vec when every pointer is 16-byte aligned and every row starts a whole group of N.
template <typename F>
cudaError_t launch_glu(DType dtype, Act act, std::initializer_list<const void*> ptrs, int64_t gate_stride,
                       int64_t up_stride, int64_t rows, int64_t cols, const F& f) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return visit_dtype(dtype, [&](auto type) {
    constexpr int N = kVec<typename decltype(type)::type>;
    dim3 grid, block;
    if (cudaError_t err = rows_grid<N>(rows, cols, &grid, &block)) return err;
    const bool vec = aligned(ptrs) && cols % N == 0 && gate_stride % N == 0 && up_stride % N == 0;
    return visit_act(act, [&](auto tag) { return f(type, tag, grid, block, vec); });
  });
}

}  // namespace

int64_t column_sum_workspace(int64_t rows, int64_t C) {
  if (rows <= 0 || C <= 0) return 0;
  return column_chunks(rows, C).count * C;
}

cudaError_t bias_act(DType dtype, Act act, const void* x, const void* bias, void* y, int64_t n, int64_t C,
                     cudaStream_t stream) {
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    return visit_act(act, [&](auto tag) {
      constexpr int N = kVec<S>;
      const BiasActFwd<S, N, decltype(tag)::value> body{static_cast<const S*>(x), static_cast<const S*>(bias),
                                                        static_cast<S*>(y), bias ? C : 1};
      return launch_map<Math<S>, N>(body, n, body.C, aligned({x, y}), stream);
    });
  });
}

cudaError_t bias_act_backward(DType dtype, Act act, const void* grad, const void* x, const void* bias, void* grad_x,
                              void* grad_bias, void* workspace, int64_t n, int64_t C, cudaStream_t stream) {
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    return visit_act(act, [&](auto tag) {
      constexpr int N = kVec<S>;
      const BiasActGrad<S, N, decltype(tag)::value> body{static_cast<const S*>(grad), static_cast<const S*>(x),
                                                         static_cast<const S*>(bias), static_cast<S*>(grad_x),
                                                         bias ? C : 1};
      const bool vec = aligned({grad, x, grad_x});
      if (!bias) return launch_map<Math<S>, N>(body, n, 1, vec, stream);
      return launch_column_sum(body, static_cast<S*>(grad_bias), workspace, n / C, C, vec && C % N == 0, stream);
    });
  });
}

cudaError_t glu(DType dtype, Act act, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* y,
                int64_t rows, int64_t cols, cudaStream_t stream) {
  return launch_glu(dtype, act, {gate, up, y}, gate_stride, up_stride, rows, cols,
                    [&](auto type, auto tag, dim3 grid, dim3 block, bool vec) {
                      using S = typename decltype(type)::type;
                      FUSED_LAUNCH(grid, block, 0, stream, glu_kernel<S, decltype(tag)::value>)(
                          static_cast<const S*>(gate), gate_stride, static_cast<const S*>(up), up_stride,
                          static_cast<S*>(y), rows, cols, vec);
                      return cudaGetLastError();
                    });
}

cudaError_t glu_backward(DType dtype, Act act, const void* grad, const void* gate, int64_t gate_stride, const void* up,
                         int64_t up_stride, void* grad_gate, void* grad_up, int64_t rows, int64_t cols,
                         cudaStream_t stream) {
  return launch_glu(dtype, act, {grad, gate, up, grad_gate, grad_up}, gate_stride, up_stride, rows, cols,
                    [&](auto type, auto tag, dim3 grid, dim3 block, bool vec) {
                      using S = typename decltype(type)::type;
                      FUSED_LAUNCH(grid, block, 0, stream, glu_backward_kernel<S, decltype(tag)::value>)(
                          static_cast<const S*>(grad), static_cast<const S*>(gate), gate_stride,
                          static_cast<const S*>(up), up_stride, static_cast<S*>(grad_gate), static_cast<S*>(grad_up),
                          rows, cols, vec);
                      return cudaGetLastError();
                    });
}

cudaError_t bias_dropout_add(DType dtype, const void* x, const void* bias, const void* residual, void* y, int64_t n,
                             int64_t C, Dropout dropout, cudaStream_t stream) {
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    constexpr int N = kVec<S> < 4 ? 4 : kVec<S>;  // whole Philox calls: 4 words each
    const BiasDropoutAdd<S, N> body{static_cast<const S*>(x),
                                    static_cast<const S*>(bias),
                                    static_cast<const S*>(residual),
                                    static_cast<S*>(y),
                                    bias ? C : 1,
                                    dropout};
    return launch_map<Math<S>, N>(body, n, body.C, aligned({x, residual, y}), stream);
  });
}

cudaError_t dropout_backward(DType dtype, const void* grad, void* grad_x, void* grad_bias, void* workspace, int64_t n,
                             int64_t C, Dropout dropout, cudaStream_t stream) {
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    const bool vec = aligned({grad, grad_x});
    if (!grad_bias) {
      constexpr int N = kVec<S> < 4 ? 4 : kVec<S>;
      const DropoutGrad<S, N> body{static_cast<const S*>(grad), static_cast<S*>(grad_x), {dropout}};
      return launch_map<Math<S>, N>(body, n, 1, vec, stream);
    }
    constexpr int N = kVec<S>;
    const DropoutGrad<S, N> body{static_cast<const S*>(grad), static_cast<S*>(grad_x), {dropout}};
    return launch_column_sum(body, static_cast<S*>(grad_bias), workspace, n / C, C, vec && C % N == 0, stream);
  });
}

cudaError_t unary_chain(DType dtype, const UnaryChain& chain, const void* x, void* y, int64_t n, cudaStream_t stream) {
  if (chain.len < 0 || chain.len > kMaxChain) return cudaErrorInvalidValue;
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    constexpr int N = kVec<S>;
    const UnaryChainFwd<S, N> body{static_cast<const S*>(x), static_cast<S*>(y), {chain}};
    return launch_map<Math<S>, N>(body, n, 1, aligned({x, y}), stream);
  });
}

cudaError_t unary_chain_backward(DType dtype, const UnaryChain& chain, const void* grad, const void* x, void* grad_x,
                                 int64_t n, cudaStream_t stream) {
  if (chain.len < 0 || chain.len > kMaxChain) return cudaErrorInvalidValue;
  return visit_dtype(dtype, [&](auto type) {
    using S = typename decltype(type)::type;
    constexpr int N = kVec<S>;
    const UnaryChainGrad<S, N> body{static_cast<const S*>(grad), static_cast<const S*>(x), static_cast<S*>(grad_x),
                                    chain};
    return launch_map<Math<S>, N>(body, n, 1, aligned({grad, x, grad_x}), stream);
  });
}

}  // namespace cuda
}  // namespace fused
