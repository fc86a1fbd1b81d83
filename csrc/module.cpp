// The extension module fused._C. Importing it runs the static registrations of every op family
// (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL blocks in csrc/<family>/).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(fused, m) {}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "fused kernels (ops register as torch.ops.fused.*)", -1,
                               nullptr};
  return PyModule_Create(&module);
}
