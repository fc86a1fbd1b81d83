"""fused.patch on small random-config transformers models (no downloads), one per supported family: loss and every
gradient as accurate as eager's against a float64 copy, greedy generation unchanged, checkpoints unchanged, training
with fused.optim.AdamW tracking eager + torch AdamW, the fused ops visible in a profile, errors, and FSDP2."""

import copy
import os
import tempfile

import pytest
import torch

import fused
from tests.harness import SEEDS, TINY_DECODER, assert_accuracy, assert_accuracy_over_seeds

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    **TINY_DECODER,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def configs():
    t = transformers
    return {
        "llama": lambda: t.LlamaConfig(**COMMON),
        "mistral": lambda: t.MistralConfig(**COMMON),
        "qwen2": lambda: t.Qwen2Config(**COMMON),
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16),
        "gemma": lambda: t.GemmaConfig(**COMMON, head_dim=16),
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=5.0),
        "phi3": lambda: t.Phi3Config(**COMMON, partial_rotary_factor=0.5),
        "gemma3_text": lambda: t.Gemma3TextConfig(**COMMON, head_dim=16, final_logit_softcapping=5.0),
        "olmo2": lambda: t.Olmo2Config(**COMMON),
        "olmo3": lambda: t.Olmo3Config(**COMMON),
        "smollm3": lambda: t.SmolLM3Config(**COMMON),
        "ministral": lambda: t.MinistralConfig(**COMMON, head_dim=16),
        "granite": lambda: t.GraniteConfig(
            **COMMON, logits_scaling=3.0, residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.2
        ),
        # every token to every expert (weighted by the router): no discrete routing for rounding to flip
        "mixtral": lambda: t.MixtralConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=4),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32
        ),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32
        ),
        "olmoe": lambda: t.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=4),
        "gpt2": lambda: t.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
        ),
    }  # fmt: skip


FAMILIES = list(configs())

# The fused ops each family's training step must run (by profiler name), besides fused::linear_cross_entropy.
EXPECTED_OPS = {
    name: {"fused::norm_fwd", "fused::norm_backward", "fused::glu", "fused::glu_backward", "fused::rope",
           "fused::rope_backward", "fused::add_rms_norm"}
    for name in FAMILIES
}  # fmt: skip
for name in ("gemma2", "gemma3_text", "olmo2", "olmo3", "granite"):  # no plain residual add before a norm
    EXPECTED_OPS[name].discard("fused::add_rms_norm")
for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):  # the experts run transformers' own implementation
    EXPECTED_OPS[name] -= {"fused::glu", "fused::glu_backward"}
EXPECTED_OPS["gpt2"] = {"fused::norm_fwd", "fused::norm_backward", "fused::linear_act"}


