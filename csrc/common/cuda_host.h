// The launch form of every CUDA kernel, and a host emulation of CUDA's execution model that runs the same .cu files
// on the CPU for the test suite (tests/cuda_emulation.py builds them with g++; production builds never do).
//
// Every launcher writes FUSED_LAUNCH(grid, block, smem, stream, kernel)(args...): under nvcc the real
// kernel<<<grid, block, smem, stream>>>(args...). Compiled by a host compiler, this header stands in for the device:
// each CUDA thread of a block is a fiber with its own stack (tests/emulation/cuda_host.cpp), switched cooperatively,
// so threads really interleave at __syncthreads() and at every warp collective; a shuffle returns the value its
// source lane held at that instruction; __shared__ variables are one copy for the block that runs, filled with 0xff
// bytes (NaN) before a launch (and what its first block wrote, before each later block), so a read before any write
// shows; blocks run one after another in a shuffled order, threads between two barriers in a shuffled order too
// (tests pick the seed). Threads that exited are not waited for, at barriers or in warp collectives (a shuffle
// reading from one gets 0xff bytes). Failed launches: configurations a GPU refuses, a barrier or warp collective
// that can never complete (deadlock), threads of a block waiting at different __syncthreads, lanes of one mask at
// different collectives. Atomics are plain read-modify-writes (one fiber runs at a time); memory is sequentially
// consistent, so __threadfence is a no-op. Not shown: the GPU memory model and real data races, occupancy and
// timing, nvcc's own code generation.
#pragma once

#if defined(__CUDACC__)

#define FUSED_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>

#else  // host emulation

#if !defined(__x86_64__)
#error "the CUDA host emulation switches fibers with x86-64 code"
#endif

// The CUDA headers first: they must not see the macros below.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>  // float overloads of sqrt, fabs, pow, fma, isnan... in the global namespace, as in device code

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace fused {
namespace emu {

// Set by the scheduler whenever it switches to a thread, a block or a launch.
extern uint3 thread_idx, block_idx;
extern dim3 block_dim, grid_dim;

// Runs kernel(ctx) as every thread of every block of the grid; on any error, sets the host thread's last CUDA
// error (cudaGetLastError) and the message last_fault() returns.
void run_grid(dim3 grid, dim3 block, size_t smem, void (*kernel)(void*), void* ctx);
const char* last_fault();
// The emulated device: its multiprocessor count (cudaDevAttrMultiProcessorCount), and the seed of the block and
// thread orders (0: blocks and threads in index order).
void set_sm_count(int sms);
void set_schedule_seed(uint64_t seed);

void syncthreads(const char* file, int line);

enum class Collective { shfl_idx, shfl_up, shfl_down, shfl_xor, syncwarp, ballot, all };
// Waits until every lane of `mask` that has not exited reaches the same collective; returns this lane's result
// (shuffles: the source lane's `bits`, this lane's own where the source is outside its `width` segment, 0xff bytes
// where the source takes no part; ballot: the lanes' votes; all: whether every lane taking part voted).
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t bits, int arg, int width);

template <typename T> T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}
template <typename T> uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp shuffles move at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

// FUSED_LAUNCH's host form: the arguments are copied once, as a launch copies them to the device, and every
// thread calls the kernel with them (by value). Dynamic shared memory (smem > 0) is not emulated: the launch fails.
template <typename Kernel> struct Launch {
  dim3 grid, block;
  size_t smem;
  Kernel kernel;
  template <typename... A> void operator()(A&&... args) const {
    std::tuple<std::decay_t<A>...> params(std::forward<A>(args)...);
    auto body = [&] { std::apply(kernel, params); };
    run_grid(grid, block, smem, [](void* b) { (*static_cast<decltype(body)*>(b))(); }, &body);
  }
};
template <typename Kernel> Launch<Kernel> launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, Kernel k) {
  return {grid, block, smem, k};
}

}  // namespace emu
}  // namespace fused

#define FUSED_LAUNCH(grid, block, smem, stream, ...)          \
  ::fused::emu::launch(dim3(grid), dim3(block), smem, stream, \
                       [](auto&... fused_emu_args) { __VA_ARGS__(fused_emu_args...); })

