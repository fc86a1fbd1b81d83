"""fused.amp.GradScaler: a drop-in for torch.amp.GradScaler. With a fused optimizer, step() hands the scale
to the fused step (the finite check rides in its norm pass: no unscale pass, no host sync); update() is torch's,
on the device. With any other optimizer it behaves exactly as torch's. unscale_() also unscales the fp32 sums of
a fused optimizer's accumulate_grads(), which torch's cannot see (through the optimizer's scaler_step hook)."""

import torch
from torch.amp.grad_scaler import OptState


def _is_fused(optimizer):
    return callable(getattr(optimizer, "scaler_step", None))


class GradScaler(torch.amp.GradScaler):
    def step(self, optimizer, *args, **kwargs):
        if not self._enabled or not _is_fused(optimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("fused.amp.GradScaler.step: closure use is not supported with a GradScaler")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("fused.amp.GradScaler.step: step() has already been called since the last update()")
        # a grad_scale the user set on the optimizer multiplies the scaler's, as torch's scaler takes it
        preset = getattr(optimizer, "grad_scale", None)
        if state["stage"] is OptState.UNSCALED:  # the user called unscale_: gradients are unscaled already
            found = list(state["found_inf_per_device"].values())
            grad_scale, found_inf = preset, (sum(found[1:], found[0]) if found else None)
        else:
            grad_scale, found_inf = self._scale if preset is None else self._scale * preset, None
        # through optimizer.step(), as torch's scaler drives optimizers with _step_supports_amp_scaling, so that step
        # hooks, LR schedulers' step tracking and wrappers of step see the step; the fused step reads the scale and
        # the found_inf so far from these attributes and leaves its own finite check in _step_found_inf
        optimizer.grad_scale, optimizer.found_inf, optimizer._step_found_inf = grad_scale, found_inf, None
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        found_inf = optimizer._step_found_inf
        if found_inf is not None:  # None: no parameter has a gradient, nothing stepped or checked
            state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.STEPPED  # stepped, gradients or not, as torch's scaler marks it
        return result

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # After accumulate_grads() the gradients sit in the optimizer's fp32 sums (torch's unscale_ reads only
        # .grad, and would leave them scaled while telling step() they are not): the hook unscales those.
        found = optimizer.scaler_step(found_inf=found_inf, unscale_by=inv_scale) if _is_fused(optimizer) else None
        if found is not None:
            return {found.device: found}
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


__all__ = ["GradScaler"]
