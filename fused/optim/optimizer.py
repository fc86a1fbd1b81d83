"""fused.optim.SGD / Adam / AdamW: drop-ins for torch.optim's, whose step is two passes over all parameters:
grad_norm (global norm over every group, finite check, clip coefficient, on the device) and one update for all
param groups alike in their flags (sgd_step_ / adam_step_, lr, betas, weight decay... per tensor) that reads the
coefficient, the scaler's scale and found_inf through tensors and skips itself on inf/NaN: two launches in all.
No .item(), no host sync. State keys and step tensors match torch.optim's, so state dicts load in both
directions.

master_weights=True: each 16-bit parameter gets an fp32 copy in state "master_param" and fp32 state; the update
reads the 16-bit gradient, updates master and moments in fp32 and writes the rounded 16-bit parameter, in the
same single kernel. Those fp32 tensors stay fp32 through state_dict save and load.

stochastic_rounding=True: bf16 parameters without a master copy keep fp32 state; the update is computed in fp32
and rounded stochastically (unbiased) back to bf16, from a counter-based RNG seeded from torch's default
generator on each step (reproducible under torch.manual_seed).

accumulate_grads(): adds every parameter's 16-bit .grad into an fp32 buffer (one multi-tensor call) and clears
.grad; the next step() uses the fp32 sums (plus any .grad left from a last micro-batch). A state_dict taken
between micro-batches carries the sums ("accumulated_grads"), so a checkpoint there loses nothing; the sums are
invisible to code that reads .grad (use max_grad_norm rather than clip_grad_norm_ on the parameters;
fused.amp.GradScaler.unscale_ does unscale them, through scaler_step)."""

import functools
import inspect

import torch

from fused.optim import (
    ops,  # noqa: F401  fake kernels and GPU routing
    quantize,
)
from fused.optim.functional import check_grads, check_one_device, global_norm, is_dense, local

INF = float("inf")
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_nonneg(cls, name, value):
    if value is not None and not float(value) >= 0.0:
        raise ValueError(f"fused.optim.{cls}: {name} must be >= 0, got {value}")


def _check_not_differentiable(cls, differentiable):
    # torch's own optimizer arguments foreach, fused and capturable are taken for drop-in use and change nothing:
    # the step is always the fused two-pass one, and capturable on CUDA (no host sync). differentiable is not.
    if differentiable:
        raise ValueError(
            f"fused.optim.{cls}: differentiable=True is not supported (the fused step is not "
            "differentiable); use torch.optim"
        )


