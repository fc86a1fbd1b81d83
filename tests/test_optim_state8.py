"""Low-bit Adam state (state_dtype="int8" and torch.bfloat16) on the CPU kernel: the codes' error bounds on
adversarial blocks, the kernel's bits against fused.optim.quantize's, skipped steps, state dicts both ways, and
training runs against fp32 AdamW and bitsandbytes' AdamW8bit."""

import copy
import math

import pytest
import torch

import fused
from fused.optim import quantize
from tests.harness import adam_step_args

N = 5000  # >= quantize.MIN_NUMEL, with a partial last block (5000 = 19 * 256 + 136)


def quantized_by_kernel(values):
    """The kernel's codes of m = values and v = values^2: one AdamW step from zero state with beta1 = beta2 = 0
    and lr = 0 stores exactly those moments."""
    p = torch.zeros_like(values, requires_grad=True)
    p.grad = values.clone()
    opt = fused.optim.AdamW([p], lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, state_dtype="int8")
    opt.step()
    return opt.state[p]


def adversarial_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g) * 1e-3
    x[3] = 1e6  # one outlier in block 0
    x[256:512] = 0.0  # an all-zero block
    x[512:768] = torch.randn(256, generator=g) * 1e-39  # denormals
    x[768:1024] = torch.logspace(-18, 18, 256)  # 36 decades in one block
    x[1024:1280] = -x[1024:1280].abs()  # all negative
    x[4864:] = torch.randn(N - 4864, generator=g) * 1e3  # the partial last block
    return x


def test_codes_within_their_bound_and_match_the_torch_encoder():
    x = adversarial_blocks()
    state = quantized_by_kernel(x)
    assert state["exp_avg"].dtype == torch.int8 and state["exp_avg_sq"].dtype == torch.uint8
    assert state["exp_avg_scale"].shape == (math.ceil(N / 256),)
    for key, exact, levels in [("exp_avg", x, 127), ("exp_avg_sq", (x * x).sqrt(), 255)]:
        decoded = quantize.decode(state[key], state[key + "_scale"])
        if key == "exp_avg_sq":
            decoded = decoded.sqrt()  # the code is on sqrt(v)
        scale = state[key + "_scale"].repeat_interleave(256)[:N].double()
        r = (exact.double().abs() / scale).nan_to_num(0.0).sqrt()
        bound = scale * (2 * r + 1 / (2 * levels)) / (2 * levels)
        err = (decoded.double() - exact.double()).abs()
        # plus fp32 rounding; for denormal scales, scale / levels^2 has an absolute error up to 2^-150
        assert (err <= bound * (1 + 1e-5) + levels**2 * 2.0**-149).all(), (key, (err - bound).max())
        # the torch encoder (state dict loading) writes the same bits
        codes, scales = torch.empty_like(state[key]), torch.empty_like(state[key + "_scale"])
        quantize.encode_(codes, scales, (x * x) if key == "exp_avg_sq" else x)
        assert torch.equal(codes, state[key]) and torch.equal(scales, state[key + "_scale"]), key
    # all-zero block: zero scale, zero codes; the outlier's block keeps its small values' sign at least as zero
    assert state["exp_avg_scale"][1] == 0 and (state["exp_avg"][256:512] == 0).all()
    assert (
        state["exp_avg_scale"][2] > 0
        and (quantize.decode(state["exp_avg"], state["exp_avg_scale"])[512:768] != 0).any()
    )


def test_nonfinite_block_decodes_to_nan():
    x = torch.randn(N)
    x[300] = math.inf
    state = quantized_by_kernel(x)
    decoded = quantize.decode(state["exp_avg"], state["exp_avg_scale"])
    assert decoded[256:512].isnan().all() and decoded[:256].isfinite().all() and decoded[512:].isfinite().all()


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    )


def train(opt_factory, steps=300, seed=0):
    """A small MLP on a learnable synthetic regression task; returns the mean loss over the last 20 steps."""
    model = make_model(seed)
    opt = opt_factory(model.parameters())
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 8, generator=g)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        y = torch.tanh(x @ teacher) + 0.1 * torch.sin(3 * x[:, :8])
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20, opt, model


