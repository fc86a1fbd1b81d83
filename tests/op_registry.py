"""Every fused:: op, with what tests/test_op_coverage.py holds it to: its reference (the plain-PyTorch spec), how
it differentiates, and the arguments torch.library.opcheck runs it on. A new op goes here, or the coverage test
fails; CUDA twins (cuda_<op>) do not: they are checked against their op."""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fused.distance import reference as distance_ref
from fused.elementwise import reference as elementwise_ref
from fused.linear import reference as linear_ref
from fused.loss import reference as loss_ref
from fused.norm import reference as norm_ref
from fused.optim import reference as optim_ref
from fused.rope import reference as rope_ref
from tests.harness import make


@dataclass(frozen=True)
class Op:
    """samples: a function returning opcheck argument tuples (small CPU tensors). reference: the fused.<family>
    .reference function that is the op's spec (a backward op's is its forward's). backward_of: the op whose
    backward this is (autograd calls it; it has no autograd of its own). differentiable=False: no autograd, on
    purpose (in-place optimizer ops)."""

    samples: Callable[[], list]
    reference: Optional[Callable] = None
    backward_of: Optional[str] = None
    differentiable: bool = True


def _x(*shape, seed=0, dtype=torch.float32, **kw):
    return make(shape, dtype, seed=seed, **kw)


def _linear():  # x, weight, bias of a linear_act, requiring grad (opcheck then checks the autograd registration)
    return _x(3, 5, 16, requires_grad=True), _x(12, 16, seed=1, requires_grad=True), _x(12, seed=2, requires_grad=True)


def _points():
    return _x(2, 4, 3, seed=52, requires_grad=True), _x(2, 5, 3, seed=53, requires_grad=True)


def _norm(dtype=torch.float32):  # x, residual, weight, bias of a norm, requiring grad
    return (
        _x(3, 5, 16, seed=60, dtype=dtype, requires_grad=True),
        _x(3, 5, 16, seed=61, requires_grad=True),
        _x(16, seed=62, low=0.5, high=1.5, requires_grad=True),
        _x(16, seed=63, requires_grad=True),
    )


def _norm_backward_samples():
    x, r, w, b = (t.detach() for t in _norm())
    samples = []
    for rms in (True, False):
        _, h, mean, rstd = torch.ops.fused.norm_fwd(x, r, [16], w, None if rms else b, 1e-5, rms)
        samples += [
            (_x(3, 5, 16, seed=64), _x(3, 5, 16, seed=65), h, mean, rstd, w, [16], rms, True, not rms),
            (_x(3, 5, 16, seed=64), None, x, mean, rstd, None, [16], rms, False, False),
        ]
    return samples


def _lengths():  # of the two padded clouds of _points()
    return torch.tensor([4, 1]), torch.tensor([2, 5])


def _optim_lists():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(40, generator=g)]
    params = [torch.randn(5, 3, generator=g), torch.randn(40, generator=g)]
    return grads, params, torch.zeros(()), torch.tensor(0.5, dtype=torch.float64), torch.tensor(4.0)


def _sgd_samples():
    grads, params, found, coef, inv = _optim_lists()
    return [
        (
            [p.clone() for p in params],
            grads,
            [torch.zeros_like(p) for p in params],
            [torch.zeros(()) for _ in params],
            0.1,
            0.9,
            0.0,
            0.01,
            True,
            False,
            coef,
            inv,
            found,
            math.inf,
            [],
            None,
            None,
            True,
        )
    ]  # write_grads


def _adam_samples():
    grads, params, found, coef, inv = _optim_lists()
    steps = [torch.zeros(()) for _ in params]
    hparams = (1e-3, 0.9, 0.999, 1e-8, 0.01, False, True, False)  # lr, betas, eps, decay, amsgrad, decoupled, maximize

    def sample(grads, model_params, *write_grads):
        exp_avgs, exp_avg_sqs = ([torch.zeros_like(p) for p in params] for _ in range(2))
        lists = ([p.clone() for p in params], grads, exp_avgs, exp_avg_sqs, [], steps)
        return (*lists, *hparams, coef, inv, found, math.inf, model_params, *write_grads)

    # the second: bf16 gradients and model params of fp32 masters, with write_grads
    return [sample(grads, []), sample([g.bfloat16() for g in grads], [p.bfloat16() for p in params], None, None, True)]