class _FusedOptimizer(torch.optim.Optimizer):
    """Common step: pass 1 over every gradient of every group, then the per-group update. Gradient scalers drive
    it through one public hook, scaler_step() (torch.amp.GradScaler through torch's grad_scale / found_inf
    attributes, which step() reads)."""

    # torch.amp.GradScaler hands `grad_scale` and `found_inf` to optimizers that declare this (no unscale pass).
    _step_supports_amp_scaling = True

    def __init__(
        self, params, defaults, max_grad_norm, clip_value, master_weights, stochastic_rounding, track_grad_norm
    ):
        name = type(self).__name__
        for key in ("lr", "eps", "weight_decay", "momentum"):
            if key in defaults:
                _check_nonneg(name, key, defaults[key])
        _check_nonneg(name, "max_grad_norm", max_grad_norm)
        _check_nonneg(name, "clip_value", clip_value)
        self.max_grad_norm = max_grad_norm
        self.clip_value = clip_value
        self.master_weights = bool(master_weights)
        self.stochastic_rounding = bool(stochastic_rounding)
        self._grad_acc = {}  # param -> fp32 buffer of accumulated micro-batch gradients (kept across steps)
        self._acc_live = set()  # params whose buffer holds sums since the last step
        self.track_grad_norm = bool(track_grad_norm)
        # after each step that runs pass 1: the unscaled norm before clipping (device, the grads' dtype); None after
        # a one-pass step (no max_grad_norm, clip_value, scaler or track_grad_norm)
        self.last_grad_norm = None
        super().__init__(params, defaults)

    # torch.optim.Optimizer pickles only defaults, state and param_groups: these ride along, so that a deepcopy,
    # pickle or torch.save of the optimizer steps as the original does
    _PICKLED = (
        "max_grad_norm",
        "clip_value",
        "master_weights",
        "stochastic_rounding",
        "track_grad_norm",
        "last_grad_norm",
        "state_dtype",
        "_grad_acc",
        "_acc_live",
    )

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._PICKLED if k in self.__dict__})
        return state

    def __setstate__(self, state):
        # as torch's optimizers do: groups of state dicts from older versions get the keys added since, and an
        # Adam state dict loaded into AdamW decays decoupled, as torch.optim.AdamW's does
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            if getattr(self, "_decoupled", False):
                group["decoupled_weight_decay"] = True

    def add_param_group(self, param_group):
        name = type(self).__name__
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if isinstance(p, torch.Tensor) and p.is_complex():
                raise ValueError(
                    f"fused.optim.{name}: params: complex parameters are not supported (got {p.dtype}); use "
                    "torch.view_as_real on them, or torch.optim"
                )
        param_group["params"] = params
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler (and fused.amp.GradScaler) set grad_scale and found_inf on optimizers with
        # _step_supports_amp_scaling; fused.amp.GradScaler reads the step's finite check back from _step_found_inf.
        self._step_found_inf = self._fused_step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    @torch.no_grad()
    def scaler_step(self, grad_scale=None, found_inf=None, *, unscale_by=None):
        """The hook through which a gradient scaler drives this optimizer (fused.amp.GradScaler uses nothing else).

        It works on the gradients step() reads: .grad, or after accumulate_grads() the fp32 sums (a last
        micro-batch still in .grad folded in first). grad_scale: the loss scale they carry, a float32 scalar tensor
        (None: 1). found_inf: a float32 scalar tensor (or a number) or'ed into the finite check (None: unset).
        By default it is one fused step on the gradients divided by grad_scale, skipped whole when found_inf is
        set or a gradient is inf/NaN; .grad is left unscaled and clipped, as torch's fused optimizers leave it.
        With unscale_by (a float32 scalar tensor, the inverse scale: what scaler.unscale_ does) there is no step:
        the fp32 sums are multiplied by it in place, with the finite check; when step() would read .grad instead,
        nothing is done and None returned (the scaler unscales .grad itself).
        Returns found_inf after the check, a float32 scalar on the parameters' device; None where no parameter
        has a gradient."""
        if unscale_by is not None:
            return self._unscale_sums(unscale_by, found_inf)
        return self._fused_step(grad_scale, found_inf)

    def _unscale_sums(self, inv_scale, found_inf):
        if not self._acc_live:
            return None
        self.accumulate_grads()  # a last micro-batch left in .grad joins the sums
        by_dtype = {}
        for p in self._acc_live:
            acc = local(self._grad_acc[p])
            by_dtype.setdefault(acc.dtype, []).append(acc)
        device = next(iter(by_dtype.values()))[0].device
        found = (
            torch.zeros((), device=device)
            if found_inf is None
            else torch.as_tensor(found_inf, dtype=torch.float32, device=device).clone()
        )
        for accs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(accs, found, inv_scale.to(device))
        return found

    def _fused_step(self, grad_scale=None, found_inf=None):
        """Pass 1 and pass 2 (see scaler_step). Returns found_inf after the check; None without gradients."""
        name = type(self).__name__
        if self._acc_live:
            self.accumulate_grads()  # a last micro-batch left in .grad joins the sums
        groups = [(g, [p for p in g["params"] if self._has_grad(p)]) for g in self.param_groups]
        groups = [(g, ps) for g, ps in groups if ps]
        if not groups:
            return None
        all_params = [p for _, ps in groups for p in ps]
        check_one_device(f"optim.{name}", [local(p) for p in all_params])
        sources = [self._grad_acc[p] if self._accumulated(p) else p.grad for p in all_params]
        # .grad receives the gradient the update used (unscaled and clipped), as torch's fused optimizers leave it;
        # the fp32 sums of accumulate_grads() are internal and are not written.
        write_grads = not self._acc_live
        changes = grad_scale is not None or self.max_grad_norm is not None or self.clip_value is not None
        check_grads(f"optim.{name}", sources, write_grads and changes)
        grads, copies = self._kernel_grads(all_params)
        device = local(all_params[0]).device
        # torch.amp.GradScaler hands a Python 0 as found_inf when no .grad was checked (accumulate_grads' sums)
        if found_inf is not None:
            found_inf = torch.as_tensor(found_inf, dtype=torch.float32, device=device)
        if grad_scale is not None:
            grad_scale = grad_scale.to(device=device, dtype=torch.float32)
        if self._needs_norm(grad_scale, found_inf):
            kernel_grads = [grads[id(p)] for p in all_params]
            self.last_grad_norm, coef, found_inf = global_norm(
                sources, found_inf, grad_scale, 2.0, self.max_grad_norm, self.clip_value, kernel_grads
            )
        else:  # nothing reads the norm or the finite check: the update is the only pass
            self.last_grad_norm = None
            coef = torch.ones((), dtype=torch.float64, device=device)
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        clip_value = INF if self.clip_value is None else float(self.clip_value)
        self._update_groups(groups, grads, coef, grad_scale, found_inf, clip_value, write_grads)
        if write_grads and changes:
            for grad, copy in copies:
                grad.copy_(copy)
        self._acc_live.clear()  # the buffers are overwritten by the next accumulate_grads (no zeroing pass)
        return found_inf

    def _needs_norm(self, grad_scale, found_inf):
        """Whether the step runs pass 1 (the norm and the finite check): for clipping, a scaler, or on request."""
        return (
            self.track_grad_norm
            or grad_scale is not None
            or found_inf is not None
            or self.max_grad_norm is not None
            or self.clip_value is not None
        )

    def _accumulated(self, p):
        """Whether p's fp32 buffer holds sums since the last step (the empty set is checked first: a tensor's hash
        is a Python call, paid per parameter per step otherwise)."""
        return bool(self._acc_live) and p in self._acc_live

    def _has_grad(self, p):
        return p.grad is not None or self._accumulated(p)

    @torch.no_grad()
    def accumulate_grads(self):
        """Adds the current .grad of every parameter into its fp32 buffer (fp64 for fp64 params) in one
        multi-tensor call and sets .grad to None. The next step() uses the sums, so micro-batch accumulation
        loses nothing to 16-bit rounding; with a GradScaler the sums stay scaled until the step unscales them."""
        fresh, added = ([], []), ([], [])
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                acc = self._grad_acc.get(p)
                if acc is None:
                    dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                    acc = self._grad_acc[p] = torch.empty_like(
                        p.detach(), dtype=dtype, memory_format=torch.preserve_format
                    )
                lists = added if p in self._acc_live else fresh
                lists[0].append(local(acc))
                lists[1].append(self._grad_of(p, from_buffer=False))
                self._acc_live.add(p)
                p.grad = None
        for (accs, grads), overwrite in ((fresh, True), (added, False)):
            if accs:
                torch.ops.fused.accumulate_grads_(accs, grads, overwrite)

    def zero_grad(self, set_to_none=True):
        self._acc_live.clear()
        super().zero_grad(set_to_none)

    def _update_groups(self, groups, grads, coef, grad_scale, found_inf, clip_value, write_grads):
        """One update call for every group alike in the kernel's flags (and in having master weights), whatever
        their learning rates, betas or weight decays: those go per tensor (the op's `hyper`)."""
        calls = {}
        for group, params in groups:
            for kind in self._split_master(params):
                if kind:
                    calls.setdefault((self._uses_master(kind[0]),) + self._flags(group), []).append((group, kind))
        for entries in calls.values():
            group = entries[0][0]
            params = [p for _, ps in entries for p in ps]
            for p in params:
                if self._uses_master(p):
                    self._ensure_master(p)
                self._init_state(group, p)
            # parameters with gaps (strided views) step on a dense copy, written back after the update
            gapped = {id(p): torch.empty_like(local(p)).copy_(local(p)) for p in params if not is_dense(local(p))}
            self._step_op(
                [self._target(p, gapped) for p in params],
                [grads[id(p)] for p in params],
                *self._state_lists(group, params),
                *self._row(group),
                *self._op_flags(group),
                coef,
                grad_scale,
                found_inf,
                clip_value,
                [gapped.get(id(p), local(p)) for p in params] if self._uses_master(params[0]) else [],
                self._sr_seed(params),
                self._hyper(entries),
                write_grads,
                **self._state_options(params),
            )
            for p in params:
                if id(p) in gapped:
                    local(p).copy_(gapped[id(p)])

    def _state_options(self, params):
        """Extra keyword arguments of the update op for this call (Adam's low-bit state)."""
        return {}

    def _hyper(self, entries):
        """Per-tensor hyperparameter rows (float64 [n, H]) for several groups; None for one (the scalars)."""
        if len(entries) == 1:
            return None
        return torch.tensor([self._row(group) for group, params in entries for _ in params], dtype=torch.float64)

    def _grad_of(self, p, from_buffer=True):
        """The local gradient the kernels read (the fp32 sums after accumulate_grads): .grad itself when it is laid
        out like the parameter (the kernels walk both as flat memory), else a copy in the parameter's layout."""
        if from_buffer and self._accumulated(p):
            return local(self._grad_acc[p])
        g, lp = local(p.grad), local(p)
        if g.stride() != lp.stride() or not is_dense(lp):  # a parameter with gaps steps on a dense copy
            g = torch.empty_like(lp, dtype=g.dtype).copy_(g)
        return g

    def _kernel_grads(self, params):
        """{id(param): the gradient the kernels read} (ids: a tensor's own hash is a Python call), and the (.grad,
        copy) pairs where that is a copy: the step's write-back goes into the copy, and from there into .grad."""
        grads, copies = {}, []
        for p in params:
            g = grads[id(p)] = self._grad_of(p)
            if not self._accumulated(p):
                grad = local(p.grad)
                if g.data_ptr() != grad.data_ptr():
                    copies.append((grad, g))
        return grads, copies

    def _new_step(self, p):
        return torch.zeros((), dtype=torch.float32, device=local(p).device)

    def _uses_master(self, p):
        return self.master_weights and p.dtype in LOW_PRECISION

    def _ensure_master(self, p):
        state = self.state[p]
        if self._uses_master(p) and "master_param" not in state:
            state["master_param"] = p.detach().float().clone(memory_format=torch.preserve_format)

    def _rounds_stochastically(self, p):
        return self.stochastic_rounding and p.dtype == torch.bfloat16 and not self._uses_master(p)

    def _fp32_state(self, p):
        """Whether the state of p is kept in fp32 although p is 16-bit: with a master copy, stochastic rounding, or
        (state_dtype="int8") for the tensors too small to quantize."""
        small_of_int8 = getattr(self, "state_dtype", None) == "int8" and p.dtype in LOW_PRECISION
        return self._uses_master(p) or self._rounds_stochastically(p) or small_of_int8

    def _state_like(self, p):
        """A zero state tensor: fp32 for a parameter with an fp32 master or stochastic rounding, else like it."""
        self._ensure_master(p)
        dtype = torch.float32 if self._fp32_state(p) else p.dtype
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def _sr_seed(self, params):
        """A fresh seed from torch's default generator when some parameter of this call rounds stochastically."""
        if not any(self._rounds_stochastically(p) for p in params):
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # the seed is a kernel argument: a graph would replay the same rounding noise every step
            raise RuntimeError(
                f"fused.optim.{type(self).__name__}: stochastic_rounding=True cannot be captured in "
                "a CUDA graph (the seed would be fixed at capture); use master_weights=True instead"
            )
        return self._fresh_seed()

    @staticmethod
    def _fresh_seed():
        return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)

    def _split_master(self, params):
        """(plain params, params with an fp32 master): the kernels take one kind per call."""
        return [p for p in params if not self._uses_master(p)], [p for p in params if self._uses_master(p)]

    def _target(self, p, gapped):
        """What the kernel updates in place as "the parameter": the fp32 master where there is one, else the
        parameter or its dense copy in `gapped`."""
        if self._uses_master(p):
            return local(self.state[p]["master_param"])
        return gapped.get(id(p), local(p))

    def state_dict(self):
        state_dict = super().state_dict()
        if self._acc_live:  # mid-accumulation: the fp32 sums, by the parameter's index as in "state"
            params = [p for g in self.param_groups for p in g["params"]]
            state_dict["accumulated_grads"] = {
                i: self._grad_acc[p] for i, p in enumerate(params) if p in self._acc_live
            }
        return state_dict

    def load_state_dict(self, state_dict):
        # The user's load_state_dict hooks run here, around the whole load: pre-hooks on the dict before anything
        # below reads it, post-hooks once the state is in its final form (codes, fp32 masters), not inside torch's.
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        try:
            self._load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = pre, post
        for hook in post.values():
            hook(self)

    def _load_state_dict(self, state_dict):
        # torch casts all state to the parameter's dtype: put fp32 master and state, 8-bit codes and their scales
        # back as saved.
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]

        def keep(p, k, v):
            if not torch.is_tensor(v) or k == "step":
                return False
            return (
                v.dtype in quantize.LEVELS or k.endswith("_scale") or (v.dtype == torch.float32 and self._fp32_state(p))
            )

        saved = {
            pid: {k: v for k, v in state_dict["state"].get(pid, {}).items() if keep(p, k, v)}
            for pid, p in zip(ids, params)
        }
        super().load_state_dict(state_dict)
        for pid, p in zip(ids, params):
            for k, v in saved[pid].items():
                self.state[p][k] = v.to(device=local(p).device, copy=True)
            state = self.state.get(p)
            if state and self._fp32_state(p):  # e.g. a torch.optim state dict: moments in 16-bit, no master
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
        self._acc_live.clear()
        by_id = dict(zip(ids, params))
        for pid, acc in state_dict.get("accumulated_grads", {}).items():
            p = by_id[pid]
            self._grad_acc[p] = acc.to(device=p.device, copy=True)
            self._acc_live.add(p)

    def _after_load(self, group, p, state):
        pass


