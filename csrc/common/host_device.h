// FUSED_HD: a function callable from host code and, under nvcc, from CUDA device code.
#pragma once

#if defined(__CUDACC__)
#define FUSED_HD __host__ __device__ __forceinline__
#else
#define FUSED_HD inline
#endif
