// The extension module fused._C. Importing it runs the static registrations of every op family
// (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL blocks in csrc/<family>/), and it carries the code tables of
// common/op_codes.h as tuples of names (fused/_codes.py turns them into Python's codes).
#include <Python.h>
#include <torch/library.h>

#include "common/huge_pages.h"
#include "common/op_codes.h"
#include "distance/knn_gemm_cpu.h"

TORCH_LIBRARY(fused, m) {}

namespace {

// names[first:last] as a Python tuple of str, added to the module as `attr`.
int add_names(PyObject* module, const char* attr, const char* const* names, int first, int last) {
  PyObject* tuple = PyTuple_New(last - first);
  if (!tuple) return -1;
  for (int i = first; i < last; ++i) {
    PyObject* name = PyUnicode_FromString(names[i]);
    if (!name) {
      Py_DECREF(tuple);
      return -1;
    }
    PyTuple_SET_ITEM(tuple, i - first, name);
  }
  if (PyModule_AddObject(module, attr, tuple) < 0) {
    Py_DECREF(tuple);
    return -1;
  }
  return 0;
}

// advise_huge_pages(address, nbytes): common/huge_pages.h for buffers that Python code allocates (fused/_memory.py).
PyObject* advise_huge_pages_py(PyObject*, PyObject* args) {
  unsigned long long address = 0, nbytes = 0;
  if (!PyArg_ParseTuple(args, "KK", &address, &nbytes)) return nullptr;
  fused::advise_huge_pages(uintptr_t(address), uintptr_t(nbytes));
  Py_RETURN_NONE;
}

// knn_filter(rows, D): the GEMM of the CPU k-NN search's filter (p=2, D >= 32) for a with that many rows,
// "float32" or "int8"; int8_gemm_levels(): the levels of its int8 codes (distance/knn_gemm_cpu.h).
PyObject* knn_filter_py(PyObject*, PyObject* args) {
  long long rows = 0, D = 0;
  if (!PyArg_ParseTuple(args, "LL", &rows, &D)) return nullptr;
  const bool int8 = fused::distance::knn_filter(rows, D) == fused::distance::KnnFilter::kInt8;
  return PyUnicode_FromString(int8 ? "int8" : "float32");
}
PyObject* int8_gemm_levels_py(PyObject*, PyObject*) { return PyLong_FromLong(fused::distance::int8_gemm_levels()); }

PyMethodDef methods[] = {
    {"advise_huge_pages", advise_huge_pages_py, METH_VARARGS, "MADV_HUGEPAGE on the whole 2 MB pages of a CPU range"},
    {"knn_filter", knn_filter_py, METH_VARARGS, "the GEMM of the CPU k-NN filter: float32 or int8"},
    {"int8_gemm_levels", int8_gemm_levels_py, METH_NOARGS, "the levels of int8 codes torch's int8 GEMM sums exactly"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "fused kernels (ops register as torch.ops.fused.*)", -1,
                                   methods};
  PyObject* module = PyModule_Create(&module_def);
  if (!module) return nullptr;
  using namespace fused;
  if (add_names(module, "ACTS", kActNames, 0, kActCount) < 0 ||
      add_names(module, "UNARY_OPS", kUnaryOpNames, 0, kFirstScalarOp) < 0 ||
      add_names(module, "SCALAR_OPS", kUnaryOpNames, kFirstScalarOp, kUnaryOpCount) < 0 ||
      add_names(module, "METRICS", kMetricNames, 0, kMetricCount) < 0 ||
      PyModule_AddIntConstant(module, "MAX_CHAIN", kMaxChain) < 0 ||
      PyModule_AddIntConstant(module, "MAX_SELECT", kMaxSelect) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