def make_model(name, dtype=torch.float32, seed=0):
    """A random model; norm weights and biases drawn away from their init so that Gemma's offset matters."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs()[name]())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p), alpha=0.3)
    return model.to(dtype).train()


def float64_copy(model):
    """A float64 copy (a mixture of experts runs its experts as transformers' loop: grouped_mm takes no float64)."""
    ref = copy.deepcopy(model).double()
    if getattr(ref.config, "_experts_implementation", None) is not None:
        ref.config._experts_implementation = "eager"
    return ref


def batch(seed=0, b=2, s=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions count as transformers counts them
    return ids, labels


def loss_and_grads(model, ids, labels, **inputs):
    """The loss and the gradient of every trainable parameter (a LoRA model's frozen weights have none)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, **inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_patched_as_accurate(eager, floor=None, inputs=None, patched=None, prepare=None):
    """fused.patch of a copy of eager (or `patched`, built from the same weights): a float32 loss, and the loss and
    every gradient within assert_accuracy of eager's against a float64 copy (floor: assert_accuracy's, for eager's
    dtype). inputs: the model's keyword arguments (batch()'s input_ids and labels by default); prepare(model) runs
    on each of the three models first."""
    ref64 = float64_copy(eager)
    patched = fused.patch(copy.deepcopy(eager)) if patched is None else patched
    if prepare is not None:
        for model in (patched, eager, ref64):
            prepare(model)
    ids, labels = batch()
    inputs = dict(input_ids=ids, labels=labels) if inputs is None else dict(inputs)
    ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
    (loss_p, grads_p), (loss_e, grads_e), (loss_r, grads_r) = (
        loss_and_grads(model, ids, labels, **inputs) for model in (patched, eager, ref64)
    )
    assert loss_p.dtype == loss_e.dtype == torch.float32
    assert_accuracy(loss_p.reshape(1), loss_e.reshape(1), loss_r.reshape(1), floor=floor)
    assert grads_p.keys() == grads_e.keys()
    for key in grads_e:
        assert grads_p[key] is not None, key
        assert_accuracy(grads_p[key].float(), grads_e[key].float(), grads_r[key], floor=floor, what=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_gradients_accuracy(name, dtype):
    assert_patched_as_accurate(make_model(name, dtype), floor=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_eager_attention_with_as_many_kv_heads_as_heads(name):
    """Eager attention hands rope's backward a key gradient whose head_dim is not the unit-stride dim when k has as
    many heads as q (repeat_kv is then the identity): every gradient stays as accurate as eager's."""
    torch.manual_seed(0)
    config = configs()[name]()
    config.num_key_value_heads = config.num_attention_heads
    assert_patched_as_accurate(
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    )


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bf16_loss_as_accurate_as_eager(name):
    """The loss of a bf16 model is float32, as transformers computes it from float32 logits, and as accurate as
    eager's against float64 over seeds (a loss rounded to bf16 is 100x worse)."""
    samples = []
    for seed in range(SEEDS):
        eager = make_model(name, torch.bfloat16, seed=seed)
        ref64 = float64_copy(eager)
        patched = fused.patch(copy.deepcopy(eager))
        ids, labels = batch(seed)
        with torch.no_grad():
            losses = [m(input_ids=ids, labels=labels).loss for m in (patched, eager, ref64)]
        assert losses[0].dtype == torch.float32
        samples.append(tuple(loss.reshape(1) for loss in losses))
    assert_accuracy_over_seeds(samples, floor=1e-6)


def test_causal_lm_forward_keeps_its_signature_and_return_dict():
    """Trainer and generate() read the forward's signature to pick inputs: the patched one shows the original's,
    takes positional arguments, and returns a tuple (loss first) under return_dict=False."""
    import inspect

    eager = make_model("llama")
    patched = fused.patch(copy.deepcopy(eager))
    assert inspect.signature(patched.forward) == inspect.signature(eager.forward)
    ids, labels = batch()
    want = patched(input_ids=ids, labels=labels).loss
    assert torch.equal(patched(ids, None, labels=labels).loss, want)  # input_ids, attention_mask by position
    out = patched(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and torch.equal(out[0], want)


def test_decoder_layer_takes_the_deprecated_cache_keyword():
    """A decoder layer called on its own with transformers' deprecated `past_key_values=` (renamed to `cache` by
    the original's decorator): the patched layer renames it too, with the same FutureWarning, and fills the cache
    as the original does (without the rename the keyword would be dropped and the cache left empty)."""
    eager = make_model("llama").eval()
    patched = fused.patch(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 5, eager.config.hidden_size, generator=g)
    pos = torch.arange(5)[None]
    outs = []
    for model in (eager, patched):
        cache = transformers.DynamicCache(config=model.config)
        with pytest.warns(FutureWarning, match="past_key_values"):
            out = model.model.layers[0](
                x, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos), past_key_values=cache,
                use_cache=True,
            )  # fmt: skip
        assert cache.get_seq_length() == 5
        outs.append((out[0] if isinstance(out, tuple) else out, cache.layers[0].keys))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)


