// CUDA binding of the fused optimizer family: internal ops fused::cuda_<op> with the public ops' arguments.
// Each call looks its tensor lists up in a small cache of device-resident metadata (keyed by the content itself:
// pointers, sizes, dtypes), so a training loop copies the metadata once and every later step is the kernel
// launches alone: two for a fused optimizer step, nothing to the host, capturable in a CUDA graph after one warm-up.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/checks.h"
#include "common/cuda_binding.h"
#include "optim/optim_kernels.h"
#include "optim/optim_args.h"

namespace fused {
namespace {
namespace oc = optim_cuda;

int num_sms(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::unordered_map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it == cache.end()) {
    int n = 0;
    check_launch("optim", cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    it = cache.emplace(device, n).first;
  }
  return it->second;
}

// One per device, zeroed once; the kernels leave it zeroed. One optimizer step at a time per device.
oc::Workspace workspace(const at::Device& device) {
  static std::mutex mu;
  static std::unordered_map<int, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device.index());
  if (it == cache.end()) {
    auto buf =
        at::zeros({int64_t(oc::kWorkspaceBytes / sizeof(int))}, at::TensorOptions().dtype(at::kInt).device(device));
    it = cache.emplace(device.index(), buf).first;
  }
  return oc::workspace_at(it->second.data_ptr());
}

// The kernels' dtype code of t (optim_kernels.h), flags unset.
uint8_t dtype_code(const char* op, const at::Tensor& t) { return uint8_t(dtype_of(op, "tensors", t)); }

struct CachedLists {
  std::vector<int64_t> key;
  oc::ListsLayout layout;
  at::Tensor buffer;
  bool pinned = false;  // read by a captured CUDA graph: never freed
};

// The device-resident description of `lists` (K lists of n tensors each), `steps` (n or none) and per-tensor
// hyperparameter rows (hyper: n * hyper_width doubles, or empty). codes: the dtype code of each tensor (default:
// list 0's dtype); kAligned is added here.
oc::TensorLists device_lists(const char* op, const std::vector<at::TensorList>& lists, at::TensorList steps,
                             const at::Device& device, cudaStream_t stream, const std::vector<uint8_t>& codes = {},
                             const std::vector<double>& hyper = {}, int hyper_width = 0) {
  if (hyper.empty()) hyper_width = 0;
  const size_t n = lists[0].size();
  std::vector<int64_t> key{device.index(), int64_t(lists.size()), int64_t(steps.size())};
  std::vector<int64_t> numel(n);
  std::vector<uint8_t> dtype(n);
  std::vector<std::vector<void*>> ptrs(lists.size(), std::vector<void*>(n));
  std::vector<float*> step_ptrs;
  for (size_t i = 0; i < n; ++i) {
    numel[i] = lists[0][i].numel();
    dtype[i] = codes.empty() ? dtype_code(op, lists[0][i]) : codes[i];
    bool aligned = true;
    for (size_t k = 0; k < lists.size(); ++k) {
      ptrs[k][i] = const_cast<void*>(lists[k][i].const_data_ptr());
      aligned &= reinterpret_cast<uintptr_t>(ptrs[k][i]) % 16 == 0;
      key.push_back(reinterpret_cast<int64_t>(ptrs[k][i]));
    }
    if (aligned) dtype[i] |= oc::kAligned;
    key.push_back(numel[i]);
    key.push_back(dtype[i]);
  }
  for (const auto& s : steps) {
    step_ptrs.push_back(s.data_ptr<float>());
    key.push_back(reinterpret_cast<int64_t>(step_ptrs.back()));
  }
  key.push_back(hyper_width);
  for (double h : hyper) {  // a learning-rate schedule makes a new entry per step: one small copy, no sync
    int64_t bits;
    std::memcpy(&bits, &h, sizeof bits);
    key.push_back(bits);
  }

  static std::mutex mu;
  static std::list<CachedLists> cache;  // most recent first
  constexpr size_t kCacheSize = 32;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_launch(op, cudaStreamIsCapturing(stream, &capture));
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->key == key) {
      it->pinned |= capture != cudaStreamCaptureStatusNone;  // a graph keeps the buffer's address
      cache.splice(cache.begin(), cache, it);
      return oc::lists_at(cache.front().buffer.data_ptr<uint8_t>(), cache.front().layout, !steps.empty());
    }
  }
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone, "fused.", op,
              ": these tensors are seen for the first time "
              "during CUDA graph capture; run one step before capturing (it copies their metadata to the device)");
  CachedLists entry{key, oc::lists_layout(int(lists.size()), numel, !steps.empty(), hyper_width), {}};
  // Packed in pinned memory and copied with copy_(non_blocking): asynchronous, no host sync (a copy from pageable
  // memory may wait for the stream), and torch's host allocator keeps the staging block until the copy is done.
  at::Tensor host = at::zeros({int64_t(entry.layout.bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  oc::pack_lists(host.data_ptr<uint8_t>(), entry.layout, ptrs, numel, dtype, step_ptrs, hyper);
  entry.buffer = at::empty({int64_t(entry.layout.bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
  entry.buffer.copy_(host, /*non_blocking=*/true);  // on the current stream of `device` (the guard is set)
  cache.push_front(std::move(entry));
  if (cache.size() > kCacheSize) {  // drop the least recently used entry that no graph reads
    for (auto it = std::prev(cache.end()); it != cache.begin(); --it) {
      if (!it->pinned) {
        cache.erase(it);
        break;
      }
    }
  }
  return oc::lists_at(cache.front().buffer.data_ptr<uint8_t>(), cache.front().layout, !steps.empty());
}

// ---- checks (optim_args.h) and the kernels' view of the arguments ----
const float* optional_ptr(const char* op, const char* name, const std::optional<at::Tensor>& t,
                          const at::Device& device) {
  if (!t) return nullptr;
  check_scalar(op, name, *t, device);
  return t->const_data_ptr<float>();
}

// The checks the SGD and Adam bindings share; returns the call's device (its first parameter's).
at::Device check_update(const char* op, at::TensorList params, at::TensorList grads, at::TensorList model,
                        const at::Tensor& clip_coef, const at::Tensor& found_inf, double clip_value) {
  const at::Device device = params[0].device();
  check_floating_list(op, "params", params, device);
  check_update_lists(op, params, grads, model);
  check_nonneg(op, "clip_value", clip_value);
  check_scalar(op, "clip_coef", clip_coef, device, at::kDouble);
  check_scalar(op, "found_inf", found_inf, device);
  return device;
}

// The kernels' dtype code of every tensor of an update: the parameter's dtype (the model parameter's with master
// weights: list 0 is then the fp32 master) with the flags for fp32 or 8-bit state (state: the first state list,
// or none) and fp32 (accumulated) gradients.
std::vector<uint8_t> update_codes(const char* op, at::TensorList params, at::TensorList grads, at::TensorList state,
                                  at::TensorList model) {
  std::vector<uint8_t> codes;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& low = model.empty() ? params[i] : model[i];
    uint8_t d = dtype_code(op, low);
    if (!state.empty() && state[i].scalar_type() == at::kChar) d |= oc::kInt8State;
    // bf16 state of a parameter of another dtype (a bf16 parameter's own dtype needs no flag)
    if (!state.empty() && state[i].scalar_type() == at::kBFloat16 && params[i].scalar_type() != at::kBFloat16)
      d |= oc::kBF16State;
    if (!model.empty()) d |= oc::kMaster;
    else if (!state.empty() && is_16bit(params[i]) && state[i].scalar_type() == at::kFloat) d |= oc::kF32State;
    if (is_16bit(low) && grads[i].scalar_type() == at::kFloat) d |= oc::kF32Grad;
    codes.push_back(d);
  }
  return codes;
}

// The per-tensor hyperparameter rows for the metadata: only where `hyper` was given (else the kernel takes the
// scalar arguments).
template <size_t H>
std::vector<double> metadata_rows(const std::optional<at::Tensor>& hyper,
                                  const std::vector<std::array<double, H>>& rows) {
  std::vector<double> flat;
  if (hyper)
    for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  return flat;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_norm_cuda(at::TensorList grads,
                                                              const std::optional<at::Tensor>& found_inf,
                                                              const std::optional<at::Tensor>& grad_scale,
                                                              double norm_type, double max_norm, double clip_value,
                                                              bool finish) {
  const char* op = "grad_norm";
  const at::Device device = !grads.empty() ? grads[0].device() : found_inf ? found_inf->device() : grad_scale->device();
  check_floating_list(op, "grads", grads, device);
  check_norm_args(op, norm_type, max_norm, clip_value);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const float* found_in = optional_ptr(op, "found_inf", found_inf, device);
  const float* scale = optional_ptr(op, "grad_scale", grad_scale, device);
  auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor norm = at::empty({}, finish ? f64.dtype(norm_dtype(grads)) : f64);
  at::Tensor coef = at::empty(finish ? at::IntArrayRef{} : at::IntArrayRef{0}, f64);
  at::Tensor found = at::empty({}, f64.dtype(at::kFloat));
  bool fp64 = false;
  for (const auto& g : grads) fp64 |= g.scalar_type() == at::kDouble;
  const oc::Norm kind = norm_type == 2          ? oc::Norm::L2
                        : norm_type == 1        ? oc::Norm::L1
                        : std::isinf(norm_type) ? oc::Norm::Inf
                                                : oc::Norm::P;
  const auto lists = device_lists(op, {grads}, {}, device, stream);
  check_launch(op, oc::launch_grad_norm(lists, workspace(device), found_in, scale, kind, norm_type, max_norm,
                                        clip_value, fp64, finish, norm.data_ptr(), dtype_code(op, norm),
                                        finish ? coef.data_ptr<double>() : nullptr, found.data_ptr<float>(),
                                        num_sms(device.index()), stream));
  return {norm, coef, found};
}

void scale_grads_cuda(at::TensorList grads, const at::Tensor& clip_coef) {
  const char* op = "scale_grads_";
  if (grads.empty()) return;
  const at::Device device = grads[0].device();
  check_floating_list(op, "grads", grads, device);
  check_scalar(op, "clip_coef", clip_coef, device, at::kDouble);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto lists = device_lists(op, {grads}, {}, device, stream);
  check_launch(op, oc::launch_scale_grads(lists, clip_coef.const_data_ptr<double>(), num_sms(device.index()), stream));
}

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::TensorList steps, double lr,
                   double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                   const at::Tensor& clip_coef, const std::optional<at::Tensor>& grad_scale,
                   const at::Tensor& found_inf, double clip_value, at::TensorList model_params,
                   const std::optional<at::Tensor>& sr_seed, const std::optional<at::Tensor>& hyper, bool write_grads) {
  const char* op = "sgd_step_";
  if (params.empty()) return;
  const at::Device device = check_update(op, params, grads, model_params, clip_coef, found_inf, clip_value);
  const bool use_momentum = momentum != 0;
  if (use_momentum) {
    check_list(op, "momentum_buffers", bufs, params);
    check_steps(op, steps, params.size(), device);
  }
  const auto rows = hyper_rows<4>(op, hyper, params.size(), {lr, momentum, dampening, weight_decay});
  for (const auto& h : rows) check_sgd_hyper(op, h, nesterov, use_momentum);
  const auto seed = seed_value(op, sr_seed);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const float* scale = optional_ptr(op, "grad_scale", grad_scale, device);
  std::vector<at::TensorList> lists{params, grads};
  if (use_momentum) lists.push_back(bufs);
  if (!model_params.empty()) lists.push_back(model_params);
  const auto codes = update_codes(op, params, grads, use_momentum ? bufs : at::TensorList{}, model_params);
  const auto dl = device_lists(op, lists, use_momentum ? steps : at::TensorList{}, device, stream, codes,
                               metadata_rows(hyper, rows), 4);
  const oc::SgdArgs args{lr,       momentum,     dampening,        weight_decay,     clip_value, nesterov,
                         maximize, use_momentum, seed.has_value(), seed.value_or(0), write_grads};
  const oc::StepScalars scalars{clip_coef.const_data_ptr<double>(), scale, found_inf.const_data_ptr<float>()};
  check_launch(op, oc::launch_sgd_step(dl, workspace(device), args, scalars, num_sms(device.index()), stream));
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                    const at::Tensor& clip_coef, const std::optional<at::Tensor>& grad_scale,
                    const at::Tensor& found_inf, double clip_value, at::TensorList model_params,
                    const std::optional<at::Tensor>& sr_seed, const std::optional<at::Tensor>& hyper, bool write_grads,
                    const OptionalTensorList& exp_avg_scales, const OptionalTensorList& exp_avg_sq_scales,
                    const OptionalTensorList& max_exp_avg_sq_scales, const std::optional<at::Tensor>& state_seed) {
  const char* op = "adam_step_";
  if (params.empty()) return;
  const at::Device device = check_update(op, params, grads, model_params, clip_coef, found_inf, clip_value);
  const at::TensorList m_scales = or_empty(exp_avg_scales), v_scales = or_empty(exp_avg_sq_scales),
                       max_scales = or_empty(max_exp_avg_sq_scales);
  check_state_list(op, "exp_avgs", exp_avgs, params, at::kChar, m_scales);
  check_state_list(op, "exp_avg_sqs", exp_avg_sqs, params, at::kByte, v_scales);
  if (amsgrad) check_state_list(op, "max_exp_avg_sqs", max_exp_avg_sqs, params, at::kByte, max_scales);
  bool any_codes = false, any_bf16 = false, any_bf16_moments = false;
  for (size_t i = 0; i < params.size(); ++i) {
    // the kernel reads every state tensor of a param as one type: 8-bit codes (int8 exp_avg, uint8 others),
    // bf16, or the param's dtype (float32 for 16-bit params)
    const bool codes = exp_avgs[i].scalar_type() == at::kChar, bf16 = exp_avgs[i].scalar_type() == at::kBFloat16;
    any_codes |= codes;
    any_bf16 |= bf16 && params[i].scalar_type() != at::kBFloat16;
    any_bf16_moments |= bf16;
    if (!codes && !bf16) {
      check_alongside(op, "exp_avgs", i, exp_avgs[i], params[i]);
      check_alongside(op, "exp_avg_sqs", i, exp_avg_sqs[i], params[i]);
    }
    const auto sq = codes ? at::kByte : exp_avgs[i].scalar_type();
    const bool same = exp_avg_sqs[i].scalar_type() == sq && (!amsgrad || max_exp_avg_sqs[i].scalar_type() == sq);
    TORCH_CHECK(same, "fused.", op, ": exp_avgs[", i, "], exp_avg_sqs[", i, "]", amsgrad ? " and max_exp_avg_sqs[" : "",
                amsgrad ? std::to_string(i) + "]" : std::string(),
                " must have one dtype, or be int8 and uint8 codes (8-bit state)");
  }
  const auto state_key = seed_value(op, state_seed, "state_seed");
  // one kernel instance has either path: the 8-bit one rounds only exp_avg_sq's codes stochastically
  TORCH_CHECK(!any_codes || !(any_bf16 || (state_key && any_bf16_moments)), "fused.", op,
              ": 8-bit state and bf16 state in one call; step them in separate calls");
  check_steps(op, steps, params.size(), device);
  const auto rows = hyper_rows<5>(op, hyper, params.size(), {lr, beta1, beta2, eps, weight_decay});
  for (const auto& h : rows) check_adam_hyper(op, h);
  const auto seed = seed_value(op, sr_seed);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const float* scale = optional_ptr(op, "grad_scale", grad_scale, device);
  std::vector<at::TensorList> lists{params, grads, exp_avgs, exp_avg_sqs};
  if (amsgrad) lists.push_back(max_exp_avg_sqs);
  if (any_codes) {
    lists.push_back(m_scales);
    lists.push_back(v_scales);
    if (amsgrad) lists.push_back(max_scales);
  }
  if (!model_params.empty()) lists.push_back(model_params);
  const auto codes = update_codes(op, params, grads, exp_avgs, model_params);
  const auto dl = device_lists(op, lists, steps, device, stream, codes, metadata_rows(hyper, rows), 5);
  const oc::AdamArgs args{lr,
                          beta1,
                          beta2,
                          eps,
                          weight_decay,
                          clip_value,
                          amsgrad,
                          decoupled,
                          maximize,
                          seed.has_value(),
                          seed.value_or(0),
                          write_grads,
                          any_codes,
                          any_bf16,
                          state_key.has_value(),
                          state_key.value_or(0)};
  const oc::StepScalars scalars{clip_coef.const_data_ptr<double>(), scale, found_inf.const_data_ptr<float>()};
  check_launch(op, oc::launch_adam_step(dl, workspace(device), args, scalars, num_sms(device.index()), stream));
}

void accumulate_grads_cuda(at::TensorList accs, at::TensorList grads, bool overwrite) {
  const char* op = "accumulate_grads_";
  if (grads.empty() && accs.empty()) return;
  const at::Device device = (grads.empty() ? accs : grads)[0].device();
  check_accumulate(op, accs, grads, device);
  std::vector<uint8_t> codes;
  for (const auto& g : grads) codes.push_back(dtype_code(op, g));
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto dl = device_lists(op, {accs, grads}, {}, device, stream, codes);
  check_launch(op, oc::launch_accumulate_grads(dl, overwrite, num_sms(device.index()), stream));
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CUDA, m) { FUSED_OPTIM_OPS(FUSED_IMPL_CUDA) }

}  // namespace fused