// ---- CUDA's language extensions and built-in variables ----
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#define __global__
#define __device__
#define __host__
// One copy per program; tests/emulation/shared_memory.ld gathers them so that the scheduler can fill them with 0xff.
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (static_cast<const uint3&>(::fused::emu::thread_idx))
#define blockIdx (static_cast<const uint3&>(::fused::emu::block_idx))
#define blockDim (static_cast<const dim3&>(::fused::emu::block_dim))
#define gridDim (static_cast<const dim3&>(::fused::emu::grid_dim))
constexpr int warpSize = 32;

#define __syncthreads() ::fused::emu::syncthreads(__FILE__, __LINE__)
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---- warp collectives ----
template <typename T> T __shfl_sync(unsigned mask, T v, int src, int width = warpSize) {
  using namespace fused::emu;
  return from_bits<T>(warp_collective(Collective::shfl_idx, mask, to_bits(v), src, width));
}
template <typename T> T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  using namespace fused::emu;
  return from_bits<T>(warp_collective(Collective::shfl_up, mask, to_bits(v), int(delta), width));
}
template <typename T> T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  using namespace fused::emu;
  return from_bits<T>(warp_collective(Collective::shfl_down, mask, to_bits(v), int(delta), width));
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
  using namespace fused::emu;
  return from_bits<T>(warp_collective(Collective::shfl_xor, mask, to_bits(v), lane_mask, width));
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  fused::emu::warp_collective(fused::emu::Collective::syncwarp, mask, 0, 0, warpSize);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return unsigned(fused::emu::warp_collective(fused::emu::Collective::ballot, mask, pred != 0, 0, warpSize));
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
  return int(fused::emu::warp_collective(fused::emu::Collective::all, mask, pred != 0, 0, warpSize));
}

// ---- atomics: one fiber runs at a time, so a plain read-modify-write is atomic ----
// Each atomic stores update(old) and returns old.
template <typename T, typename Update> T fused_emu_atomic(T* p, Update update) {
  const T old = *p;
  *p = update(old);
  return old;
}
template <typename T> T atomicAdd(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return T(old + v); });
}
template <typename T> T atomicSub(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return T(old - v); });
}
template <typename T> T atomicExch(T* p, T v) {
  return fused_emu_atomic(p, [&](T) { return v; });
}
template <typename T> T atomicMin(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return v < old ? v : old; });
}
template <typename T> T atomicMax(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return v > old ? v : old; });
}
template <typename T> T atomicAnd(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return T(old & v); });
}
template <typename T> T atomicOr(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return T(old | v); });
}
template <typename T> T atomicXor(T* p, T v) {
  return fused_emu_atomic(p, [&](T old) { return T(old ^ v); });
}
template <typename T> T atomicCAS(T* p, T compare, T v) {
  return fused_emu_atomic(p, [&](T old) { return old == compare ? v : old; });
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  return fused_emu_atomic(p, [&](unsigned old) { return old >= limit ? 0u : old + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
  return fused_emu_atomic(p, [&](unsigned old) { return old == 0 || old > limit ? limit : old - 1; });
}

// ---- the math intrinsics the kernels use (a kernel that takes a new one fails to compile here: add it) ----
inline float __int_as_float(int v) { return fused::emu::from_bits<float>(uint32_t(v)); }
inline int __float_as_int(float v) { return int(uint32_t(fused::emu::to_bits(v))); }
inline float __uint_as_float(unsigned v) { return fused::emu::from_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return unsigned(fused::emu::to_bits(v)); }
// Rounded on their own: the empty asm keeps the host compiler from contracting them into an FMA, as nvcc keeps
// the _rn intrinsics (the emulation build contracts a * b + c elsewhere, as nvcc does by default).
template <typename T> inline T fused_emu_rounded(T v) {
  __asm__("" : "+x"(v));
  return v;
}
inline float __fmul_rn(float a, float b) { return fused_emu_rounded(a * b); }
inline double __dmul_rn(double a, double b) { return fused_emu_rounded(a * b); }

#endif  // __CUDACC__