def _rope(unsqueeze_dim=1, r=16, cos_b=1):  # q (a transposed projection), k, cos, sin, requiring grad
    b, hq, hk, s, d = 2, 4, 2, 3, 16
    q = _x(b, s, hq, d, seed=70, requires_grad=True)
    k = _x(b, hk, s, d, seed=71, requires_grad=True)
    if unsqueeze_dim == 1:
        q = q.detach().transpose(1, 2).requires_grad_()
    else:
        k = k.detach().transpose(1, 2).contiguous().requires_grad_()
    cos = _x(cos_b, s, r // 2, seed=72).repeat(1, 1, 2).requires_grad_()
    return q, k, cos, _x(cos_b, s, r, seed=73, requires_grad=True), unsqueeze_dim


def _rope_backward_samples():
    cos, sin = (t.detach() for t in _rope()[2:4])
    cos2, sin2 = (t.detach() for t in _rope(2, r=8, cos_b=2)[2:4])
    return [
        (_x(2, 4, 3, 16, seed=74), _x(2, 2, 3, 16, seed=75), cos, sin, 1, False),
        (_x(2, 3, 4, 16, seed=74), _x(2, 3, 2, 16, seed=75), cos2, sin2, 2, True),
    ]


def _grad_norm_samples():
    grads, _, found, _, inv = _optim_lists()
    return [(grads, found, inv, 2.0, 1.0, math.inf, True), (grads, None, None, 3.0, 1.0, 0.5, False)]


def _lce():  # input, linear_weight, target (two ignored), linear_bias, class weight of a linear_cross_entropy
    target = torch.randint(0, 20, (12,), generator=torch.Generator().manual_seed(0))
    target[::5] = -100
    return (
        _x(12, 8, requires_grad=True),
        _x(20, 8, seed=1, requires_grad=True),
        target,
        _x(20, seed=2, requires_grad=True),
        _x(20, seed=3, low=0.2, high=2.0),
    )


def _distill():  # student input, weight, teacher input (another hidden size), weight, target, student bias
    x, w, t, b, _ = _lce()
    return x, w, _x(12, 6, seed=4), _x(20, 6, seed=5), t, b


def _distill_options(reduction, divergence="jsd", grads=(True, True, True)):
    return (reduction, divergence, 0.3, 1.5, -100, *grads)


def _lce_bwd(grad_loss, reduction):
    x, w, t, b, cw = _lce()
    return (grad_loss, x.detach(), w.detach(), t, b.detach(), cw, reduction, -100, 0.1, 1e-3, 5.0, True, True, True)


def _ce_logits(requires_grad=True):
    x, _, t, _, cw = _lce()
    return _x(12, 20, seed=4, requires_grad=requires_grad), t, cw


_SEED = torch.tensor(1234)
OPS = {
    # elementwise
    "bias_act": Op(
        lambda: [(_x(3, 5, 11), _x(11, seed=1), "silu"), (_x(3, 5, 11), None, "gelu")], elementwise_ref.bias_act
    ),
    "bias_act_backward": Op(
        lambda: [(_x(3, 5, 11, seed=2), _x(3, 5, 11), _x(11, seed=1), "gelu")], backward_of="bias_act"
    ),
    "glu": Op(lambda: [(_x(4, 6), _x(4, 6, seed=5), "gelu")], elementwise_ref.glu),
    "glu_backward": Op(lambda: [(_x(4, 6, seed=2), _x(4, 6), _x(4, 6, seed=5), "silu")], backward_of="glu"),
    # the composite draws a seed: opcheck's repeated calls agree only without dropout
    "bias_dropout_add": Op(
        lambda: [(_x(4, 6), _x(6, seed=1), _x(4, 6, seed=2), 0.4, False)], elementwise_ref.bias_dropout_add
    ),
    "bias_dropout_add_seeded": Op(
        lambda: [(_x(4, 6), _x(6, seed=1), _x(4, 6, seed=2), 0.4, _SEED)], elementwise_ref.bias_dropout_add
    ),
    "dropout_backward": Op(
        lambda: [(_x(4, 6), 0.4, _SEED, True), (_x(4, 6), 0.4, _SEED, False)], backward_of="bias_dropout_add_seeded"
    ),
    "unary_chain": Op(lambda: [(_x(4, 7), ["cos", "mul:0.5"])], elementwise_ref.unary_chain),
    "unary_chain_backward": Op(
        lambda: [(_x(4, 7, seed=1), _x(4, 7, low=1.5, high=3.0), ["log", "pow:1.5"])], backward_of="unary_chain"
    ),
    # linear
    "linear_act": Op(lambda: [(*_linear(), act) for act in ("relu", "gelu")], linear_ref.linear_act),
    "linear_act_fwd": Op(
        lambda: [(*_linear(), act, True) for act in ("relu", "gelu")] + [(*_linear()[:2], None, "gelu", False)],
        linear_ref.linear_act,
    ),
    "linear_act_grad_pre": Op(
        lambda: [
            (_x(3, 5, 12, seed=1), _x(3, 5, 12, seed=2), "gelu", True),
            (_x(3, 5, 12, seed=1), _x(3, 5, 12, seed=2), "tanh", False),
        ],
        backward_of="linear_act_fwd",
    ),
    # distance
    "pairwise_distances": Op(
        lambda: [(*_points(), p, False) for p in (2.0, 1.0)] + [(*_points(), 2.0, False, *_lengths())],
        distance_ref.pairwise_distances,
    ),
    "pairwise_distances_backward": Op(
        lambda: (
            [
                (
                    _x(2, 4, 5, seed=2),
                    _x(2, 4, 3),
                    _x(2, 5, 3, seed=1),
                    distance_ref.pairwise_distances(_x(2, 4, 3), _x(2, 5, 3, seed=1), p),
                    p,
                    False,
                )
                for p in (2.0, 3.0)
            ]
            + [
                (
                    _x(2, 4, 5, seed=2),
                    _x(2, 4, 3),
                    _x(2, 5, 3, seed=1),
                    distance_ref.pairwise_distances(_x(2, 4, 3), _x(2, 5, 3, seed=1), 2.0, False, *_lengths()),
                    2.0,
                    False,
                    *_lengths(),
                )
            ]
        ),
        backward_of="pairwise_distances",
    ),
    "pairwise_topk": Op(
        lambda: [(*_points(), 3, 2.0, False, False), (*_points(), 3, 2.0, False, False, *_lengths())],
        distance_ref.pairwise_topk,
    ),
    "radius_neighbors": Op(
        lambda: [(*_points(), 1.5, 4), (*_points(), 1.5, 9, *_lengths(), 1.0)], distance_ref.radius_neighbors
    ),
    "chamfer_distance": Op(
        lambda: [_points(), (*_points(), *_lengths(), 2.0, False, "sum", True)], distance_ref.chamfer_distance
    ),
    "pairwise_topk_backward": Op(
        lambda: [
            (
                _x(2, 4, 3, seed=2),
                _x(2, 4, 3),
                _x(2, 5, 3, seed=1),
                *distance_ref.pairwise_topk(_x(2, 4, 3), _x(2, 5, 3, seed=1), 3),
                2.0,
                False,
            )
        ],
        backward_of="pairwise_topk",
    ),
    # loss: the public composites, the chunked forward (gradients computed in it for mean / sum), the backward that
    # recomputes them, and the row kernel they share (it writes the gradient through `grad`: no autograd)
    "linear_cross_entropy": Op(lambda: [_lce()[:3]], loss_ref.linear_cross_entropy),
    "linear_cross_entropy_fwd": Op(
        lambda: (
            [(*_lce(), reduction, -100, 0.1, 1e-3, 5.0, True, True, True) for reduction in ("mean", "none")]
            + [(*_lce()[:3], None, None, "sum", -100, 0.0, 0.0, 0.0, True, False, False)]
        ),
        loss_ref.linear_cross_entropy,
    ),
    "linear_cross_entropy_bwd": Op(
        lambda: [_lce_bwd(torch.randn(12), "none"), _lce_bwd(torch.tensor(0.5), "mean")],
        backward_of="linear_cross_entropy_fwd",
    ),
    "cross_entropy": Op(lambda: [_ce_logits()[:2]], loss_ref.cross_entropy),
    "cross_entropy_fwd": Op(
        lambda: [(*_ce_logits(), reduction, -100, 0.1, 1e-3, 3.0, True) for reduction in ("mean", "none")],
        loss_ref.cross_entropy,
    ),
    "cross_entropy_bwd": Op(
        lambda: [(torch.randn(12), *_ce_logits(False), "none", -100, 0.1, 1e-3, 3.0)], backward_of="cross_entropy_fwd"
    ),
    "cross_entropy_rows": Op(
        lambda: [
            (*_ce_logits(False), torch.rand(12, 2), torch.empty(12, 20), -100, 0.1, 1e-3, 3.0),
            (*_ce_logits(False)[:2], None, torch.ones(2), torch.empty(0), -100, 0.0, 0.0, 0.0),
        ],
        loss_ref.cross_entropy,
        differentiable=False,
    ),
    # log-probs and distillation: the composites, the chunked forward and backward, and their row kernels
    "linear_log_probs": Op(lambda: [_lce()[:3]], loss_ref.linear_log_probs),
    "linear_log_probs_fwd": Op(lambda: [(*_lce()[:4], 0.7, -100)], loss_ref.linear_log_probs),
    "linear_log_probs_bwd": Op(
        lambda: [(torch.randn(12), torch.randn(12), *(t.detach() for t in _lce()[:4]), 0.7, -100, True, True, True)],
        backward_of="linear_log_probs_fwd",
    ),
    "log_prob_rows": Op(
        lambda: [
            (_x(12, 20), _lce()[2], _x(12, 2, seed=6), torch.empty(12, 20), -100, 0.7),
            (_x(12, 20), _lce()[2], _x(12, 2, seed=6), torch.empty(0), -100, 1.0),
        ],
        loss_ref.linear_log_probs,
        differentiable=False,
    ),
    "linear_distillation_loss": Op(lambda: [_distill()[:5]], loss_ref.linear_distillation_loss),
    "linear_distillation_fwd": Op(
        lambda: [
            (*_distill()[:5], _distill()[5], None, *_distill_options("mean")),
            (*_distill()[:4], None, None, _x(20, seed=7), *_distill_options("none", "reverse_kl")),
            (*_distill()[:5], None, None, *_distill_options("sum", "forward_kl", (True, False, False))),
        ],
        loss_ref.linear_distillation_loss,
    ),
    "linear_distillation_bwd": Op(
        lambda: [
            (torch.randn(12), *(t.detach() for t in _distill()[:5]), None, None, *_distill_options("none")),
            (torch.tensor(0.5), *(t.detach() for t in _distill()), None, *_distill_options("mean", "forward_kl")),
        ],
        backward_of="linear_distillation_fwd",
    ),
    "distillation_rows": Op(
        lambda: [
            (_x(12, 20), _x(12, 20, seed=1), _lce()[2], torch.rand(12), torch.empty(12, 20), "jsd", 0.3, 1.5, -100),
            (_x(12, 20), _x(12, 20, seed=1), None, torch.tensor(1.0), torch.empty(0), "forward_kl", 0.5, 1.0, -100),
        ],
        loss_ref.linear_distillation_loss,
        differentiable=False,
    ),
    # norm (add_*'s keyword residual_dtype: test_norm.py's opcheck)
    "rms_norm": Op(
        lambda: [(_norm()[0], [16], _norm()[2], None), (_norm()[0], [5, 16], None, 1e-6)], norm_ref.rms_norm
    ),
    "layer_norm": Op(
        lambda: [(_norm()[0], [16], *_norm()[2:], 1e-5), (_norm()[0], [5, 16], None, None, 1e-5)], norm_ref.layer_norm
    ),
    "add_rms_norm": Op(lambda: [(*_norm()[:2], [16], _norm()[2], None)], norm_ref.add_rms_norm),
    "add_layer_norm": Op(lambda: [(*_norm()[:2], [16], *_norm()[2:], 1e-5)], norm_ref.add_layer_norm),
    "norm_fwd": Op(
        lambda: [
            (*_norm()[:2], [16], *_norm()[2:], 1e-5, False),
            (*_norm()[:2], [16], _norm()[2], None, 1e-5, True),
            (_norm(torch.bfloat16)[0], _norm()[1], [5, 16], None, None, 1e-5, True),
            (_norm()[0], None, [16], None, _norm()[3], 1e-5, False),
        ],
        norm_ref.norm_fwd,
    ),
    "norm_backward": Op(_norm_backward_samples, backward_of="norm_fwd"),
    # rope (the keyword interleaved: test_rope.py's opcheck)
    "rope": Op(lambda: [_rope(), _rope(2, r=8, cos_b=2)], rope_ref.rope),
    "rope_backward": Op(_rope_backward_samples, backward_of="rope"),
    # optim: in-place steps over lists of tensors, no autograd
    "grad_norm": Op(_grad_norm_samples, optim_ref.clip_grad_norm_, differentiable=False),
    "scale_grads_": Op(
        lambda: [(_optim_lists()[0], _optim_lists()[3])], optim_ref.clip_grad_norm_, differentiable=False
    ),
    "clip_grad_norm_": Op(
        lambda: [([_x(5), _x(2, 3, seed=1)], 1.0, 2.0)], optim_ref.clip_grad_norm_, differentiable=False
    ),
    "sgd_step_": Op(_sgd_samples, optim_ref.ReferenceOptimizer, differentiable=False),
    "adam_step_": Op(_adam_samples, optim_ref.ReferenceOptimizer, differentiable=False),
    # the fp32 gradient accumulation of master-weight training, held against the reference step it feeds
    "accumulate_grads_": Op(
        lambda: [
            ([torch.zeros(5), torch.zeros(3, 2)], [torch.ones(5).bfloat16(), torch.full((3, 2), 0.5).half()], False)
        ],
        optim_ref.ReferenceOptimizer,
        differentiable=False,
    ),
}


def reference_of(name):
    """The op's reference: its own, or its forward's for a backward op."""
    op = OPS[name]
    return op.reference if op.backward_of is None else reference_of(op.backward_of)