def test_adapted_or_hooked_modules_are_called():
    """A forward hook (or an adapter, which replaces the module) on GPT-2's c_fc or on the output embedding is seen:
    the patched code calls such modules rather than reading their weights, and the loss falls back to
    transformers' own for an adapted head. The gradients match eager's."""
    eager = make_model("gpt2")
    ref64 = float64_copy(eager)
    patched = fused.patch(copy.deepcopy(eager))

    def add_one(module, inputs, output):
        return output + 1.0

    for model in (eager, ref64, patched):
        model.transformer.h[0].mlp.c_fc.register_forward_hook(add_one)
        model.lm_head.register_forward_hook(add_one)
    ids, labels = batch()
    (loss_e, grads_e), (loss_p, grads_p) = loss_and_grads(eager, ids, labels), loss_and_grads(patched, ids, labels)
    loss_r, grads_r = loss_and_grads(ref64, ids, labels)
    assert_accuracy(loss_p.reshape(1), loss_e.reshape(1), loss_r.reshape(1))
    for key in grads_e:  # a bypassed hook is off by the hook's +1 everywhere downstream, far past eager's error
        assert_accuracy(grads_p[key], grads_e[key], grads_r[key])


@pytest.mark.parametrize("name", ["gemma", "phi3", "gpt2"])
def test_whole_model_pickles(name):
    """torch.save / torch.load of the patched model object (and deepcopy): the swapped classes are rebuilt, so the
    loaded model is patched and gives the same loss and gradients."""
    import io

    patched = fused.patch(make_model(name))
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(m).__name__ for m in swapped(loaded)] == [type(m).__name__ for m in swapped(patched)]
    assert len(swapped(copy.deepcopy(patched))) == len(swapped(patched))
    ids, labels = batch()
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(patched, ids, labels), loss_and_grads(loaded, ids, labels)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_other_heads_and_subclasses_need_loss_false():
    """A model with another head besides the LM head (GPT2DoubleHeadsModel) or a subclass with its own forward
    would lose what its forward adds under the fused loss: they raise with loss=True and patch with loss=False."""
    double = transformers.GPT2DoubleHeadsModel(configs()["gpt2"]())
    with pytest.raises(ValueError, match="fused.patch: GPT2DoubleHeadsModel is not a causal LM.*loss=False"):
        fused.patch(double)
    assert not swapped(double)
    assert swapped(fused.patch(double, loss=False))

    class MyLM(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = MyLM(configs()["llama"]())
    with pytest.raises(ValueError, match="fused.patch: MyLM has a forward of its own.*loss=False"):
        fused.patch(model)
    assert swapped(fused.patch(model, loss=False))


def assert_greedy_tokens_of_float64(eager, patched, ids, **kw):
    """Greedy generate() of eager and patched both pick the float64 model's tokens, each of which leads the
    runner-up by far more than float32's error (checked: over 1e-4, where these models' float32 logits are within
    3e-6 of float64's), so that no rounding can flip a pick on any CPU."""
    want = float64_copy(eager).generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
    for scores in want.scores:
        top = scores.topk(2).values
        assert (top[:, 0] - top[:, 1]).min() > 1e-4
    assert torch.equal(eager.generate(ids, **kw), want.sequences)
    assert torch.equal(patched.generate(ids, **kw), want.sequences)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_unchanged(name):
    eager = make_model(name).eval()
    patched = fused.patch(copy.deepcopy(eager)).eval()
    ids, _ = batch(1, b=2, s=5)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert_greedy_tokens_of_float64(eager, patched, ids, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_without_labels_or_in_eval(name):
    eager = make_model(name)
    patched = fused.patch(copy.deepcopy(eager))
    ids, labels = batch(2)
    with torch.no_grad():
        out_e, out_p = eager(input_ids=ids), patched(input_ids=ids)  # training mode, no labels
        assert out_p.loss is None
        torch.testing.assert_close(out_p.logits, out_e.logits, rtol=1e-5, atol=1e-5)
        eager.eval(), patched.eval()
        out_e, out_p = eager(input_ids=ids, labels=labels), patched(input_ids=ids, labels=labels)
        torch.testing.assert_close(out_p.logits, out_e.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out_p.loss, out_e.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2"])
def test_save_and_load_round_trip(name, tmp_path):
    eager = make_model(name)
    keys = set(eager.state_dict())
    patched = fused.patch(copy.deepcopy(eager))
    assert set(patched.state_dict()) == keys
    patched.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == type(eager).__name__ and loaded.config.architectures == [type(eager).__name__]
    state = loaded.state_dict()
    assert set(state) == keys
    for key, value in eager.state_dict().items():
        assert torch.equal(state[key], value), key


# One family per code path (RMSNorm + SwiGLU + RoPE; Gemma-2's offset norms, sandwich norms and softcap; Phi-3's fused
# gate_up and partial rotary; GPT-2's LayerNorm and GELU MLP): the others run the same patched modules, and every
# family's loss and gradients are checked above.
@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3", "gpt2"])
def test_training_tracks_eager(name):
    eager = make_model(name)
    patched = fused.patch(copy.deepcopy(eager))
    hyper = dict(lr=1e-2, weight_decay=0.01)
    runs = []
    for model, opt in (
        (eager, torch.optim.AdamW(eager.parameters(), **hyper)),
        (patched, fused.optim.AdamW(patched.parameters(), **hyper)),
    ):
        losses = []
        for step in range(20):
            opt.zero_grad()
            ids, labels = batch(step % 2)  # two batches seen again and again: the loss must fall
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append(torch.tensor(losses))
    torch.testing.assert_close(runs[1], runs[0], rtol=2e-4, atol=0)
    assert runs[0][-5:].mean() < runs[0][:5].mean() - 0.1  # it learned: the comparison is not of flat curves


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_load_balancing_loss_added(name):
    """With output_router_logits (top-2 routing of 4 experts in float32, inputs checked to route as in float64), the
    loss includes the router's load-balancing loss as transformers adds it, and aux_loss and router_logits are
    returned; every gradient, the router's too, as accurate as eager's."""
    config = configs()[name]()
    config.num_experts_per_tok = 2
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config).train()
    ref64 = float64_copy(eager)
    patched = fused.patch(copy.deepcopy(eager))
    ids, labels = batch()
    runs = []
    for model in (patched, eager, ref64):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels, output_router_logits=True)
        out.loss.backward()
        runs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (out_p, grads_p), (out_e, grads_e), (out_r, grads_r) = runs
    # every token's 2nd and 3rd router logits apart by far more than float32 runs differ from float64 (about 1e-6):
    # each run routes as float64 does, on any CPU
    for logits in out_r.router_logits:
        top = logits.sort(-1, descending=True).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-3
    assert out_p.aux_loss is not None and len(out_p.router_logits) == config.num_hidden_layers
    assert_accuracy(out_p.aux_loss.reshape(1), out_e.aux_loss.reshape(1), out_r.aux_loss.reshape(1))
    assert_accuracy(out_p.loss.reshape(1), out_e.loss.reshape(1), out_r.loss.reshape(1))
    for key in grads_e:
        assert_accuracy(grads_p[key], grads_e[key], grads_r[key])
    no_aux = patched(input_ids=ids, labels=labels).loss  # the same loss, rounded once more with the aux loss added
    ulp = 2 * torch.finfo(torch.float32).eps * no_aux.abs().item()
    torch.testing.assert_close(out_p.loss - no_aux, config.router_aux_loss_coef * out_p.aux_loss, rtol=0, atol=ulp)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_moe_dense_layers_get_the_fused_mlp(name):
    """Qwen's mlp_only_layers: a dense gated MLP among the mixtures of experts is patched as the gated MLP is (glu
    runs), the experts are left as they are; loss and gradients as accurate as eager's."""
    config = configs()[name]()
    config.mlp_only_layers = [1]
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config).train()
    assert not hasattr(eager.model.layers[1].mlp, "experts") and hasattr(eager.model.layers[0].mlp, "experts")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert_patched_as_accurate(eager)  # (only the patched model calls fused's ops)
    assert {"fused::glu", "fused::glu_backward"} <= {event.name for event in prof.events()}


