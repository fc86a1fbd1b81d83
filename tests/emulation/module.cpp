// The Python module of the CUDA host emulation (built by tests/cuda_emulation.py, for the tests only): the
// torch-free launchers of every *_kernels.cu, compiled for the host, called with CPU tensors' data pointers
// (Python ints; 0 for a null pointer). A failed launch raises RuntimeError with the emulator's message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/cuda_host.h"
#include "distance/distance_kernels.h"
#include "elementwise/elementwise_kernels.h"
#include "linear/linear_kernels.h"
#include "norm/norm_kernels.h"
#include "loss/logprob_kernels.h"
#include "loss/loss_kernels.h"
#include "optim/optim_kernels.h"
#include "rope/rope_kernels.h"
#include "selftest_kernels.h"

namespace py = pybind11;

namespace fused {
namespace emu {
namespace {

using Ptr = uintptr_t;

template <typename T = void> T* ptr(Ptr p) { return reinterpret_cast<T*>(p); }

// A launcher's enum argument (dtype, activation, metric, norm) from its Python int, whatever the enum's type.
struct Code {
  int value;
  template <typename E, typename = std::enable_if_t<std::is_enum_v<E>>> operator E() const { return E(value); }
};

void check(const char* launcher, cudaError_t err) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(launcher) + ": " + cudaGetErrorString(err) + ": " + last_fault());
}

cuda::Dropout dropout(uint64_t seed, uint64_t threshold, double scale) { return {seed, threshold, scale}; }

cuda::UnaryChain chain(const std::vector<int>& ops, const std::vector<double>& scalars) {
  if (ops.size() != scalars.size() || ops.size() > size_t(kMaxChain)) throw std::invalid_argument("bad chain");
  cuda::UnaryChain c{};
  c.len = int32_t(ops.size());
  for (size_t j = 0; j < ops.size(); ++j) c.ops[j] = Code{ops[j]}, c.scalars[j] = scalars[j];
  return c;
}

void def_elementwise(py::module_& m) {
  m.def("column_sum_workspace", &cuda::column_sum_workspace);
  m.def("bias_act", [](int dtype, int act, Ptr x, Ptr bias, Ptr y, int64_t n, int64_t C) {
    check("bias_act", cuda::bias_act(Code{dtype}, Code{act}, ptr(x), ptr(bias), ptr(y), n, C, nullptr));
  });
  m.def("bias_act_backward",
        [](int dtype, int act, Ptr grad, Ptr x, Ptr bias, Ptr grad_x, Ptr grad_bias, Ptr ws, int64_t n, int64_t C) {
          check("bias_act_backward", cuda::bias_act_backward(Code{dtype}, Code{act}, ptr(grad), ptr(x), ptr(bias),
                                                             ptr(grad_x), ptr(grad_bias), ptr(ws), n, C, nullptr));
        });
  m.def("glu", [](int dtype, int act, Ptr gate, int64_t gate_stride, Ptr up, int64_t up_stride, Ptr y, int64_t rows,
                  int64_t cols) {
    check("glu",
          cuda::glu(Code{dtype}, Code{act}, ptr(gate), gate_stride, ptr(up), up_stride, ptr(y), rows, cols, nullptr));
  });
  m.def("glu_backward", [](int dtype, int act, Ptr grad, Ptr gate, int64_t gate_stride, Ptr up, int64_t up_stride,
                           Ptr grad_gate, Ptr grad_up, int64_t rows, int64_t cols) {
    check("glu_backward", cuda::glu_backward(Code{dtype}, Code{act}, ptr(grad), ptr(gate), gate_stride, ptr(up),
                                             up_stride, ptr(grad_gate), ptr(grad_up), rows, cols, nullptr));
  });
  m.def("bias_dropout_add", [](int dtype, Ptr x, Ptr bias, Ptr residual, Ptr y, int64_t n, int64_t C, uint64_t seed,
                               uint64_t threshold, double scale) {
    check("bias_dropout_add", cuda::bias_dropout_add(Code{dtype}, ptr(x), ptr(bias), ptr(residual), ptr(y), n, C,
                                                     dropout(seed, threshold, scale), nullptr));
  });
  m.def("dropout_backward", [](int dtype, Ptr grad, Ptr grad_x, Ptr grad_bias, Ptr ws, int64_t n, int64_t C,
                               uint64_t seed, uint64_t threshold, double scale) {
    check("dropout_backward", cuda::dropout_backward(Code{dtype}, ptr(grad), ptr(grad_x), ptr(grad_bias), ptr(ws), n, C,
                                                     dropout(seed, threshold, scale), nullptr));
  });
  m.def("unary_chain",
        [](int dtype, const std::vector<int>& ops, const std::vector<double>& scalars, Ptr x, Ptr y, int64_t n) {
          check("unary_chain", cuda::unary_chain(Code{dtype}, chain(ops, scalars), ptr(x), ptr(y), n, nullptr));
        });
  m.def("unary_chain_backward", [](int dtype, const std::vector<int>& ops, const std::vector<double>& scalars, Ptr grad,
                                   Ptr x, Ptr grad_x, int64_t n) {
    check("unary_chain_backward",
          cuda::unary_chain_backward(Code{dtype}, chain(ops, scalars), ptr(grad), ptr(x), ptr(grad_x), n, nullptr));
  });
}

void def_linear(py::module_& m) {
  m.def("bias_act_epilogue", [](int dtype, int act, Ptr y, Ptr pre, Ptr bias, int64_t M, int64_t N) {
    check("bias_act_epilogue",
          linear::launch_bias_act_epilogue(ptr(y), ptr(pre), ptr(bias), M, N, Code{act}, Code{dtype}, nullptr));
  });
  m.def("act_grad_bias_workspace_bytes",
        [](int dtype, int64_t M, int64_t N) { return linear::act_grad_bias_workspace_bytes(M, N, Code{dtype}); });
  m.def("act_grad_bias",
        [](int dtype, int act, Ptr grad, Ptr saved, Ptr grad_pre, Ptr grad_bias, Ptr ws, int64_t M, int64_t N) {
          check("act_grad_bias", linear::launch_act_grad_bias(ptr(grad), ptr(saved), ptr(grad_pre), ptr(grad_bias),
                                                              ptr(ws), M, N, Code{act}, Code{dtype}, nullptr));
        });
}

void def_distance(py::module_& m) {
  namespace kd = cuda::distance;
  m.def("pairwise_distances_direct", [](int dtype, int metric, double p, bool squared, Ptr a, Ptr b, Ptr la, Ptr lb,
                                        Ptr out, int64_t B, int64_t N, int64_t M, int64_t D) {
    check("pairwise_distances_direct",
          kd::pairwise_distances_direct(Code{dtype}, Code{metric}, p, squared, ptr(a), ptr(b), ptr<int64_t>(la),
                                        ptr<int64_t>(lb), ptr(out), B, N, M, D, nullptr));
  });
  m.def("pairwise_distances_grad", [](int dtype, int metric, double p, bool squared, Ptr x, Ptr y, Ptr grad, Ptr dist,
                                      Ptr lr, Ptr lc, Ptr grad_x, int64_t B, int64_t R, int64_t C, int64_t D,
                                      int64_t s_r, int64_t s_c) {
    check("pairwise_distances_grad",
          kd::pairwise_distances_grad(Code{dtype}, Code{metric}, p, squared, ptr(x), ptr(y), ptr(grad), ptr(dist),
                                      ptr<int64_t>(lr), ptr<int64_t>(lc), ptr(grad_x), B, R, C, D, s_r, s_c, nullptr));
  });
  m.def("select_direct", [](int dtype, int metric, double p, bool squared, bool largest, bool within, double radius,
                            Ptr a, Ptr b, Ptr la, Ptr lb, Ptr values, Ptr indices, int64_t B, int64_t N, int64_t M,
                            int64_t D, int64_t k, int64_t width) {
    check("select_direct", kd::select_direct(Code{dtype}, Code{metric}, p, squared, largest, within, radius, ptr(a),
                                             ptr(b), ptr<int64_t>(la), ptr<int64_t>(lb), ptr(values),
                                             ptr<int64_t>(indices), B, N, M, D, k, width, nullptr));
  });
  m.def("select_grad",
        [](int dtype, int metric, double p, bool squared, Ptr a, Ptr b, Ptr grad, Ptr values, Ptr indices, Ptr keys,
           Ptr order, Ptr grad_a, Ptr grad_b, int64_t B, int64_t N, int64_t M, int64_t D, int64_t k) {
          check("select_grad", kd::select_grad(Code{dtype}, Code{metric}, p, squared, ptr(a), ptr(b), ptr(grad),
                                               ptr(values), ptr<int64_t>(indices), ptr<int64_t>(keys),
                                               ptr<int64_t>(order), ptr(grad_a), ptr(grad_b), B, N, M, D, k, nullptr));
        });
}

void def_norm(py::module_& m) {
  namespace kn = cuda::norm;
  m.def("norm_backward_workspace", &kn::norm_backward_workspace);
  m.def("norm_fwd", [](int x_dtype, int stream, Ptr x, Ptr residual, Ptr weight, Ptr bias, Ptr out, Ptr sum, Ptr mean,
                       Ptr rstd, int64_t rows, int64_t C, double eps, bool rms) {
    check("norm_fwd", kn::norm_fwd(Code{x_dtype}, Code{stream}, ptr(x), ptr(residual), ptr(weight), ptr(bias), ptr(out),
                                   ptr(sum), ptr(mean), ptr(rstd), rows, C, eps, rms, nullptr));
  });
  m.def("norm_backward", [](int grad_dtype, int stream, Ptr grad, Ptr grad_sum, Ptr h, Ptr mean, Ptr rstd, Ptr weight,
                            Ptr grad_h, Ptr grad_weight, Ptr grad_bias, Ptr ws_weight, Ptr ws_bias, int64_t rows,
                            int64_t C, bool rms) {
    check("norm_backward", kn::norm_backward(Code{grad_dtype}, Code{stream}, ptr(grad), ptr(grad_sum), ptr(h),
                                             ptr(mean), ptr(rstd), ptr(weight), ptr(grad_h), ptr(grad_weight),
                                             ptr(grad_bias), ptr(ws_weight), ptr(ws_bias), rows, C, rms, nullptr));
  });
}

void def_rope(py::module_& m) {
  // q and k: (x, out, x strides [b, h, s], out strides, heads) of their [b, h, s, d] views
  using Heads = std::tuple<Ptr, Ptr, std::vector<int64_t>, std::vector<int64_t>, int64_t>;
  m.def("rope", [](int dtype, const Heads& q, const Heads& k, Ptr cos, Ptr sin, int64_t b, int64_t s, int64_t d,
                   int64_t r, int64_t cos_batch_stride, bool interleaved, bool backward) {
    auto heads = [](const Heads& h) {
      const auto& [x, out, xs, os, n] = h;
      if (xs.size() != 3 || os.size() != 3) throw std::invalid_argument("rope: three strides each");
      return cuda::rope::Heads{ptr(x), ptr(out), {xs[0], xs[1], xs[2]}, {os[0], os[1], os[2]}, n};
    };
    check("rope", cuda::rope::rope(Code{dtype}, heads(q), heads(k), ptr(cos), ptr(sin), b, s, d, r, cos_batch_stride,
                                   interleaved, backward, nullptr));
  });
}

// The rows of a launch (loss_kernels.h's Rows), from the launchers' leading arguments.
cuda::loss::Rows loss_rows(Ptr logits, int64_t ld, Ptr grad, int64_t ldg, Ptr target, int64_t n, int64_t V,
                           int64_t ignore) {
  return {ptr(logits), ld, ptr(grad), ldg, ptr<const int64_t>(target), n, V, ignore};
}

void def_loss(py::module_& m) {
  m.def("cross_entropy_rows", [](int dtype, Ptr logits, int64_t ld, Ptr grad, int64_t ldg, Ptr target, Ptr weight,
                                 Ptr weight_sum, Ptr scale, int64_t scale_ld, Ptr loss, Ptr lse, int64_t n, int64_t V,
                                 int64_t ignore_index, double label_smoothing, double z_loss, double softcap) {
    const cuda::loss::RowsArgs args{loss_rows(logits, ld, grad, ldg, target, n, V, ignore_index),
                                    ptr(weight),
                                    ptr<const double>(weight_sum),
                                    ptr(scale),
                                    scale_ld,
                                    ptr(loss),
                                    ptr(lse),
                                    label_smoothing,
                                    z_loss,
                                    softcap};
    check("cross_entropy_rows", cuda::loss::cross_entropy_rows(Code{dtype}, args, nullptr));
  });
  m.def("log_prob_rows", [](int dtype, Ptr logits, int64_t ld, Ptr grad, int64_t ldg, Ptr target, Ptr scale, Ptr logp,
                            Ptr entropy, int64_t n, int64_t V, int64_t ignore_index, double temperature) {
    const cuda::loss::LogProbArgs args{loss_rows(logits, ld, grad, ldg, target, n, V, ignore_index), ptr(scale),
                                       ptr(logp), ptr(entropy), temperature};
    check("log_prob_rows", cuda::loss::log_prob_rows(Code{dtype}, args, nullptr));
  });
  m.def("distillation_rows", [](int dtype, Ptr logits, int64_t ld, Ptr teacher, int64_t ldt, Ptr grad, int64_t ldg,
                                Ptr target, Ptr scale, int64_t scale_step, Ptr loss, int64_t n, int64_t V,
                                int64_t ignore_index, int divergence, double beta, double temperature) {
    const cuda::loss::DistillationArgs args{loss_rows(logits, ld, grad, ldg, target, n, V, ignore_index),
                                            ptr(teacher),
                                            ldt,
                                            ptr(scale),
                                            scale_step,
                                            ptr(loss),
                                            divergence,
                                            beta,
                                            temperature};
    check("distillation_rows", cuda::loss::distillation_rows(Code{dtype}, args, nullptr));
  });
}

namespace oc = optim_cuda;

// The metadata of K lists of n tensors as the optimizer launchers read it (device memory is host memory here):
// ptrs [K][n], numel and dtype codes [n] (kAligned added where every list's pointer is 16-byte aligned), the step
// counters [n] or none, per-tensor hyperparameter rows [n * width] or none.
struct Lists {
  std::vector<uint8_t> buffer;
  oc::TensorLists lists;
  Lists(const std::vector<std::vector<Ptr>>& ptrs, const std::vector<int64_t>& numel, std::vector<uint8_t> dtype,
        const std::vector<Ptr>& steps = {}, const std::vector<double>& hyper = {}, int width = 0) {
    std::vector<std::vector<void*>> p(ptrs.size());
    for (size_t k = 0; k < ptrs.size(); ++k)
      for (Ptr q : ptrs[k]) p[k].push_back(ptr(q));
    for (size_t i = 0; i < numel.size(); ++i) {
      bool aligned = true;
      for (const auto& list : ptrs) aligned &= list[i] % 16 == 0;
      if (aligned) dtype[i] |= oc::kAligned;
    }
    std::vector<float*> step_ptrs;
    for (Ptr q : steps) step_ptrs.push_back(ptr<float>(q));
    const oc::ListsLayout layout = oc::lists_layout(int(ptrs.size()), numel, !steps.empty(), hyper.empty() ? 0 : width);
    buffer.assign(layout.bytes, 0);
    oc::pack_lists(buffer.data(), layout, p, numel, dtype, step_ptrs, hyper);
    lists = oc::lists_at(buffer.data(), layout, !steps.empty());
  }
};

using PtrLists = std::vector<std::vector<Ptr>>;
using Codes = std::vector<uint8_t>;

void def_optim(py::module_& m) {
  m.attr("WORKSPACE_BYTES") = oc::kWorkspaceBytes;
  m.attr("MASTER") = oc::kMaster;
  m.attr("F32_STATE") = oc::kF32State;
  m.attr("F32_GRAD") = oc::kF32Grad;
  m.attr("INT8_STATE") = oc::kInt8State;
  m.attr("BF16_STATE") = oc::kBF16State;
  // norm_dtype: the optimizer DType code of norm_out (the gradients' promoted dtype); coef_out is float64.
  m.def("grad_norm",
        [](const PtrLists& grads, const std::vector<int64_t>& numel, const Codes& dtype, Ptr ws, Ptr found_in,
           Ptr grad_scale, int norm, double p, double max_norm, double clip_value, bool finish, Ptr norm_out,
           Ptr coef_out, Ptr found_out, int num_sms, bool fp64, int norm_dtype) {
          const Lists l(grads, numel, dtype);
          check("grad_norm", oc::launch_grad_norm(l.lists, oc::workspace_at(ptr(ws)), ptr<float>(found_in),
                                                  ptr<float>(grad_scale), Code{norm}, p, max_norm, clip_value, fp64,
                                                  finish, ptr(norm_out), uint8_t(norm_dtype), ptr<double>(coef_out),
                                                  ptr<float>(found_out), num_sms, nullptr));
        });
  m.def("scale_grads",
        [](const PtrLists& grads, const std::vector<int64_t>& numel, const Codes& dtype, Ptr coef, int num_sms) {
          const Lists l(grads, numel, dtype);
          check("scale_grads", oc::launch_scale_grads(l.lists, ptr<double>(coef), num_sms, nullptr));
        });
  m.def("sgd_step",
        [](const PtrLists& lists, const std::vector<int64_t>& numel, const Codes& dtype, const std::vector<Ptr>& steps,
           const std::vector<double>& hyper, Ptr ws, double lr, double momentum, double dampening, double weight_decay,
           double clip_value, bool nesterov, bool maximize, bool stochastic, uint64_t sr_seed, Ptr coef, Ptr grad_scale,
           Ptr found_inf, int num_sms, bool write_grads) {
          const Lists l(lists, numel, dtype, steps, hyper, 4);
          const oc::SgdArgs args{lr,       momentum,      dampening,  weight_decay, clip_value, nesterov,
                                 maximize, momentum != 0, stochastic, sr_seed,      write_grads};
          const oc::StepScalars scalars{ptr<double>(coef), ptr<float>(grad_scale), ptr<float>(found_inf)};
          check("sgd_step", oc::launch_sgd_step(l.lists, oc::workspace_at(ptr(ws)), args, scalars, num_sms, nullptr));
        });
  m.def("adam_step", [](const PtrLists& lists, const std::vector<int64_t>& numel, const Codes& dtype,
                        const std::vector<Ptr>& steps, const std::vector<double>& hyper, Ptr ws, double lr,
                        double beta1, double beta2, double eps, double weight_decay, double clip_value, bool amsgrad,
                        bool decoupled, bool maximize, bool stochastic, uint64_t sr_seed, Ptr coef, Ptr grad_scale,
                        Ptr found_inf, int num_sms, bool write_grads, bool state_stochastic, uint64_t state_seed) {
    const Lists l(lists, numel, dtype, steps, hyper, 5);
    bool codes = false, bf16_state = false;
    for (uint8_t d : dtype) codes |= (d & oc::kInt8State) != 0, bf16_state |= (d & oc::kBF16State) != 0;
    const oc::AdamArgs args{
        lr,       beta1,      beta2,   eps,         weight_decay, clip_value, amsgrad,          decoupled,
        maximize, stochastic, sr_seed, write_grads, codes,        bf16_state, state_stochastic, state_seed};
    const oc::StepScalars scalars{ptr<double>(coef), ptr<float>(grad_scale), ptr<float>(found_inf)};
    check("adam_step", oc::launch_adam_step(l.lists, oc::workspace_at(ptr(ws)), args, scalars, num_sms, nullptr));
  });
  m.def("accumulate_grads",
        [](const PtrLists& lists, const std::vector<int64_t>& numel, const Codes& dtype, bool overwrite, int num_sms) {
          const Lists l(lists, numel, dtype);
          check("accumulate_grads", oc::launch_accumulate_grads(l.lists, overwrite, num_sms, nullptr));
        });
}

void def_selftest(py::module_& m) {
  namespace st = emu_selftest;
  m.def("scale", [](Ptr x, Ptr y, int64_t n, int overrun, int threads) {
    check("scale", st::scale(ptr<float>(x), ptr<float>(y), n, overrun, threads));
  });
  m.def("block_sum", [](Ptr x, Ptr out, int blocks, int threads, bool barrier) {
    check("block_sum", st::block_sum(ptr<float>(x), ptr<float>(out), blocks, threads, barrier));
  });
  m.def("warp_sum", [](Ptr x, Ptr out, int warps, int first_offset) {
    check("warp_sum", st::warp_sum(ptr<float>(x), ptr<float>(out), warps, first_offset));
  });
  m.def("rotate",
        [](Ptr x, Ptr out, int threads) { check("rotate", st::rotate(ptr<int>(x), ptr<int>(out), threads)); });
  m.def("collective", [](Ptr x, Ptr out, int threads, int kind, unsigned mask, unsigned exited, int arg, int width) {
    check("collective", st::collective(ptr<int>(x), ptr<int>(out), threads, kind, mask, exited, arg, width));
  });
  m.def("atomics", [](Ptr counters, int blocks, int threads, unsigned limit) {
    check("atomics", st::atomics(ptr<unsigned>(counters), blocks, threads, limit));
  });
  m.def("fault", [](int mode) { check("fault", st::fault(mode)); });
}

}  // namespace
}  // namespace emu
}  // namespace fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_sm_count", &fused::emu::set_sm_count, "multiprocessors of the emulated device (default 2)");
  m.def("set_schedule_seed", &fused::emu::set_schedule_seed,
        "seed of the block and thread orders (0: index order; default 1)");
  fused::emu::def_elementwise(m);
  fused::emu::def_linear(m);
  fused::emu::def_distance(m);
  fused::emu::def_norm(m);
  fused::emu::def_optim(m);
  fused::emu::def_loss(m);
  fused::emu::def_rope(m);
  auto selftest = m.def_submodule("selftest", "kernels that check the emulation itself");
  fused::emu::def_selftest(selftest);
}
