"""Parity, accuracy, gradient, compile and bad-input tests of fused.rope (CPU kernel, and the CUDA backends when a GPU
is present): against the reference formula, transformers' apply_rotary_pos_emb (Llama) and DeepSeek-V3's
apply_rotary_pos_emb_interleave on both layouts, GQA / MQA head counts, partial rotary, strided q / k (a view +
transpose of a projection's output, as transformers makes them), decode steps at a position offset. The Triton
launchers run under the interpreter at the end."""

import pytest
import torch

import fused
from fused.rope import reference as ref
from tests.harness import (
    ALL_DTYPES,
    assert_accuracy,
    assert_close,
    check_compile,
    check_compile_grads,
    compile_for_sm90,
    ignore_torch_jit_deprecation,
    make,
    noncontiguous,
    raises,
    requires_triton,
)

transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def tables(positions, r, batch=1, dtype=torch.float32, device="cpu", base=10000.0):
    """transformers' cos / sin [batch, s, r] for the positions (the r/2 frequencies repeated twice), computed in
    float64, then cast."""
    inv_freq = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    pos = torch.as_tensor(positions, dtype=torch.float64).reshape(-1, 1) + torch.zeros(batch, 1, 1, dtype=torch.float64)
    emb = torch.cat([pos * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def qk(b, hq, hk, s, d, unsqueeze_dim=1, dtype=torch.float32, device="cpu", seed=0, requires_grad=False):
    """q and k as transformers makes them: projections [b, s, h * d] viewed as [b, s, h, d], transposed to
    [b, h, s, d] for unsqueeze_dim=1 (strided views), left as they are for 2."""
    out = []
    for i, h in enumerate((hq, hk)):
        x = make((b, s, h * d), dtype, device, seed=seed + i).view(b, s, h, d)
        x = x.transpose(1, 2) if unsqueeze_dim == 1 else x
        out.append(x.requires_grad_(requires_grad))
    return out


def llama(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb, on the first r features when r < d (as Phi / GLM split q)."""
    r = cos.shape[-1]
    q_rot, k_rot = transformers_llama.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim)
    return torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)


CASES = [  # b, hq, hk, s, d, r, cos batch: GQA, MQA, MHA; full and partial rotary; odd sizes; per-batch tables
    (2, 4, 2, 7, 16, 16, 1),
    (1, 3, 1, 5, 20, 12, 1),
    (3, 2, 2, 9, 6, 6, 3),
    (2, 5, 1, 33, 130, 64, 2),
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_matches_reference(dev, dtype, case, unsqueeze_dim, interleaved):
    b, hq, hk, s, d, r, cb = case
    q, k = qk(b, hq, hk, s, d, unsqueeze_dim, dtype, dev)
    cos, sin = tables(torch.arange(s) + 3, r, cb, dtype, dev)
    out = fused.rope(q, k, cos, sin, unsqueeze_dim, interleaved=interleaved)
    expected = ref.rope(q, k, cos, sin, unsqueeze_dim, interleaved)
    for o, e, x in zip(out, expected, (q, k)):
        assert o.shape == x.shape and o.dtype == x.dtype and o.stride() == torch.empty_like(x).stride()
        assert_close(o, e)
        assert torch.equal(o[..., r:], x[..., r:])  # passed through, bit for bit


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_projection_and_strided_head_dim(dev, interleaved):
    """q / k sliced out of one packed qkv projection (not dense: outputs come out contiguous) and a head_dim with
    stride 2 (read through a copy); gradients land in the inputs' layouts."""
    b, hq, hk, s, d = 2, 4, 2, 5, 16
    qkv = make((b, s, (hq + 2 * hk) * d), device=dev, seed=41, requires_grad=True)
    q = qkv[..., : hq * d].view(b, s, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d).transpose(1, 2)
    cos, sin = tables(torch.arange(s), d, device=dev)
    for q_in in (q, noncontiguous(q.detach()).requires_grad_()):
        out = fused.rope(q_in, k, cos, sin, interleaved=interleaved)
        expected = ref.rope(q_in, k, cos, sin, interleaved=interleaved)
        for o, e in zip(out, expected):
            assert_close(o, e)
        grads = [make(o.shape, device=dev, seed=43 + i) for i, o in enumerate(out)]
        for g, e in zip(torch.autograd.grad(out, (q_in, k), grads), torch.autograd.grad(expected, (q_in, k), grads)):
            assert_close(g, e)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(dev, case, unsqueeze_dim):
    b, hq, hk, s, d, r, cb = case
    q, k = qk(b, hq, hk, s, d, unsqueeze_dim, device=dev)
    cos, sin = tables(torch.arange(s), r, cb, device=dev)
    for o, e in zip(fused.rope(q, k, cos, sin, unsqueeze_dim), llama(q, k, cos, sin, unsqueeze_dim)):
        assert_close(o, e)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_interleaved_matches_deepseek_v3(dev, unsqueeze_dim):
    """DeepSeek-V3's function returns the rotated pairs de-interleaved (evens, then odds); ours keeps them in place."""
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    q, k = qk(2, 4, 2, 6, 64, unsqueeze_dim, device=dev)
    cos, sin = tables(torch.arange(6) + 11, 64, device=dev)
    ours = fused.rope(q, k, cos, sin, unsqueeze_dim, interleaved=True)
    theirs = deepseek.apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for o, t in zip(ours, theirs):
        assert_close(torch.cat([o[..., 0::2], o[..., 1::2]], -1), t)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_accuracy_against_float64(dtype, interleaved):
    """Outputs and gradients: our error against a float64 run no worse than eager's (x2), at positions up to 4096
    where the angles' rounding matters."""
    b, hq, hk, s, d = 2, 4, 2, 64, 64
    positions = torch.randint(0, 4096, (s,), generator=torch.Generator().manual_seed(0))
    q, k = qk(b, hq, hk, s, d, 1, dtype, seed=5, requires_grad=True)
    cos, sin = tables(positions, d, 1, dtype)
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    grads = [make(x.shape, dtype, seed=9 + i) for i, x in enumerate((q, k))]
    results = []
    for fn, args in (
        (lambda *a: fused.rope(*a, interleaved=interleaved), (q, k, cos, sin)),
        (lambda *a: ref.rope(*a, interleaved=interleaved), (q, k, cos, sin)),
        (lambda *a: ref.rope(*a, interleaved=interleaved), (q64, k64, cos.double(), sin.double())),
    ):
        out = fn(*args)
        dq, dk = torch.autograd.grad(out, args[:2], [g.to(args[0].dtype) for g in grads])
        results.append((*out, dq, dk))
    for ours, eager, exact in zip(*results):
        assert_accuracy(ours, eager, exact)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_gradients_match_reference(dev, cos_batch, unsqueeze_dim, interleaved):
    q, k = qk(2, 4, 1, 5, 24, unsqueeze_dim, device=dev, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in tables(torch.arange(5), 16, cos_batch, device=dev))
    grads = [make(x.shape, device=dev, seed=3 + i) for i, x in enumerate((q, k))]
    got, expected = (
        torch.autograd.grad(fn(q, k, cos, sin, unsqueeze_dim, interleaved=interleaved), (q, k, cos, sin), grads)
        for fn in (fused.rope, lambda *a, interleaved: ref.rope(*a, interleaved))
    )
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_no_table_gradients_unless_asked(dev):
    q, k = qk(1, 2, 2, 3, 8, device=dev, requires_grad=True)
    cos, sin = tables(torch.arange(3), 8, device=dev)
    q_embed, k_embed = fused.rope(q, k, cos, sin)
    (q_embed.sum() + k_embed.sum()).backward()
    assert cos.grad is None and sin.grad is None and q.grad is not None and k.grad is not None
    k2 = k.detach().requires_grad_()  # only one output used: the other's gradient is zero
    (fused.rope(q.detach(), k2, cos, sin)[1] * 2).sum().backward()
    assert_close(k2.grad, torch.autograd.grad((ref.rope(q, k2, cos, sin)[1] * 2).sum(), k2)[0])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_gradcheck(unsqueeze_dim, interleaved):
    """In float64, with tables whose halves differ (the backward is the exact transpose, not only for
    transformers' repeated halves), a broadcast table batch and partial rotary."""
    q, k = qk(2, 3, 1, 3, 10, unsqueeze_dim, torch.float64, requires_grad=True)
    cos, sin = (make((1, 3, 6), torch.float64, seed=s, requires_grad=True) for s in (1, 2))
    assert torch.autograd.gradcheck(lambda *a: fused.rope(*a, unsqueeze_dim, interleaved=interleaved), (q, k, cos, sin))


def test_opcheck_interleaved():
    q, k = qk(2, 4, 2, 3, 16, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in tables(torch.arange(3), 8))
    torch.library.opcheck(torch.ops.fused.rope, (q, k, cos, sin, 1), {"interleaved": True})


def test_compile_fullgraph():
    q, k = qk(2, 4, 2, 5, 16)
    cos, sin = tables(torch.arange(5), 16)

    def fn(q, k, cos, sin):
        return fused.rope(q, k, cos, sin, interleaved=True)

    check_compile(fn, q, k, cos, sin)

    def loss(q, k, cos, sin):
        q_embed, k_embed = fn(q, k, cos, sin)
        return (q_embed * q_embed.detach()).sum() + (k_embed * 3).sum()

    check_compile_grads(loss, q, k, cos, sin)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_empty_and_single_token(dev, unsqueeze_dim):
    for b, s in ((0, 4), (2, 0), (2, 1)):
        q, k = qk(b, 4, 2, s, 16, unsqueeze_dim, device=dev, requires_grad=True)
        cos, sin = tables(torch.arange(s) + 7, 16, 1, device=dev)
        out = fused.rope(q, k, cos, sin, unsqueeze_dim)
        expected = llama(q, k, cos, sin, unsqueeze_dim)
        for o, e in zip(out, expected):
            assert o.shape == e.shape
            assert_close(o, e)
        grads = torch.autograd.grad(sum(o.sum() for o in out), (q, k))
        expected_grads = torch.autograd.grad(sum(e.sum() for e in expected), (q, k))
        for g, e in zip(grads, expected_grads):
            assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_at_position_1000(dev, dtype):
    """A KV-cache decode step: one new token at position 1000, its table from transformers' rotary module."""
    config = transformers_llama.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rotary = transformers_llama.LlamaRotaryEmbedding(config).to(dev)
    q, k = qk(3, 4, 2, 1, 64, 1, dtype, dev, seed=21)
    cos, sin = rotary(q, torch.full((3, 1), 1000, device=dev))
    assert cos.shape == (3, 1, 64) and cos.dtype == dtype
    cos64, sin64 = tables([1000], 64, 3, torch.float64, dev)
    ours = fused.rope(q, k, cos, sin)
    eager = transformers_llama.apply_rotary_pos_emb(q, k, cos, sin)
    exact = ref.rope(q.double(), k.double(), cos64, sin64)
    for o, e, x in zip(ours, eager, exact):
        assert_close(o, e)
        assert_accuracy(o, e, x)


def test_nan_and_inf_propagate_as_eager(dev):
    q, k = qk(1, 2, 1, 3, 8, device=dev)
    q, k = q.clone(), k.clone()
    q[0, 0, 0, 1], q[0, 1, 2, 6], k[0, 0, 1, 0] = float("nan"), float("inf"), float("-inf")
    cos, sin = tables(torch.arange(3), 8, device=dev)
    for o, e in zip(fused.rope(q, k, cos, sin), llama(q, k, cos, sin)):
        assert torch.equal(o.isnan(), e.isnan()) and torch.equal(o.isinf(), e.isinf())
        assert_close(o, e)


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake kernel's checks
def test_bad_input_names_op_and_argument(device):
    """Shapes print as (..) from Python (the fake kernel) and [..] from C++."""
    q, k = qk(2, 4, 2, 5, 16, device=device)
    cos, sin = tables(torch.arange(5), 16, device=device)
    rope = fused.rope
    with raises(r"fused.rope: q must be a floating-point tensor"):
        rope(q.int() if device == "cpu" else q.to(torch.int32), k, cos, sin)
    with raises(r"fused.rope: k has dtype torch.float64 but q has dtype torch.float32"):
        rope(q, k.double(), cos, sin)
    with raises(r"fused.rope: cos has dtype torch.float16 but q has dtype torch.float32"):
        torch.ops.fused.rope(q, k, cos.half(), sin)  # fused.rope promotes mixed dtypes first
    with raises(r"fused.rope: q must be 4-D \[batch, heads, seq, head_dim\]"):
        rope(q[0], k, cos, sin)
    with raises(r"fused.rope: k must be 4-D \[batch, seq, heads, head_dim\]"):
        rope(q, k[0], cos, sin, 2)
    with raises(r"fused.rope: k of shape .2, 2, 5, 8. does not match q"):
        rope(q, k[..., :8], cos, sin)
    with raises(r"fused.rope: cos must be 3-D"):
        rope(q, k, cos[0], sin[0])
    with raises(r"fused.rope: sin shape .1, 5, 8. does not match cos shape"):
        rope(q, k, cos, sin[..., :8])
    with raises(r"fused.rope: cos of shape .1, 4, 16. must be \[2 or 1, 5, r\]"):
        rope(q, k, cos[:, :4], sin[:, :4])
    with raises(r"fused.rope: cos of shape .3, 5, 16. must be \[2 or 1, 5, r\]"):
        rope(q, k, cos.expand(3, 5, 16), sin.expand(3, 5, 16))
    with raises(r"fused.rope: cos's last dim r = 6 must be even and at most head_dim 4"):
        rope(q[..., :4], k[..., :4], cos[..., :6], sin[..., :6])
    with raises(r"fused.rope: cos's last dim r = 5 must be even"):
        rope(q, k, cos[..., :5], sin[..., :5])
    with raises(r"fused.rope: unsqueeze_dim must be 1 .* or 2 .*, got 3"):
        rope(q, k, cos, sin, 3)
    with raises(r"fused.rope_backward: grad_k has dtype torch.float64 but grad_q"):
        torch.ops.fused.rope_backward(q, k.double(), cos, sin, 1, False)


def test_mixed_dtypes_promote_as_eager():
    """float32 tables with bf16 q / k (autocast): float32 outputs, as apply_rotary_pos_emb gives; gradients flow
    back to the bf16 inputs in their dtype."""
    q, k = qk(2, 4, 2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = tables(torch.arange(5), 16)
    ours, eager = fused.rope(q, k, cos, sin), llama(q, k, cos, sin)
    for o, e in zip(ours, eager):
        assert o.dtype == e.dtype == torch.float32
        assert_close(o, e)
    grads = torch.autograd.grad(ours, (q, k), [torch.ones_like(o) for o in ours])
    expected = torch.autograd.grad(eager, (q, k), [torch.ones_like(e) for e in eager])
    for g, e in zip(grads, expected):
        assert g.dtype == torch.bfloat16
        assert_close(g, e)


def test_negative_unsqueeze_dims_name_the_same_layouts():
    q, k = qk(2, 4, 2, 5, 16)
    cos, sin = tables(torch.arange(5), 16)
    for neg, pos in ((-3, 1), (-2, 2)):
        x, y = (q, k) if pos == 1 else (q.transpose(1, 2), k.transpose(1, 2))
        for o, e in zip(fused.rope(x, y, cos, sin, neg), llama(x, y, cos, sin, neg)):
            assert_close(o, e)


@ignore_torch_jit_deprecation  # torch.jit is deprecated, not gone
def test_trace_and_save_with_torch_jit(tmp_path):
    """torch.jit.trace with q / k that require grad passes trace's own check, and torch.jit.save / load keeps the
    outputs and gradients: the trace holds the fused op, not a Python call."""

    class Rope(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return fused.rope(q, k, cos, sin)

    q, k = qk(2, 4, 2, 5, 16, requires_grad=True)
    cos, sin = tables(torch.arange(5), 16)
    path = tmp_path / "rope.pt"
    torch.jit.save(torch.jit.trace(Rope(), (q, k, cos, sin)), path)
    loaded = torch.jit.load(path)
    q2, k2 = qk(3, 4, 2, 7, 16, seed=4, requires_grad=True)
    cos2, sin2 = tables(torch.arange(7) + 9, 16)
    out, expected = loaded(q2, k2, cos2, sin2), llama(q2, k2, cos2, sin2)
    for o, e in zip(out, expected):
        assert_close(o, e)
    grads = torch.autograd.grad(out[0].sum() + 2 * out[1].sum(), (q2, k2))
    for g, e in zip(grads, torch.autograd.grad(expected[0].sum() + 2 * expected[1].sum(), (q2, k2))):
        assert_close(g, e)


# ---- the Triton launchers, called directly (under TRITON_INTERPRET=1 on CPU tensors without a GPU) ----
@requires_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow notes under the interpreter
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_triton_launchers_match_the_cpu_op(dtype, unsqueeze_dim, interleaved):
    """Against the C++ CPU op and float64, forward and backward, GQA heads, partial rotary, a per-batch table and
    strided q / k; outputs laid out as the inputs."""
    from fused.rope import triton_kernels as tk  # fused.rope, the attribute, is the op

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k = qk(2, 5, 2, 3, 20, unsqueeze_dim, dtype, seed=31)
    k = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # dense, head_dim not innermost: a contiguous output
    cos, sin = tables(torch.arange(3) + 100, 12, 2, dtype)
    for fn, args, exact in (
        (tk.rope, (q, k, cos, sin, unsqueeze_dim), ref.rope),
        (tk.rope_backward, (q, k, cos, sin, unsqueeze_dim, interleaved), ref.rope_backward),
    ):
        kw = {"interleaved": interleaved} if fn is tk.rope else {}
        got = fn(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), **kw)
        cpu_op = getattr(torch.ops.fused, fn.__name__)(*args, **kw)
        ref64 = exact(*(a.double() if isinstance(a, torch.Tensor) else a for a in args), *kw.values())
        for g, c, x, e in zip(got, cpu_op, args, ref64):
            assert g.stride() == (torch.empty_like(x) if x.stride(-1) == 1 else torch.empty(x.shape)).stride()
            assert_close(g.cpu(), c)
            assert_accuracy(g.cpu(), c, e)


@requires_triton
def test_triton_kernel_compiles_for_sm90():
    stdout = compile_for_sm90(["rope"])
    assert "compiled _rope_kernel" in stdout