@pytest.mark.parametrize("name", FAMILIES)
def test_profile_shows_fused_ops(name):
    patched = fused.patch(make_model(name))
    ids, labels = batch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        patched(input_ids=ids, labels=labels).loss.backward()
    names = {event.name for event in prof.events()}
    expected = EXPECTED_OPS[name] | {"fused::linear_cross_entropy"}
    assert expected <= names, f"missing {sorted(expected - names)}"
    assert not any(n.startswith("aten::") and ("cross_entropy" in n or "log_softmax" in n) for n in names)


def test_switches_leave_parts_alone():
    model = fused.patch(make_model("llama"), rope=False, mlp=False, loss=False)
    ids, labels = batch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=labels).loss.backward()
    names = {event.name for event in prof.events()}
    assert "fused::norm_fwd" in names
    assert not {"fused::rope", "fused::glu", "fused::linear_cross_entropy"} & names


def swapped(model):
    return [m for m in model.modules() if getattr(type(m), "_fused_patched", False)]


def test_unknown_model_raises():
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                    num_attention_heads=2, word_embed_proj_dim=32)  # fmt: skip
    model = transformers.OPTForCausalLM(config)
    with pytest.raises(ValueError, match=r"fused.patch: OPTForCausalLM .*'opt'.*supported model types: .*llama"):
        fused.patch(model)
    with pytest.raises(ValueError, match=r"fused.patch: Linear"):
        fused.patch(torch.nn.Linear(2, 2))


