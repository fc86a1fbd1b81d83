// Tiny CUDA kernels that check the host emulation itself (tests/test_cuda_emulation.py): that it runs CUDA's
// semantics (threads interleaving at barriers, shuffles, votes, atomics) and that planted bugs show.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace fused {
namespace emu_selftest {

// y[i] = 2 x[i] for i < n + overrun (overrun 1: the off-by-one tail).
cudaError_t scale(const float* x, float* y, int64_t n, int overrun, int threads);
// out[b] = the sum of x[b * threads + t] over the block's threads, a tree in shared memory; without `barrier`,
// the __syncthreads between its levels are missing.
cudaError_t block_sum(const float* x, float* out, int blocks, int threads, bool barrier);
// out[w] = the sum of x over warp w by __shfl_down_sync with offsets first_offset, first_offset / 2, ..., 1
// (16 is right; 8 the wrong offset).
cudaError_t warp_sum(const float* x, float* out, int warps, int first_offset);
// out[t] = x[(t + 1) % threads] after each thread wrote x[t] to shared memory and a barrier: only right when the
// threads interleave at the barrier.
cudaError_t rotate(const int* x, int* out, int threads);
// out[t] = thread t's result of a collective over x[t] among the lanes of `mask`: kind 0-3 __shfl_sync / _up /
// _down / _xor with arg and width, 4 __ballot_sync, 5 __any_sync, 6 __all_sync of x[t] != 0, 7 x[t ^ 1] read from
// shared memory after __syncwarp (8: without it). Lanes in `exited` return first (out -3), then the lanes outside
// the mask (-2).
cudaError_t collective(const int* x, int* out, int threads, int kind, unsigned mask, unsigned exited, int arg,
                       int width);
// counters[0] += 1 (atomicAdd), counters[1] |= 1 << (t % 32) (atomicOr), counters[2]: atomicInc with limit
// `limit`, counters[3]: atomicMax of t, by every thread of every block.
cudaError_t atomics(unsigned* counters, int blocks, int threads, unsigned limit);
// Launches that must fail: 0 a divergent __syncthreads, 1 half a warp at one shuffle and half at another with the
// same mask, 2 half a warp at a shuffle and half at __syncthreads (deadlock), 3 lanes calling a shuffle whose
// mask leaves them out, 4 a block of 2048 threads, 5 a grid of 65536 blocks on y, 6 dynamic shared memory (not
// emulated).
cudaError_t fault(int mode);

}  // namespace emu_selftest
}  // namespace fused
