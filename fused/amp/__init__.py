"""fused.amp.GradScaler: a drop-in for torch.amp.GradScaler. With a fused optimizer, step() hands the scale
to the fused step (the finite check rides in its norm pass: no unscale pass, no host
sync); update() is torch's, on the device. With any other optimizer it behaves exactly as torch's.
unscale_() also unscales the fp32 sums of a fused optimizer's accumulate_grads(), which torch's cannot see."""
from collections import defaultdict

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

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if not (isinstance(optimizer, _FusedOptimizer) and optimizer._acc_live):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # The gradients sit in fp32 buffers (torch's unscale_ reads only .grad, and would leave them scaled while
        # telling step() they are not): fold in a last micro-batch still in .grad, then unscale the buffers.
        optimizer.accumulate_grads()
        buffers = defaultdict(list)
        for p in optimizer._params_with_grads():
            acc = local(optimizer._grad_acc[p])
            buffers[(acc.device, acc.dtype)].append(acc)
        per_device = {}
        for (device, _), accs in buffers.items():
            if device not in per_device:
                per_device[device] = found_inf.to(device, copy=True)
            torch._amp_foreach_non_finite_check_and_unscale_(accs, per_device[device], inv_scale.to(device))
        return per_device


__all__ = ["GradScaler"]