class SGD(_FusedOptimizer):
    def __init__(
        self,
        params,
        lr,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
        max_grad_norm=None,
        clip_value=None,
        master_weights=False,
        stochastic_rounding=False,
        track_grad_norm=False,
    ):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("fused.optim.SGD: nesterov needs momentum > 0 and dampening == 0")
        _check_not_differentiable("SGD", differentiable)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        super().__init__(
            params, defaults, max_grad_norm, clip_value, master_weights, stochastic_rounding, track_grad_norm
        )

    _step_op = staticmethod(lambda *args, **kwargs: torch.ops.fused.sgd_step_(*args, **kwargs))

    def _flags(self, group):
        return group["momentum"] != 0, bool(group["nesterov"]), bool(group["maximize"])

    def _op_flags(self, group):
        return bool(group["nesterov"]), bool(group["maximize"])

    def _row(self, group):
        return [float(group["lr"]), float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"])]

    def _init_state(self, group, p):
        state = self.state[p]
        if group["momentum"] != 0 and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = self._state_like(p)
            state["step"] = self._new_step(p)  # step 0: the buffer starts as the gradient itself

    def _state_lists(self, group, params):
        """(momentum_buffers, steps): empty without momentum."""
        if group["momentum"] == 0:
            return [], []
        return [local(self.state[p]["momentum_buffer"]) for p in params], [self.state[p]["step"] for p in params]

    def _after_load(self, group, p, state):
        # A torch.optim.SGD buffer has seen at least one step.
        if state and state.get("momentum_buffer") is not None and "step" not in state:
            state["step"] = torch.ones((), dtype=torch.float32, device=local(p).device)


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class Adam(_FusedOptimizer):
    """torch.optim.Adam's drop-in (see the module docstring), plus state_dtype: None keeps the moments as torch
    does (fp32, or the master's dtype); torch.bfloat16 keeps them in bf16, rounded stochastically on every write;
    "int8" keeps each tensor's moments of 4096 elements or more blockwise-quantized (fused.optim.quantize): codes
    under the state's own keys, an fp32 scale per 256 elements under "<key>_scale", exp_avg_sq's codes rounded
    stochastically by the step (so that small increments are not lost). Both low-bit forms draw their rounding
    seed from torch's generator each step. float64 parameters keep float64 state. Both low-bit forms run on every
    backend (CPU, CUDA C++, Triton) with the same bits."""

    _decoupled = False

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
        max_grad_norm=None,
        clip_value=None,
        master_weights=False,
        stochastic_rounding=False,
        track_grad_norm=False,
        state_dtype=None,
    ):
        name = type(self).__name__
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError(f"fused.optim.{name}: betas must be either both floats or both Tensors")
        if foreach and not capturable:  # torch.optim's foreach=True Adam refuses these; as a drop-in, so do we
            for arg, value in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1])):
                if isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"fused.optim.{name}: {arg} as a Tensor is not supported for capturable=False and foreach=True"
                    )
        for i, beta in enumerate(betas):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"fused.optim.{name}: betas[{i}] must be in [0, 1), got {beta}")
        _check_not_differentiable(name, differentiable)
        if not (state_dtype is None or state_dtype == torch.bfloat16 or state_dtype == "int8"):
            raise ValueError(
                f'fused.optim.{name}: state_dtype must be None, torch.bfloat16 or "int8", got {state_dtype!r}'
            )
        self.state_dtype = state_dtype
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=self._decoupled or bool(decoupled_weight_decay),
        )
        super().__init__(
            params, defaults, max_grad_norm, clip_value, master_weights, stochastic_rounding, track_grad_norm
        )

    _step_op = staticmethod(lambda *args, **kwargs: torch.ops.fused.adam_step_(*args, **kwargs))

    def _flags(self, group):
        return (
            bool(group["amsgrad"]),
            bool(group.get("decoupled_weight_decay", self._decoupled)),
            bool(group["maximize"]),
        )

    _op_flags = _flags

    def _row(self, group):
        beta1, beta2 = group["betas"]
        return [float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])]

    def _state_kind(self, p):
        """How p's moments are held: "int8", torch.bfloat16, or None (the kernels' plain state)."""
        if self.state_dtype is None or p.dtype == torch.float64:
            return None
        if self.state_dtype == "int8":
            return "int8" if p.numel() >= quantize.MIN_NUMEL else None
        return torch.bfloat16

    def _new_moment(self, p, key):
        state, kind = self.state[p], self._state_kind(p)
        if kind == "int8":
            state[key] = torch.zeros_like(p, dtype=quantize.CODES[key], memory_format=torch.preserve_format)
            state[key + "_scale"] = quantize.scales_like(state[key])
        elif kind is not None:
            state[key] = torch.zeros_like(p, dtype=kind, memory_format=torch.preserve_format)
        else:
            state[key] = self._state_like(p)

    def _init_state(self, group, p):
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = self._new_step(p)
            self._new_moment(p, "exp_avg")
            self._new_moment(p, "exp_avg_sq")
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            self._new_moment(p, "max_exp_avg_sq")

    def _state_lists(self, group, params):
        """(exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps); max_exp_avg_sqs empty without amsgrad."""
        keys = MOMENTS if group["amsgrad"] else MOMENTS[:2]
        states = [self.state[p] for p in params]
        lists = [[local(state[k]) for state in states] for k in keys]
        if not group["amsgrad"]:
            lists.append([])
        return (*lists, [state["step"] for state in states])

    def _state_options(self, params):
        """The scales of 8-bit moments (an empty stand-in for other tensors) and the seed of the stochastic rounding
        of low-bit ones."""
        kinds = [self._state_kind(p) for p in params]
        options = {}
        if "int8" in kinds:
            empty = torch.empty(0, device=local(params[0]).device)
            for key in MOMENTS:
                if key in self.state[params[0]]:
                    options[key + "_scales"] = [
                        quantize.local_scales(self.state[p][key], self.state[p][key + "_scale"])
                        if key + "_scale" in self.state[p]
                        else empty
                        for p in params
                    ]
        if torch.bfloat16 in kinds or "int8" in kinds:  # bf16 moments and exp_avg_sq's codes round stochastically
            options["state_seed"] = self._fresh_seed()
        return options

    def _after_load(self, group, p, state):
        """Brings loaded moments to this optimizer's state_dtype: quantizes float ones where it keeps int8,
        rounds them to bf16 where it keeps bf16, dequantizes 8-bit ones where it keeps plain state."""
        if not state or "exp_avg" not in state:
            return
        kind = self._state_kind(p)
        for key in MOMENTS:
            value = state.get(key)
            if value is None:
                continue
            quantized = value.dtype in (torch.int8, torch.uint8)
            if kind == "int8" and not quantized:
                state[key] = torch.empty_like(p, dtype=quantize.CODES[key], memory_format=torch.preserve_format)
                state[key + "_scale"] = quantize.scales_like(state[key])
                scales = quantize.local_scales(state[key], state[key + "_scale"])
                quantize.encode_(local(state[key]), scales, local(value).float())
            elif kind != "int8" and quantized:
                plain = quantize.decode(local(value), quantize.local_scales(value, state.pop(key + "_scale")))
                state[key] = plain.to(kind or self._plain_state_dtype(p))
            elif kind == torch.bfloat16:
                state[key] = value.to(torch.bfloat16)

    def _plain_state_dtype(self, p):
        return torch.float32 if self._fp32_state(p) else p.dtype


def _variant_init(base_init, drop=(), **defaults):
    """base_init with other defaults and without the parameters in `drop`: calls bind against the changed
    signature, which inspect and help() show, then run base_init with every argument."""
    sig = inspect.signature(base_init)
    sig = sig.replace(
        parameters=[p.replace(default=defaults.get(n, p.default)) for n, p in sig.parameters.items() if n not in drop]
    )

    @functools.wraps(base_init)
    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        base_init(*bound.args, **bound.kwargs)

    __init__.__signature__ = sig
    return __init__


class AdamW(Adam):
    """torch.optim.AdamW's drop-in: Adam with decoupled weight decay, weight_decay=1e-2 by default."""

    _decoupled = True
    __init__ = _variant_init(Adam.__init__, drop=("decoupled_weight_decay",), weight_decay=1e-2)
