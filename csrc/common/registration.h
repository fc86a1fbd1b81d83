// Registration helpers for a family's schema file (<family>_schema.cpp).
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