def test_modules_not_where_expected_raise_and_patch_nothing():
    model = make_model("llama")
    model.model.layers[1].mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"fused.patch: LlamaForCausalLM layer 1 has no MLP .*supported model types"):
        fused.patch(model)
    assert not swapped(model)  # never a half patch
    model = make_model("qwen2")
    model.model.layers[0].extra = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"fused.patch: Qwen2ForCausalLM layer 0 has children"):
        fused.patch(model)
    assert not swapped(model)


def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """The rotation of GLM-style models: pairs (x[2i], x[2i + 1]), angles repeated pairwise (not fused.rope's
    halves)."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)

    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_a_rotary_that_fused_rope_does_not_compute_raises(monkeypatch):
    """The attention's apply_rotary_pos_emb is run on a probe before anything is swapped: a rotation other than
    fused.rope's (a family, or a transformers release, that pairs the features otherwise) raises; rope=False
    patches the rest."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _interleaved_rope)
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"fused.patch: LlamaForCausalLM has LlamaAttention calling an apply_rotary"):
        fused.patch(model)
    assert not swapped(model)
    ids, labels = batch()
    eager_loss = model(input_ids=ids, labels=labels).loss
    patched = fused.patch(model, rope=False)
    torch.testing.assert_close(patched(input_ids=ids, labels=labels).loss, eager_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_patching_twice_is_harmless(name):
    model = make_model(name)
    once = copy.deepcopy(fused.patch(copy.deepcopy(model)))
    twice = fused.patch(fused.patch(model))
    ids, labels = batch()
    torch.testing.assert_close(twice(input_ids=ids, labels=labels).loss, once(input_ids=ids, labels=labels).loss)


# ---- the workflows of a user: padding, generation with a cache, checkpointing, compile, LoRA, packing ----------------


def padded_batch(side, fill=5, seed=0):
    """Three sequences of 12, 8 and 5 tokens, right or left padded with token `fill` (attention_mask 0 there), labels
    -100 at the padding and, left padded, at each first token (else the last pad position would predict it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate((12, 8, 5)):
        mask[row, n:] = 0
    if side == "left":
        mask = mask.flip(-1)
    ids = ids.masked_fill(mask == 0, fill)
    labels = ids.masked_fill(mask == 0, -100)
    if side == "left":
        labels[torch.arange(3), (mask == 0).sum(-1)] = -100
    return ids, mask, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_padded_batch_loss_and_gradients(name, side, dtype):
    """A padded batch (attention_mask, labels -100 at the padding): loss and every gradient as accurate as eager's
    against float64, and other token ids at the padded positions change neither (nothing reads them)."""
    eager = make_model(name, dtype)
    ids, mask, labels = padded_batch(side)
    floor = 4 * torch.finfo(dtype).eps
    assert_patched_as_accurate(eager, floor, inputs=dict(input_ids=ids, attention_mask=mask, labels=labels))
    patched = fused.patch(copy.deepcopy(eager))
    loss_a, grads_a = loss_and_grads(patched, ids, labels, attention_mask=mask)
    loss_b, grads_b = loss_and_grads(patched, padded_batch(side, fill=77)[0], labels, attention_mask=mask)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=0)  # a leak moves the loss by 1e-3 and more
    for key in grads_a:
        scale = grads_a[key].abs().max().item()
        torch.testing.assert_close(grads_b[key], grads_a[key], rtol=0, atol=1e-4 * scale, msg=key)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_left_padded_batch_generation_unchanged(name):
    """Greedy generate() of a left-padded batch with its attention_mask: the patched model, like eager, picks the
    float64 model's tokens (assert_greedy_tokens_of_float64)."""
    eager = make_model(name).eval()
    patched = fused.patch(copy.deepcopy(eager))
    ids, mask, _ = padded_batch("left", fill=0)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert_greedy_tokens_of_float64(eager, patched, ids, **kw)


def cached_logits(model, ids, mask, steps):
    """Prefill a left-padded batch into a DynamicCache, then feed `steps` given tokens one at a time with
    past_key_values and use_cache (positions counted from the mask, as generate() does): each step's last logits,
    stacked."""
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = transformers.DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        for step in range(steps.shape[1] + 1):
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                        use_cache=True)  # fmt: skip
            logits.append(out.logits[:, -1].float())
            if step < steps.shape[1]:
                ids = steps[:, step : step + 1]
                mask = torch.cat([mask, torch.ones_like(ids)], -1)
                position_ids = position_ids[:, -1:] + 1
    assert cache.get_seq_length() == mask.shape[1]
    return torch.stack(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "phi3", "gpt2"])