@pytest.fixture
def one_thread():
    """Small matrices: more threads only add contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_training_matches_fp32_adamw_and_bitsandbytes(one_thread):
    fp32, _, _ = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    int8, opt, model = train(lambda ps: fused.optim.AdamW(ps, lr=3e-3, state_dtype="int8"))
    bf16, _, _ = train(lambda ps: fused.optim.AdamW(ps, lr=3e-3, state_dtype=torch.bfloat16))
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.int8  # 128 x 128: quantized
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32  # small: fp32
    assert abs(int8 - fp32) <= 0.01 * fp32 + 1e-4, (int8, fp32)
    assert abs(bf16 - fp32) <= 0.01 * fp32 + 1e-4, (bf16, fp32)
    bnb = pytest.importorskip("bitsandbytes")
    try:
        theirs, _, _ = train(lambda ps: bnb.optim.AdamW8bit(ps, lr=3e-3, min_8bit_size=4096))
    except (RuntimeError, NotImplementedError) as e:  # a build without CPU support
        pytest.skip(f"bitsandbytes AdamW8bit does not run on this CPU: {e}")
    assert int8 <= theirs * 1.01 + 1e-4, (int8, theirs)


@pytest.mark.parametrize("state_dtype", ["int8", torch.bfloat16])
def test_skipped_step_leaves_state_bit_identical(state_dtype):
    params = [torch.randn(64, 80, requires_grad=True), torch.randn(10, requires_grad=True)]
    opt = fused.optim.AdamW(params, lr=1e-2, state_dtype=state_dtype, max_grad_norm=1.0)
    scaler = fused.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        scaler.scale(torch.ones(()))  # what scaler.scale(loss) does before backward: sets up the scale
        for p in params:
            p.grad = torch.randn_like(p) * scaler.get_scale()
        if step == 2:
            params[0].grad[3, 7] = math.inf
            before = copy.deepcopy(opt.state_dict())
            kept = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
    after = opt.state_dict()
    for i in before["state"]:
        for k, v in before["state"][i].items():
            assert torch.equal(after["state"][i][k], v), k
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, kept))


def test_state_dict_round_trip_torch_load_and_dequantize():
    torch.manual_seed(0)
    params = [torch.randn(70, 80, requires_grad=True), torch.randn(30, requires_grad=True)]
    opt = fused.optim.AdamW(params, lr=1e-2, state_dtype="int8")
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    twin = [p.detach().clone().requires_grad_() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.int8 and "exp_avg_sq_scale" in saved["state"][0]
    # round trip: the same bits, and the next steps agree exactly
    again = fused.optim.AdamW(twin, lr=1e-2, state_dtype="int8")
    again.load_state_dict(copy.deepcopy(saved))
    for k, v in saved["state"][0].items():
        assert torch.equal(again.state[twin[0]][k], v), k
    for p, q in zip(params, twin):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
    opt.step()
    again.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    # dequantize_state gives what torch.optim.AdamW loads; a torch fp32 state dict quantizes on load
    plain = fused.optim.dequantize_state(saved)
    assert plain["state"][0]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in plain["state"][0]
    theirs = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2)
    theirs.load_state_dict(plain)
    back = fused.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2, state_dtype="int8")
    back.load_state_dict(theirs.state_dict())
    for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
        assert torch.equal(back.state_dict()["state"][0][k], saved["state"][0][k]), k
    # an int8 state dict into an optimizer with plain state: decoded
    plain_opt = fused.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2)
    plain_opt.load_state_dict(copy.deepcopy(saved))
    torch.testing.assert_close(plain_opt.state_dict()["state"][0]["exp_avg"], plain["state"][0]["exp_avg"])


def test_master_weights_with_int8_state_hold_about_8_bytes_per_param():
    p = torch.randn(256, 512, dtype=torch.bfloat16, requires_grad=True)
    opt = fused.optim.AdamW([p], lr=1e-3, master_weights=True, state_dtype="int8", amsgrad=True)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    assert state["master_param"].dtype == torch.float32 and state["max_exp_avg_sq"].dtype == torch.uint8
    moments = sum(state[k].nbytes + state[k + "_scale"].nbytes for k in ("exp_avg", "exp_avg_sq"))
    assert moments / p.numel() <= 2.04
    ref = fused.optim.AdamW([q := p.detach().clone().requires_grad_()], lr=1e-3, master_weights=True, amsgrad=True)
    q.grad = p.grad.clone()
    ref.step()
    # one step from zero state: the update is lr * sign-ish, so both round to (nearly) the same bf16
    assert (p.float() - q.float()).abs().max() <= 2e-3 * p.float().abs().max()


def test_bad_state_dtype_and_kernel_arguments():
    p = torch.randn(5000, requires_grad=True)
    with pytest.raises(ValueError, match="fused.optim.AdamW: state_dtype"):
        fused.optim.AdamW([p], state_dtype="int4")
    codes = torch.zeros(5000, dtype=torch.int8)
    sq = torch.zeros(5000, dtype=torch.uint8)
    args = adam_step_args([p.detach()], [torch.randn(5000)], [codes], [sq])
    with pytest.raises(RuntimeError, match="fused.adam_step_: exp_avgs\\[0\\] holds 8-bit codes but the scales list"):
        torch.ops.fused.adam_step_(*args)
    with pytest.raises(RuntimeError, match="fused.adam_step_: the scales of exp_avgs\\[0\\] must be"):
        torch.ops.fused.adam_step_(*args, exp_avg_scales=[torch.zeros(19)], exp_avg_sq_scales=[torch.zeros(20)])
    with pytest.raises(RuntimeError, match="fused.adam_step_: exp_avgs\\[0\\] has dtype"):
        torch.ops.fused.adam_step_(
            *adam_step_args([p.detach().double()], [torch.randn(5000, dtype=torch.float64)], [codes], [sq]),
            exp_avg_scales=[torch.zeros(20)],
            exp_avg_sq_scales=[torch.zeros(20)],
        )


def test_bf16_state_is_stochastically_rounded_and_reproducible():
    def run(seed):
        torch.manual_seed(seed)
        p = torch.zeros(8192, requires_grad=True)
        opt = fused.optim.AdamW([p], lr=1e-3, betas=(0.5, 0.5), state_dtype=torch.bfloat16)
        p.grad = torch.full_like(p, 1.0 + 2**-10)  # between two bf16 neighbours of 1: 1 and 1 + 2^-7
        opt.step()
        return opt.state[p]["exp_avg"].float() * 2  # m = 0.5 g, rounded up or down

    a, b = run(0), run(0)
    assert torch.equal(a, b)
    up = (a > 1.0).float().mean().item()
    assert abs(up - 2**-3) < 0.02, up  # 2^-10 of the way to a step of 2^-7: rounds up 1/8 of the time
