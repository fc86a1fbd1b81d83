// Registration helpers: def_with_cuda_twin for a family's schema file (<family>_schema.cpp), FUSED_IMPL_CPU and
// FUSED_IMPL_CUDA for its kernel files.
#pragma once
#include <torch/library.h>

#include <string>

namespace fused {

// Defines fused::<op> from `schema` and its CUDA twin fused::cuda_<op> with the same arguments and returns. The
// op's CUDA key belongs to the Python router (register_gpu in fused/_backend.py), which calls either the CUDA C++
// kernel, registered on the twin in <family>_cuda.cpp, or the Triton launcher. Twins exist in every build; they
// have a kernel only where the CUDA sources were compiled.
inline void def_with_cuda_twin(torch::Library& m, const char* schema) {
  m.def(schema);
  m.def(("cuda_" + std::string(schema)).c_str());
}

}  // namespace fused

// A family's kernels registered from one list of its ops, which its <family>_args.h defines as
// FUSED_<FAMILY>_OPS(X): X("op", fn) per op. Inside TORCH_LIBRARY_IMPL(fused, CPU, m),
// FUSED_<FAMILY>_OPS(FUSED_IMPL_CPU) registers fn_cpu on fused::op; inside TORCH_LIBRARY_IMPL(fused, CUDA, m),
// FUSED_<FAMILY>_OPS(FUSED_IMPL_CUDA) registers fn_cuda on the twin fused::cuda_op.
#define FUSED_IMPL_CPU(op, fn) m.impl(op, &fn##_cpu);
#define FUSED_IMPL_CUDA(op, fn) m.impl("cuda_" op, &fn##_cuda);
