"""fused.optim.SGD / Adam / AdamW: drop-ins for torch.optim's, whose step is two passes over all parameters:
grad_norm (global norm over every group, finite check, clip coefficient, on the device) and one update per
param group (sgd_step_ / adam_step_) that reads the coefficient, the scaler's scale and found_inf through tensors
and skips itself on inf/NaN (no other launch: two in all for one param group). No .item(), no host sync. State keys and step tensors match torch.optim's,
so state dicts load in both directions.

master_weights=True: each 16-bit parameter gets an fp32 copy in state "master_param" and fp32 state; the update
reads the 16-bit gradient, updates master and moments in fp32 and writes the rounded 16-bit parameter, in the
same single kernel. Those fp32 tensors stay fp32 through state_dict save and load."""
import torch

from fused.optim import ops  # noqa: F401  fake kernels and GPU routing
from fused.optim.functional import check_dense, check_one_device, global_norm, local

INF = float("inf")
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_nonneg(cls, name, value):
    if value is not None and not float(value) >= 0.0:
        raise ValueError(f"fused.optim.{cls}: {name} must be >= 0, got {value}")


class _FusedOptimizer(torch.optim.Optimizer):
    """Common step: pass 1 over every gradient of every group, then the per-group update."""

    # torch.amp.GradScaler hands `grad_scale` and `found_inf` to optimizers that declare this (no unscale pass).
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults, max_grad_norm, clip_value, master_weights):
        name = type(self).__name__
        for key in ("lr", "eps", "weight_decay", "momentum"):
            if key in defaults:
                _check_nonneg(name, key, defaults[key])
        _check_nonneg(name, "max_grad_norm", max_grad_norm)
        _check_nonneg(name, "clip_value", clip_value)
        self.max_grad_norm = max_grad_norm
        self.clip_value = clip_value
        self.master_weights = bool(master_weights)
        self.last_grad_norm = None  # float32 device tensor after each step: the unscaled norm before clipping
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler sets grad_scale and found_inf on optimizers with _step_supports_amp_scaling.
        self._fused_step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    def _fused_step(self, grad_scale=None, found_inf=None):
        """Pass 1 and pass 2. grad_scale: the scaler's scale, a float32 device scalar (None: 1); found_inf: a
        float32 device scalar or'ed into the finite check (None: unset). Returns found_inf after the check."""
        name = type(self).__name__
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        groups = [(g, ps) for g, ps in groups if ps]
        if not groups:
            return found_inf
        all_params = [p for _, ps in groups for p in ps]
        check_one_device(f"optim.{name}", [local(p) for p in all_params])
        grads = [p.grad for p in all_params]
        check_dense(f"optim.{name}", grads)
        device = local(all_params[0]).device
        if found_inf is not None:
            found_inf = found_inf.to(device=device, dtype=torch.float32)
        if grad_scale is not None:
            grad_scale = grad_scale.to(device=device, dtype=torch.float32)
        self.last_grad_norm, coef, found_inf = global_norm(grads, found_inf, grad_scale, 2.0, self.max_grad_norm,
                                                           self.clip_value)
        clip_value = INF if self.clip_value is None else float(self.clip_value)
        for group, params in groups:
            self._update_group(group, params, coef, grad_scale, found_inf, clip_value)
        return found_inf

    def _update_group(self, group, params, coef, grad_scale, found_inf, clip_value):
        for kind in self._split_master(params):
            if kind:
                self._update(group, kind, coef, grad_scale, found_inf, clip_value)

    def _grad_of(self, p):
        """The local gradient, with the strides of the parameter (the kernels walk both as flat memory)."""
        g, lp = local(p.grad), local(p)
        if g.stride() != lp.stride():
            g = torch.empty_like(lp).copy_(g)
        return g

    def _new_step(self, p):
        return torch.zeros((), dtype=torch.float32, device=local(p).device)

    def _uses_master(self, p):
        return self.master_weights and p.dtype in LOW_PRECISION

    def _ensure_master(self, p):
        state = self.state[p]
        if self._uses_master(p) and "master_param" not in state:
            state["master_param"] = p.detach().float().clone(memory_format=torch.preserve_format)

    def _state_like(self, p):
        """A zero state tensor: fp32 for a parameter with an fp32 master, else like the parameter."""
        self._ensure_master(p)
        return torch.zeros_like(self.state[p]["master_param"] if self._uses_master(p) else p,
                                memory_format=torch.preserve_format)

    def _split_master(self, params):
        """(plain params, params with an fp32 master): the kernels take one kind per call."""
        return [p for p in params if not self._uses_master(p)], [p for p in params if self._uses_master(p)]

    def _target(self, p):
        """What the kernel updates in place as "the parameter": the fp32 master where there is one."""
        return local(self.state[p]["master_param"]) if self._uses_master(p) else local(p)

    def load_state_dict(self, state_dict):
        # torch casts floating state to the parameter's dtype: put fp32 master state back as saved.
        fp32 = {pid: {k: v for k, v in s.items() if torch.is_tensor(v) and v.dtype == torch.float32 and k != "step"}
                for pid, s in state_dict["state"].items() if "master_param" in s}
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for k, v in fp32.get(pid, {}).items():
                self.state[p][k] = v.to(device=local(p).device, copy=True)
            state = self.state.get(p)
            if state and self._uses_master(p):  # e.g. a torch.optim state dict: moments in 16-bit, no master
                self._ensure_master(p)
                for k, v in state.items():
                    if k != "step" and torch.is_tensor(v) and v.is_floating_point():
                        state[k] = v.float()
        # torch keeps "step" as a CPU float32 tensor (or absent for SGD); the fused kernels read it on the device.
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(local(p).device)
                self._after_load(group, p, state)

    def _after_load(self, group, p, state):
        pass


