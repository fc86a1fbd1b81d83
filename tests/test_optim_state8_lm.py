"""8-bit Adam state training language models: a small GPT-2 and a small Llama (transformers, random configs, two
layers) learn a synthetic next-token task (a fixed random successor per token, followed 90% of the time) for 300
steps with fp32 AdamW, fused AdamW(state_dtype="int8") and bitsandbytes' AdamW8bit (where it runs on this CPU). The
int8 state's loss stays within 1% of fp32's, over the last 50 steps and over the whole run (how fast it learns),
and no worse than bitsandbytes' (1% slack). Measured here (AMD EPYC, 1 thread, bitsandbytes 0.50.2), the final loss
against fp32's over four data seeds (this test runs the first): GPT-2 int8 -0.35% to -0.02% (bitsandbytes +0.06% to
+0.13%), Llama -0.002% to +0.005% (+0.05% to +0.09%): one run is judged, as the seeds move these gaps by under 0.4%
against the 1% slack (test_optim_state8.py's MLP, whose seeds move them by 1%, judges six seeds' mean)."""

import pytest
import torch

import fused
from tests.harness import TINY_DECODER

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 64, 32, 16, 300


def batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=g)
    for _ in range(STEPS):
        x = torch.empty(BATCH, SEQ, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for s in range(1, SEQ):
            follow = torch.rand(BATCH, generator=g) < 0.9
            x[:, s] = torch.where(follow, successor[x[:, s - 1]], torch.randint(0, VOCAB, (BATCH,), generator=g))
        yield x


def make_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, **TINY_DECODER, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def train(kind, opt_factory):
    """(mean loss over the last 50 steps, mean loss over the run, the optimizer, the model)."""
    model = make_model(kind)
    opt = opt_factory(model.parameters())
    losses = []
    for x in batches():
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-50:]) / 50, sum(losses) / len(losses), opt, model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_int8_state_trains_like_fp32_and_bitsandbytes(one_thread, kind):
    fp32_final, fp32_run, _, _ = train(kind, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    final, run, opt, model = train(kind, lambda ps: fused.optim.AdamW(ps, lr=3e-3, state_dtype="int8"))
    quantized = [p for p in model.parameters() if opt.state[p]["exp_avg"].dtype == torch.int8]
    assert sum(p.numel() for p in quantized) > 0.8 * sum(p.numel() for p in model.parameters())  # k, v, norms: fp32
    assert fp32_final < 0.25 * torch.log(torch.tensor(float(VOCAB))).item()  # the task is learned
    assert abs(final - fp32_final) <= 0.01 * fp32_final, (final, fp32_final)
    assert abs(run - fp32_run) <= 0.01 * fp32_run, (run, fp32_run)
    bnb = pytest.importorskip("bitsandbytes")
    try:
        theirs, _, _, _ = train(kind, lambda ps: bnb.optim.AdamW8bit(ps, lr=3e-3, min_8bit_size=4096))
    except (RuntimeError, NotImplementedError) as e:  # a build without CPU support
        pytest.skip(f"bitsandbytes AdamW8bit does not run on this CPU: {e}")
    assert final <= 1.01 * theirs, (final, theirs)
