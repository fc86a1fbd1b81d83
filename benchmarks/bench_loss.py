"""Benchmark cases of the loss family: fused.linear_cross_entropy, the LM-head loss without the N x V logits,
against eager F.cross_entropy(F.linear(x, W, b), t), torch's F.linear_cross_entropy (options=None, which runs
those two ops) and its chunked path (options=LinearCrossEntropyOptions(), sizes picked by torch), forward
(under no_grad: inference) and forward+backward, time and peak memory. The cases are GEMM-bound: 3 GEMMs of
N x D x V for forward+backward, whoever runs them; the question is the memory and what the loss adds.

The post-training losses, forward+backward against eager on full fp32 logits (the reference's formulas):
fused.linear_log_probs with the entropy and per-token upstream gradients (a GRPO-style sum of logp * advantage
plus an entropy bonus), and fused.linear_distillation_loss (forward KL, mean) of a student against a teacher of
the same size, and the Jensen-Shannon divergence. Where Liger-Kernel is installed (an optional dependency; its
Triton kernels run on a GPU only), its LigerFusedLinearCrossEntropyLoss and LigerFusedLinearJSD run beside."""

import torch
import torch.nn.functional as F

import fused
from benchmarks.common import our_labels, with_backend


def ours(device):
    return our_labels(
        device,
        lambda: fused.cross_entropy(torch.zeros(2, 3, device=device), torch.zeros(2, dtype=torch.long, device=device)),
    )


def liger(device):
    """liger_kernel.transformers on a GPU where it is installed, else None."""
    if device != "cuda":
        return None
    try:
        import liger_kernel.transformers as liger_kernel
    except ImportError:
        return None
    return liger_kernel


def _linear_cross_entropy_cases(device, N, D, V, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=dtype).to(device).requires_grad_()
    w = (torch.randn(V, D, generator=g) / D**0.5).to(device, dtype).requires_grad_()
    b = (torch.randn(V, generator=g) / 10).to(device, dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    fns = {"eager": lambda: F.cross_entropy(F.linear(x, w, b), t)}
    if hasattr(F, "linear_cross_entropy"):  # torch 2.13 on
        chunked = torch.nn.LinearCrossEntropyOptions()
        fns["torch linear_cross_entropy"] = lambda: F.linear_cross_entropy(x, w, t, linear_bias=b)
        fns["torch linear_cross_entropy chunked"] = lambda: F.linear_cross_entropy(
            x, w, t, linear_bias=b, options=chunked
        )
    if lk := liger(device):
        liger_loss = lk.LigerFusedLinearCrossEntropyLoss()
        fns["Liger fused linear CE"] = lambda: liger_loss(w, x, t, b)
    for label, backend in ours(device).items():
        fns[label] = with_backend(backend, lambda: fused.linear_cross_entropy(x, w, t, linear_bias=b))

    def forward(fn):
        def run():
            with torch.no_grad():
                return fn()

        return run

    def forward_backward(fn):
        return lambda: torch.autograd.grad(fn(), (x, w, b))

    name = f"linear_cross_entropy {N}x{D}x{V} {str(dtype).replace('torch.', '')}"
    flops = 2 * N * D * V
    return [
        {"name": f"{name} fwd", "flops": flops, "impls": {k: forward(f) for k, f in fns.items()}},
        {"name": f"{name} fwd+bwd", "flops": 3 * flops, "impls": {k: forward_backward(f) for k, f in fns.items()}},
    ]


def _post_training_cases(device, N, D, V, dtype):
    from fused.loss import reference as ref

    g = torch.Generator().manual_seed(0)
    x, xt = (torch.randn(N, D, generator=g, dtype=dtype).to(device) for _ in range(2))
    w, wt = ((torch.randn(V, D, generator=g) / D**0.5).to(device, dtype) for _ in range(2))
    x.requires_grad_(), w.requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    advantage = torch.randn(N, generator=g).to(device)

    def log_probs_objective(log_probs):
        def run():
            logp, entropy = log_probs()
            return torch.autograd.grad((logp * advantage).sum() + 0.01 * entropy.sum(), (x, w))

        return run

    log_probs = {"eager": log_probs_objective(lambda: ref.linear_log_probs(x, w, t, return_entropy=True))}
    distill = {"eager": lambda: torch.autograd.grad(ref.linear_distillation_loss(x, w, xt, wt, t), (x, w))}
    jsd = {
        "eager": lambda: torch.autograd.grad(ref.linear_distillation_loss(x, w, xt, wt, t, divergence="jsd"), (x, w))
    }
    if lk := liger(device):
        liger_jsd = lk.LigerFusedLinearJSD(jsd_beta=0.5)
        jsd["Liger fused linear JSD"] = lambda: torch.autograd.grad(liger_jsd(x, w, xt, wt, t), (x, w))
    for label, backend in ours(device).items():
        log_probs[label] = with_backend(
            backend, log_probs_objective(lambda: fused.linear_log_probs(x, w, t, return_entropy=True))
        )
        distill[label] = with_backend(
            backend, lambda: torch.autograd.grad(fused.linear_distillation_loss(x, w, xt, wt, t), (x, w))
        )
        jsd[label] = with_backend(
            backend,
            lambda: torch.autograd.grad(fused.linear_distillation_loss(x, w, xt, wt, t, divergence="jsd"), (x, w)),
        )
    shape = f"{N}x{D}x{V} {str(dtype).replace('torch.', '')} fwd+bwd"
    flops = 2 * N * D * V
    return [
        {"name": f"linear_log_probs+entropy {shape}", "flops": 3 * flops, "impls": log_probs},
        {"name": f"linear_distillation_loss {shape}", "flops": 4 * flops, "impls": distill},
        {"name": f"linear_distillation_loss jsd {shape}", "flops": 4 * flops, "impls": jsd},
    ]


def cases(device: str, quick: bool) -> list:
    if quick:
        return _linear_cross_entropy_cases(device, 64, 32, 256, torch.float32) + _post_training_cases(
            device, 64, 32, 256, torch.float32
        )
    dtypes = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16]  # CPU: AVX-512 bf16 GEMMs
    all_cases = [
        c
        for dtype in dtypes
        for V in (32768, 131072)
        for c in _linear_cross_entropy_cases(device, 4096, 1024, V, dtype)
    ] + [c for V in (32768, 131072) for c in _post_training_cases(device, 4096, 1024, V, torch.float32)]
    if device == "cuda":  # the default run on a GPU: the large vocabulary (Llama 3's 128k), where the logits hurt
        for c in all_cases:
            c["default"] = "x131072 " in c["name"]
    else:
        # make bench's default on a CPU: each op and dtype at 256 tokens (V = 32768); at 4096 tokens one call is
        # seconds of GEMM on 2 cores, for every alternative (FULL=1 times those too). The JSD case is
        # linear_distillation_loss again.
        small = [c for dtype in dtypes for c in _linear_cross_entropy_cases(device, 256, 1024, 32768, dtype)[:1]]
        small += _post_training_cases(device, 256, 1024, 32768, torch.float32)[:2]
        for c in small:
            c["default"] = True
        all_cases += small
    return all_cases