class SGD(_FusedOptimizer):
    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, max_grad_norm=None, clip_value=None, master_weights=False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("fused.optim.SGD: nesterov needs momentum > 0 and dampening == 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=None, differentiable=False, fused=None)
        super().__init__(params, defaults, max_grad_norm, clip_value, master_weights)

    def _update(self, group, params, coef, grad_scale, found_inf, clip_value):
        momentum = group["momentum"]
        bufs, steps = [], []
        for p in params:
            state = self.state[p]
            if momentum != 0 and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = self._state_like(p)
                state["step"] = self._new_step(p)  # step 0: the buffer starts as the gradient itself
            self._ensure_master(p)
            if momentum != 0:
                bufs.append(local(state["momentum_buffer"]))
                steps.append(state["step"])
        model = [local(p) for p in params] if self._uses_master(params[0]) else []
        torch.ops.fused.sgd_step_([self._target(p) for p in params], [self._grad_of(p) for p in params], bufs, steps,
                                  float(group["lr"]), float(momentum), float(group["dampening"]),
                                  float(group["weight_decay"]), bool(group["nesterov"]), bool(group["maximize"]),
                                  coef, grad_scale, found_inf, clip_value, model)

    def _after_load(self, group, p, state):
        # A torch.optim.SGD buffer has seen at least one step.
        if state and state.get("momentum_buffer") is not None and "step" not in state:
            state["step"] = torch.ones((), dtype=torch.float32, device=local(p).device)


class Adam(_FusedOptimizer):
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 maximize=False, max_grad_norm=None, clip_value=None, master_weights=False):
        name = type(self).__name__
        for i, beta in enumerate(betas):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"fused.optim.{name}: betas[{i}] must be in [0, 1), got {beta}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=self._decoupled)
        super().__init__(params, defaults, max_grad_norm, clip_value, master_weights)

    def _update(self, group, params, coef, grad_scale, found_inf, clip_value):
        amsgrad = bool(group["amsgrad"])
        exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = self._new_step(p)
                state["exp_avg"] = self._state_like(p)
                state["exp_avg_sq"] = self._state_like(p)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = self._state_like(p)
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            if amsgrad:
                max_sqs.append(local(state["max_exp_avg_sq"]))
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        model = [local(p) for p in params] if self._uses_master(params[0]) else []
        torch.ops.fused.adam_step_([self._target(p) for p in params], [self._grad_of(p) for p in params], exp_avgs,
                                   exp_avg_sqs, max_sqs, steps, float(group["lr"]), float(beta1), float(beta2),
                                   float(group["eps"]), float(group["weight_decay"]), amsgrad,
                                   bool(group.get("decoupled_weight_decay", self._decoupled)),
                                   bool(group["maximize"]), coef, grad_scale, found_inf, clip_value, model)


class AdamW(Adam):
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, max_grad_norm=None, clip_value=None, master_weights=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         max_grad_norm=max_grad_norm, clip_value=clip_value, master_weights=master_weights)
