// Kernels that check the CUDA host emulation itself; see selftest_kernels.h. Written as CUDA, compiled for the host.
#include "selftest_kernels.h"

#include "common/cuda_host.h"

namespace fused {
namespace emu_selftest {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__global__ void scale_kernel(const float* x, float* y, int64_t n, int overrun) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n + overrun) y[i] = 2.f * x[i];
}

__global__ void block_sum_kernel(const float* x, float* out, bool barrier) {
  __shared__ float s[1024];
  const unsigned t = threadIdx.x;
  s[t] = x[blockIdx.x * blockDim.x + t];
  if (barrier) __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (t < half) s[t] += s[t + half];
    if (barrier) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

__global__ void warp_sum_kernel(const float* x, float* out, int first_offset) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  float v = x[t];
  for (int o = first_offset; o > 0; o >>= 1) v += __shfl_down_sync(kFull, v, o);
  if (threadIdx.x % 32 == 0) out[t / 32] = v;
}

__global__ void rotate_kernel(const int* x, int* out) {
  __shared__ int s[1024];
  const unsigned t = threadIdx.x;
  s[t] = x[t];
  __syncthreads();
  out[t] = s[(t + 1) % blockDim.x];
}

__global__ void collective_kernel(const int* x, int* out, int kind, unsigned mask, unsigned exited, int arg,
                                  int width) {
  __shared__ int s[1024];
  const unsigned t = threadIdx.x;
  if (exited >> (t % 32) & 1) {
    out[t] = -3;
    return;
  }
  if (!(mask >> (t % 32) & 1)) {
    out[t] = -2;
    return;
  }
  const int v = x[t];
  switch (kind) {
    case 0: out[t] = __shfl_sync(mask, v, arg, width); break;
    case 1: out[t] = __shfl_up_sync(mask, v, unsigned(arg), width); break;
    case 2: out[t] = __shfl_down_sync(mask, v, unsigned(arg), width); break;
    case 3: out[t] = __shfl_xor_sync(mask, v, arg, width); break;
    case 4: out[t] = int(__ballot_sync(mask, v)); break;
    case 5: out[t] = __any_sync(mask, v); break;
    case 6: out[t] = __all_sync(mask, v); break;
    default:  // 7, or 8: without the __syncwarp
      s[t] = v;
      if (kind == 7) __syncwarp(mask);
      out[t] = s[t ^ 1];
  }
}

__global__ void atomics_kernel(unsigned* counters, unsigned limit) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&counters[0], 1u);
  atomicOr(&counters[1], 1u << (t % 32));
  atomicInc(&counters[2], limit);
  atomicMax(&counters[3], t);
}

__global__ void fault_kernel(int mode) {
  const unsigned t = threadIdx.x;
  int v = int(t);
  if (mode == 0) {
    if (t % 2) __syncthreads();
    else __syncthreads();
  } else if (mode == 1) {
    if (t % 32 < 16) v = __shfl_xor_sync(kFull, v, 1);
    else v = __shfl_down_sync(kFull, v, 1);
  } else if (mode == 2) {
    if (t < 16) v = __shfl_xor_sync(kFull, v, 1);
    else __syncthreads();
  } else {
    v = __shfl_sync(1u, v, 0);
  }
}

}  // namespace

cudaError_t scale(const float* x, float* y, int64_t n, int overrun, int threads) {
  FUSED_LAUNCH(unsigned((n + threads - 1) / threads), threads, 0, nullptr, scale_kernel)(x, y, n, overrun);
  return cudaGetLastError();
}

cudaError_t block_sum(const float* x, float* out, int blocks, int threads, bool barrier) {
  FUSED_LAUNCH(blocks, threads, 0, nullptr, block_sum_kernel)(x, out, barrier);
  return cudaGetLastError();
}

cudaError_t warp_sum(const float* x, float* out, int warps, int first_offset) {
  FUSED_LAUNCH(warps, 32, 0, nullptr, warp_sum_kernel)(x, out, first_offset);
  return cudaGetLastError();
}

cudaError_t rotate(const int* x, int* out, int threads) {
  FUSED_LAUNCH(1, threads, 0, nullptr, rotate_kernel)(x, out);
  return cudaGetLastError();
}

cudaError_t collective(const int* x, int* out, int threads, int kind, unsigned mask, unsigned exited, int arg,
                       int width) {
  FUSED_LAUNCH(1, threads, 0, nullptr, collective_kernel)(x, out, kind, mask, exited, arg, width);
  return cudaGetLastError();
}

cudaError_t atomics(unsigned* counters, int blocks, int threads, unsigned limit) {
  FUSED_LAUNCH(blocks, threads, 0, nullptr, atomics_kernel)(counters, limit);
  return cudaGetLastError();
}

cudaError_t fault(int mode) {
  const unsigned threads = mode == 4 ? 2048 : 64;
  const dim3 grid(1, mode == 5 ? 65536 : 1);
  const size_t dynamic_shared = mode == 6 ? 1024 : 0;
  FUSED_LAUNCH(grid, threads, dynamic_shared, nullptr, fault_kernel)(mode);
  return cudaGetLastError();
}

}  // namespace emu_selftest
}  // namespace fused
