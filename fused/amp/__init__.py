"""fused.amp.GradScaler: a drop-in for torch.amp.GradScaler. With a fused optimizer, step() hands the scale
to the fused step (the finite check rides in its norm pass: no unscale pass, no host
sync); update() is torch's, on the device. With any other optimizer it behaves exactly as torch's."""
import torch
from torch.amp.grad_scaler import OptState

from fused.optim.functional import local
from fused.optim.optimizer import _FusedOptimizer


class GradScaler(torch.amp.GradScaler):
    def step(self, optimizer, *args, **kwargs):
        if not self._enabled or not isinstance(optimizer, _FusedOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("fused.amp.GradScaler.step: closure use is not supported with a GradScaler")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("fused.amp.GradScaler.step: step() has already been called since the last update()")
        params = optimizer._params_with_grads()  # .grad, or fp32 sums from accumulate_grads
        if not params:
            return None
        device = local(params[0]).device
        if state["stage"] is OptState.UNSCALED:  # the user called unscale_: gradients are unscaled already
            scale, found_inf = None, sum(t.to(device) for t in state["found_inf_per_device"].values())
        else:
            scale, found_inf = self._scale, None
        found_inf = optimizer._fused_step(scale, found_inf)
        state["found_inf_per_device"] = {device: found_inf}
        state["stage"] = OptState.STEPPED
        return None


__all__ = ["GradScaler"]