def test_decoding_with_a_cache_as_accurate(name, dtype):
    """Six decoding steps on past_key_values (the same tokens fed to every model): each step's logits as accurate as
    eager's against the float64 model's, in float32 and bfloat16 (where greedy picks may part by rounding)."""
    eager = make_model(name, dtype).eval()
    ref64 = float64_copy(eager)
    patched = fused.patch(copy.deepcopy(eager))
    ids, mask, _ = padded_batch("left", fill=0)
    steps = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    got, eager_logits, want = (cached_logits(model, ids, mask, steps) for model in (patched, eager, ref64))
    assert_accuracy(got, eager_logits, want, floor=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_gradient_checkpointing(name, dtype):
    """model.gradient_checkpointing_enable(), then a training step on a padded batch: loss and every gradient as
    accurate as eager's with checkpointing; each model's first MLP runs twice (the recompute happened)."""
    calls = {}

    def prepare(model):
        model.gradient_checkpointing_enable()
        layer = (model.transformer.h if name == "gpt2" else model.model.layers)[0]
        layer.mlp.register_forward_pre_hook(lambda *_: calls.update({id(model): calls.get(id(model), 0) + 1}))

    ids, mask, labels = padded_batch("right")
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    assert_patched_as_accurate(make_model(name, dtype), 4 * torch.finfo(dtype).eps, inputs=inputs, prepare=prepare)
    assert list(calls.values()) == [2, 2, 2]


@pytest.mark.parametrize("compile_first", [False, True], ids=["patch_then_compile", "compile_then_patch"])
def test_torch_compile_forward_and_backward(compile_first):
    """torch.compile of a patched model (graph breaks allowed), or fused.patch of a compiled one (which patches the
    model it wraps): the compiled training step keeps fused's ops and its loss and every gradient are as accurate
    as the uncompiled patched model's against float64."""
    eager = make_model("llama")
    ref64 = float64_copy(eager)
    if compile_first:
        patched = copy.deepcopy(eager)
        compiled = torch.compile(patched)
        assert fused.patch(compiled) is compiled and swapped(patched)
    else:
        patched = fused.patch(copy.deepcopy(eager))
        compiled = torch.compile(patched)  # the same parameters as patched
    ids, mask, labels = padded_batch("right")
    loss_c, grads_c = loss_and_grads(compiled, ids, labels, attention_mask=mask)
    grads_c = {key.removeprefix("_orig_mod."): grad.clone() for key, grad in grads_c.items()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_and_grads(compiled, ids, labels, attention_mask=mask)
    names = {event.name for event in prof.events()}
    assert {"fused::rope", "fused::norm_fwd", "fused::glu", "fused::linear_cross_entropy_fwd"} <= names  # inner ops
    (loss_p, grads_p), (loss_r, grads_r) = (
        loss_and_grads(model, ids, labels, attention_mask=mask) for model in (patched, ref64)
    )
    assert_accuracy(loss_c.reshape(1), loss_p.reshape(1), loss_r.reshape(1))
    assert grads_c.keys() == grads_p.keys()
    for key in grads_p:
        assert_accuracy(grads_c[key], grads_p[key], grads_r[key], what=key)
    torch._dynamo.reset()


@pytest.mark.parametrize("lm_head", [False, True], ids=["lora", "lora_lm_head"])
def test_lora_on_a_patched_model_and_a_lora_model_patched(lm_head):
    """PEFT's LoRA (on attention, MLP and, with lm_head, the output embedding) added to a patched model, and
    fused.patch of a model that has LoRA already (the PeftModel itself): the patched modules call the adapted
    projections; the loss and every trainable (LoRA) gradient as accurate as the unpatched LoRA model's."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"] + (["lm_head"] if lm_head else [])

    def lora(model):
        torch.manual_seed(1)  # the same adapter weights for every model; B != 0, so the adapters count
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                 task_type="CAUSAL_LM")  # fmt: skip
        return peft.get_peft_model(model, config)

    base = make_model("llama")
    eager = lora(copy.deepcopy(base))
    patched = lora(fused.patch(copy.deepcopy(base)))
    assert len(swapped(patched)) == len(swapped(fused.patch(copy.deepcopy(base))))
    ids, mask, labels = padded_batch("right")
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    assert_patched_as_accurate(eager, inputs=inputs, patched=patched)
    assert fused.patch(eager) is eager and len(swapped(eager)) == len(swapped(patched))
    assert_patched_as_accurate(lora(copy.deepcopy(base)), inputs=inputs, patched=eager)


@pytest.mark.parametrize("patch_first", [True, False], ids=["patch_then_offload", "offload_then_patch"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_accelerate_offload_hooks(name, patch_first):
    """accelerate's cpu_offload, as from_pretrained(device_map=...) offloads layers: each weight on meta until its
    module's hook brings it in, the hook wrapping the forward on each instance. Patched before or after the hooks,
    the patched forwards run (fused's ops in the profile), hooked modules are called rather than read, and the
    training loss with labels is as accurate as the unpatched model's against float64."""
    accelerate = pytest.importorskip("accelerate")
    eager = make_model(name)
    ref64 = float64_copy(eager)
    patched = fused.patch(copy.deepcopy(eager)) if patch_first else copy.deepcopy(eager)
    accelerate.cpu_offload(patched, execution_device=torch.device("cpu"))
    if not patch_first:
        fused.patch(patched)
    ids, mask, labels = padded_batch("right")
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        losses = [m(input_ids=ids, attention_mask=mask, labels=labels).loss.reshape(1) for m in (patched, eager, ref64)]
    names = {event.name for event in prof.events()}
    gpt2_ops, llama_ops = {"fused::layer_norm", "fused::bias_act"}, {"fused::rope", "fused::add_rms_norm", "fused::glu"}
    expected = gpt2_ops if name == "gpt2" else llama_ops
    assert expected <= names, f"missing {sorted(expected - names)}"
    assert_accuracy(*losses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_sequences_with_position_ids(dtype):
    """Packed sequences: explicit position_ids restarting at each sequence, no attention_mask, labels -100 at each
    first token: loss and every gradient as accurate as eager's."""
    ids, _ = batch(3)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    labels = ids.masked_fill(position_ids == 0, -100)
    inputs = dict(input_ids=ids, position_ids=position_ids, labels=labels)
    assert_patched_as_accurate(make_model("llama", dtype), 4 * torch.finfo(dtype).eps, inputs=inputs)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "phi3", "olmo2", "mixtral", "gpt2"])
def test_autocast_training_as_accurate(name):
    """The usual mixed-precision recipe, float32 parameters under bf16 autocast: the hidden states, logits, loss and
    gradients in eager's dtypes, and the loss and every gradient as accurate as eager's against a float64 copy
    (autocast leaves float64 alone). Qwen3's q/k norms take bf16 projections with float32 weights."""
    eager = make_model(name)
    ref64, patched = float64_copy(eager), fused.patch(copy.deepcopy(eager))
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (loss_p, grads_p), (loss_e, grads_e), (loss_r, grads_r) = (
            loss_and_grads(model, ids, labels) for model in (patched, eager, ref64)
        )
        with torch.no_grad():
            out_p, out_e = (model.eval()(input_ids=ids, output_hidden_states=True) for model in (patched, eager))
    assert out_p.logits.dtype == out_e.logits.dtype
    assert [h.dtype for h in out_p.hidden_states] == [h.dtype for h in out_e.hidden_states]
    assert loss_p.dtype == loss_e.dtype == torch.float32
    floor = 4 * torch.finfo(torch.bfloat16).eps
    assert_accuracy(loss_p.reshape(1), loss_e.reshape(1), loss_r.reshape(1), floor=floor)
    for key in grads_e:
        assert grads_p[key].dtype == grads_e[key].dtype, key
        assert_accuracy(grads_p[key], grads_e[key], grads_r[key], floor=floor, what=key)


def test_eval_train_switches_and_a_cast_after_patching():
    """model.eval() / .train() after patching pick the logits / fused-loss paths; model.to(torch.bfloat16) after
    patching trains as accurately as the unpatched model cast likewise."""
    eager = make_model("gemma")
    patched = fused.patch(copy.deepcopy(eager))
    ids, labels = batch()
    with torch.no_grad():
        patched.eval(), eager.eval()
        out_p, out_e = patched(input_ids=ids, labels=labels), eager(input_ids=ids, labels=labels)
        torch.testing.assert_close(out_p.logits, out_e.logits, rtol=1e-5, atol=1e-5)
        patched.train()
        assert patched(input_ids=ids, labels=labels).logits is None  # the fused loss again
    patched.to(torch.bfloat16)
    assert_patched_as_accurate(eager.train().to(torch.bfloat16), 4 * torch.finfo(torch.bfloat16).eps, patched=patched)


# ---- FSDP2: a patched Llama, fully_shard per decoder layer, 2 gloo processes --------------------------------------

WORLD = 2  # as tests/test_distributed_optim.py's run_worker


def fsdp_losses(model, rank, steps=4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        ids, labels = batch(10 * step + rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def fsdp_body(rank):
    eager = fsdp_losses(make_model("llama"), rank)
    patched = fsdp_losses(fused.patch(make_model("llama")), rank)  # patch first: fully_shard swaps classes too
    torch.testing.assert_close(patched, eager, rtol=1e-5, atol=0)


def test_fsdp2_same_losses_as_unpatched():
    import torch.multiprocessing as mp

    from tests.test_distributed_optim import run_worker  # gloo set-up and a teardown that cannot abort

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(fsdp_body, os.path.join(tmp, "init")), nprocs=WORLD, join=True)
