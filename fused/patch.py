"""fused.patch(model): fused's kernels inside a built Hugging Face transformers model, in place.

Each patched module keeps its object, parameters and state_dict keys: only its class is swapped for a subclass
(same name, so save_pretrained writes the same architecture) whose forward calls fused. Everything is checked
before anything is swapped, so a model that does not look as expected raises ValueError and stays unpatched.
The attention modules keep transformers' own forward, run with `apply_rotary_pos_emb` bound to fused.rope.
transformers is imported only here (`pip install fused[transformers]`)."""

import contextlib
import functools
import inspect
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import fused

# The transformers releases tests/test_patch.py ran against.
TESTED_TRANSFORMERS = ("5.24",)


@dataclass(frozen=True)
class Family:
    prefix: str  # class-name prefix: "Llama" for LlamaRMSNorm, LlamaMLP, ...
    norm: str  # "rms", "rms_offset" (Gemma: weight stored as w - 1) or "layer" (nn.LayerNorm)
    # "gated" (gate_proj, up_proj, down_proj), "gate_up" (one gate_up_proj), "gpt2" (c_fc, c_proj), "experts" (a
    # mixture of experts: its experts run transformers' own implementation, which the model's config may pick)
    mlp: str
    rope: bool = True  # attention calls its module's apply_rotary_pos_emb
    add_norm: bool = True  # pre-norm decoder layer: residual add + post_attention_layernorm can fuse
    logits_scaling: bool = False  # the CausalLM divides its logits by config.logits_scaling (Granite)


FAMILIES = {
    "llama": Family("Llama", "rms", "gated"),
    "mistral": Family("Mistral", "rms", "gated"),
    "qwen2": Family("Qwen2", "rms", "gated"),
    "qwen3": Family("Qwen3", "rms", "gated"),
    "gemma": Family("Gemma", "rms_offset", "gated"),
    # Gemma 2 normalises the attention output before the residual add: no add + norm to fuse.
    "gemma2": Family("Gemma2", "rms_offset", "gated", add_norm=False),
    "phi3": Family("Phi3", "rms", "gate_up"),
    "gemma3_text": Family("Gemma3", "rms_offset", "gated", add_norm=False),  # Gemma 3's text model, as Gemma 2's
    # OLMo 2 and 3 normalise after attention and after the MLP (no pre-norm to fuse with the residual add).
    "olmo2": Family("Olmo2", "rms", "gated", add_norm=False),
    "olmo3": Family("Olmo3", "rms", "gated", add_norm=False),
    "smollm3": Family("SmolLM3", "rms", "gated"),
    "ministral": Family("Ministral", "rms", "gated"),
    # Granite scales each residual branch (no plain add to fuse) and divides the logits by logits_scaling.
    "granite": Family("Granite", "rms", "gated", add_norm=False, logits_scaling=True),
    "mixtral": Family("Mixtral", "rms", "experts"),
    "qwen2_moe": Family("Qwen2Moe", "rms", "experts"),
    "qwen3_moe": Family("Qwen3Moe", "rms", "experts"),
    "olmoe": Family("Olmoe", "rms", "experts"),
    # GPT-2's block may carry cross-attention between its two norms; its norms, MLP and loss are patched.
    "gpt2": Family("GPT2", "layer", "gpt2", rope=False, add_norm=False),
}

# transformers' activation modules by class name -> fused's act names.
ACTS = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "ReLU": "relu",
}

DECODER_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
PHI3_DROPOUTS = {"resid_attn_dropout", "resid_mlp_dropout"}


def _fail(model, why: str):
    raise ValueError(
        f"fused.patch: {type(model).__name__} {why}; supported model types: {', '.join(sorted(FAMILIES))} "
        "(tested with transformers " + ", ".join(TESTED_TRANSFORMERS) + ")"
    )


# ---- the forwards the swapped classes run -------------------------------------------------------------------------


def _rms_forward(self, x, residual=None):
    """RMSNorm with transformers' weight (and Gemma's 1 + weight, added in float32 as Gemma does); with a residual,
    (norm(x + residual), x + residual) in one pass."""
    weight = self.weight.float() + 1.0 if self._fused_offset else self.weight
    eps = getattr(self, self._fused_eps_attr)
    if residual is None:
        return fused.rms_norm(x, (x.shape[-1],), weight, eps)
    return fused.add_rms_norm(x, residual, (x.shape[-1],), weight, eps)


def _layer_forward(self, x, residual=None):
    if residual is None:
        return fused.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    return fused.add_layer_norm(x, residual, self.normalized_shape, self.weight, self.bias, self.eps)


def _gated_mlp_forward(self, x):
    return self.down_proj(fused.glu(self.gate_proj(x), self.up_proj(x), self._fused_act))


def _gate_up_mlp_forward(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # strided halves: glu reads them in place
    return self.down_proj(fused.glu(gate, up, self._fused_act))


def _plain(module, cls_name: str) -> bool:
    """Whether module is exactly torch's / transformers' `cls_name` with no hooks: its weight alone says what it
    computes. An adapter (PEFT's LoRA replaces the layer by its own) or a hook makes the patched code call it, as
    does a forward wrapped on the instance (accelerate's device-map and offload hooks, which bring the weight to
    the input's device, from meta where it is offloaded, only when the module is called)."""
    cls = type(module)
    return (
        cls.__name__ == cls_name
        and cls.__module__.startswith(("torch.nn.", "transformers."))
        and "forward" not in vars(module)
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not nn.modules.module._global_forward_hooks
        and not nn.modules.module._global_forward_pre_hooks
    )


def _gpt2_mlp_forward(self, x):
    if not _plain(self.c_fc, "Conv1D"):  # an adapted or hooked c_fc: called as it is, the activation fused after
        return self.dropout(self.c_proj(fused.bias_act(self.c_fc(x), None, self._fused_act)))
    # Conv1D stores its weight as [in, out]: the transpose is nn.Linear's layout.
    h = fused.linear_act(x, self.c_fc.weight.t(), self.c_fc.bias, self._fused_act)
    return self.dropout(self.c_proj(h))


def _pre_norm_decoder_forward(self, hidden_states, **kwargs):
    """transformers' pre-norm decoder layer with the residual add fused into post_attention_layernorm."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    if hasattr(self, "resid_attn_dropout"):
        hidden_states = self.resid_attn_dropout(hidden_states)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    if hasattr(self, "resid_mlp_dropout"):
        hidden_states = self.resid_mlp_dropout(hidden_states)
    return residual + hidden_states


def _rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) as fused.rope."""
    return fused.rope(q, k, cos, sin, unsqueeze_dim)


def _rope_in_input_dtypes(q, k, cos, sin, unsqueeze_dim=1):
    """fused.rope with q's and k's dtypes kept (OLMo 2's apply_rotary_pos_emb, whose cos and sin are float32)."""
    q_embed, k_embed = fused.rope(q, k, cos, sin, unsqueeze_dim)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def _causal_lm_forward(self, **kwargs):
    """In training with labels: the base model, then fused.linear_cross_entropy over the final hidden states (no
    logits are made: the output's logits is None), the loss in float32 as transformers computes it from float32
    logits. Otherwise (and where the output embedding is adapted or hooked) transformers' own forward."""
    labels = kwargs.get("labels")
    head = self.get_output_embeddings()
    if labels is None or not self.training or not _plain(head, "Linear"):
        return self._fused_base.forward(self, **kwargs)
    kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    loss_kwargs = {name: kwargs.pop(name) for name in LOSS_KWARGS if name in kwargs}
    moe = hasattr(self.config, "router_aux_loss_coef")  # a mixture of experts: its load-balancing loss is added
    if moe and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = self.config.output_router_logits
    outputs = getattr(self, self.base_model_prefix)(**kwargs, return_dict=True)
    hidden = outputs[0]
    if FAMILIES[self.config.model_type].logits_scaling:  # (h W^T) / s as (h / s) W^T
        hidden = hidden / self.config.logits_scaling
    ignore_index = loss_kwargs.get("ignore_index", -100)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:  # as transformers' ForCausalLMLoss: position t predicts label t + 1
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = loss_kwargs.get("num_items_in_batch")
    device = hidden.device.type
    # a float32 loss from 16-bit hidden states: fused's loss ops return float32 under autocast (as torch's do)
    float32_loss = hidden.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(device)
    with torch.autocast(device, dtype=hidden.dtype) if float32_loss else contextlib.nullcontext():
        loss = fused.linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            shift_labels.reshape(-1).to(hidden.device),
            linear_bias=head.bias,
            reduction="mean" if num_items is None else "sum",
            ignore_index=ignore_index,
            softcap=getattr(self.config, "final_logit_softcapping", None),
        )
    loss = loss.float()
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    output_cls, extra = CausalLMOutputWithPast, {}
    if moe:
        output_cls = MoeCausalLMOutputWithPast
        if kwargs["output_router_logits"]:  # as transformers' forward adds it, with its own function
            balance = inspect.unwrap(self._fused_base.forward).__globals__["load_balancing_loss_func"]
            mask = kwargs.get("attention_mask")
            extra["aux_loss"] = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, mask)
            loss = loss + self.router_aux_loss_coef * extra["aux_loss"].to(loss.device)
    fields = output_cls.__dataclass_fields__  # the base model's cache, hidden states, attentions, router logits
    extra.update({key: value for key, value in outputs.items() if key in fields})
    output = output_cls(loss=loss, logits=None, **extra)
    return output if return_dict else output.to_tuple()


def _renamed_kwargs(fn: Callable) -> dict:
    """{old: new} for the keyword arguments that transformers' deprecate_kwarg decorators on fn rename before the
    call (each keeps its old_name and new_name in its closure), outermost first."""
    renames = {}
    while fn is not None:
        try:
            names = inspect.getclosurevars(fn).nonlocals
        except TypeError:  # not a Python function
            break
        old, new = names.get("old_name"), names.get("new_name")
        if isinstance(old, str) and isinstance(new, str):
            renames[old] = new
        fn = getattr(fn, "__wrapped__", None)
    return renames


def _with_signature_of(cls: type, forward: Callable) -> Callable:
    """forward(self, **kwargs) as a method with cls.forward's signature (which Trainer and generate() read to pick
    inputs): keyword arguments the original renames (deprecated names) are renamed with its FutureWarning, then
    positional arguments are bound to their names."""
    base = cls.forward
    signature = inspect.signature(base)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    renamed = _renamed_kwargs(base)

    @functools.wraps(base)
    def method(self, *args, **kwargs):
        for old, new in renamed.items():
            if old in kwargs:
                warnings.warn(
                    f"`{old}` is deprecated for `{type(self).__name__}.forward`. Use `{new}` instead.",
                    FutureWarning,
                    stacklevel=2,
                )
                value = kwargs.pop(old)
                kwargs.setdefault(new, value)  # both given: the new name wins, as in transformers
        if args:
            bound = signature.bind(self, *args, **kwargs).arguments
            kwargs = {k: v for k, v in bound.items() if k not in ("self", var_keyword)}
            kwargs.update(bound.get(var_keyword, {}))
        return forward(self, **kwargs)

    return method


# ---- planning: every swap is checked before any is made ------------------------------------------------------------

_SUBCLASSES: dict = {}


def _forward_of(kind: str, cls: type, model=None) -> Callable:
    """The forward a swapped class of `kind` runs in place of cls's."""
    if kind == "rope":
        return _with_rope(model, cls)
    if kind == "loss":
        return _with_signature_of(cls, _causal_lm_forward)
    if kind == "decoder":
        return _with_signature_of(cls, _pre_norm_decoder_forward)
    return {
        "rms": _rms_forward,
        "gated_mlp": _gated_mlp_forward,
        "gate_up_mlp": _gate_up_mlp_forward,
        "gpt2_mlp": _gpt2_mlp_forward,
    }[kind]


def _subclass(cls: type, kind: str, model=None, **class_attrs) -> type:
    """cls with forward replaced (_forward_of), under cls's own name (save_pretrained records the class name)."""
    key = (cls, kind, tuple(sorted(class_attrs.items())))
    if key not in _SUBCLASSES:
        body = dict(class_attrs, forward=_forward_of(kind, cls, model), _fused_patched=True, _fused_base=cls)
        body.update(_fused_kind=kind, _fused_class_attrs=class_attrs, __reduce_ex__=_reduce_patched)
        body.update(__qualname__=cls.__qualname__, __module__=cls.__module__)
        _SUBCLASSES[key] = type(cls.__name__, (cls,), body)
    return _SUBCLASSES[key]


def _reduce_patched(self, protocol):
    """Pickles (torch.save, deepcopy) a patched module as its transformers class and what was swapped: the swapped
    class is not importable under its name, so unpickling rebuilds it."""
    cls = type(self)
    state = object.__reduce_ex__(self, protocol)[2:]
    return (_unpickle_patched, (cls._fused_base, cls._fused_kind, cls._fused_class_attrs), *state)


def _unpickle_patched(base: type, kind: str, class_attrs: dict):
    module = base.__new__(base)
    module.__class__ = _subclass(base, kind, **class_attrs)
    return module


@functools.lru_cache(maxsize=None)
def _rope_kind(apply: Callable):
    """How a modeling file's apply_rotary_pos_emb(q, k, cos, sin) relates to fused.rope, from a probe: "promotes"
    (fused.rope's results and dtypes: float32 q, k with float64 cos, sin give float64), "keeps" (the same values,
    returned in q's and k's dtypes, as OLMo 2's), or None: another rotation (some families pair the features
    otherwise, or rotate another part of the head), whose attention must not be patched. Values are compared in
    float64, with cos/sin as wide as the heads and, where it takes them, half as wide."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 3, 8, generator=g).double()
    angles = [torch.randn(1, 3, width // 2, generator=g, dtype=torch.float64).repeat(1, 1, 2) for width in (8, 4)]
    full, half = [(a.cos(), a.sin()) for a in angles]
    for cos, sin in (full, half):
        try:
            expected = apply(q, k, cos, sin)
        except (RuntimeError, ValueError, IndexError):
            if cos is full[0]:
                return None
            continue  # a family whose rotary always spans the heads
        got = fused.rope(q, k, cos, sin)
        if not all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, expected)):
            return None
    try:
        dtypes = tuple(x.dtype for x in apply(q.float(), k.float(), *full))
    except (RuntimeError, ValueError, IndexError):
        return None
    return {(torch.float64,) * 2: "promotes", (torch.float32,) * 2: "keeps"}.get(dtypes)


def _check_rope(model, cls: type) -> str:
    """cls.forward's apply_rotary_pos_emb's _rope_kind; ValueError where it has none."""
    inner = inspect.unwrap(cls.forward)
    apply = inner.__globals__.get("apply_rotary_pos_emb")
    if "apply_rotary_pos_emb" not in inner.__code__.co_names or apply is None:
        _fail(model, f"has {cls.__name__}.forward without apply_rotary_pos_emb (another transformers release?)")
    kind = _rope_kind(apply)
    if kind is None:
        _fail(model, f"has {cls.__name__} calling an apply_rotary_pos_emb that is not fused.rope's rotation")
    return kind


def _with_rope(model, cls: type) -> Callable:
    """cls.forward (transformers' own code, its decorators unwrapped) with apply_rotary_pos_emb as fused.rope."""
    rope = {"promotes": _rope, "keeps": _rope_in_input_dtypes}[_check_rope(model, cls)]
    inner = inspect.unwrap(cls.forward)
    scope = dict(inner.__globals__, apply_rotary_pos_emb=rope)
    forward = types.FunctionType(inner.__code__, scope, inner.__name__, inner.__defaults__, inner.__closure__)
    forward.__kwdefaults__ = inner.__kwdefaults__
    return forward


def _act_name(model, module, attr: str) -> str:
    act = getattr(module, attr, None)
    name = ACTS.get(type(act).__name__)
    if name is None:
        _fail(model, f"has an MLP activation {type(act).__name__} that fused does not implement")
    return name


def _plan(model, family: Family, rope: bool, norm: bool, mlp: bool, loss: bool) -> list:
    """(module, new class, instance attributes) for every swap, or ValueError naming what is not as expected."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None) if family.mlp != "gpt2" else getattr(base, "h", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        _fail(model, "has no decoder layers where expected")
    plan = []
    p = family.prefix
    if norm:
        found = 0
        for module in model.modules():
            name = type(module).__name__
            if family.norm == "layer" and type(module) in (nn.LayerNorm, fused.nn.FusedLayerNorm):
                plan.append((module, fused.nn.FusedLayerNorm, {}))
                found += 1
            elif family.norm != "layer" and name == f"{p}RMSNorm":
                eps_attr = "variance_epsilon" if hasattr(module, "variance_epsilon") else "eps"
                if not isinstance(getattr(module, eps_attr, None), float) or module.weight.dim() != 1:
                    _fail(model, f"has a {name} without a float eps or a 1-d weight")
                offset = family.norm == "rms_offset"
                new = _subclass(type(module), "rms", _fused_offset=offset, _fused_eps_attr=eps_attr)
                plan.append((module, new, {}))
                found += 1
        if found < 2 * len(layers) + 1:
            kind = "nn.LayerNorm" if family.norm == "layer" else f"{p}RMSNorm"
            _fail(model, f"has {found} {kind} modules, expected at least {2 * len(layers) + 1}")
    for i, layer in enumerate(layers):
        block_mlp = getattr(layer, "mlp", None)
        # a mixture of experts' layer keeps its experts; its dense layers (Qwen's mlp_only_layers) are gated MLPs
        moe_layer = family.mlp == "experts" and isinstance(getattr(block_mlp, "experts", None), nn.Module)
        if mlp and not moe_layer:
            if family.mlp == "gpt2":
                needed, kind, act_attr = ("c_fc", "c_proj", "dropout"), "gpt2_mlp", "act"
            elif family.mlp == "gate_up":
                needed, kind, act_attr = ("gate_up_proj", "down_proj"), "gate_up_mlp", "activation_fn"
            else:
                needed, kind, act_attr = ("gate_proj", "up_proj", "down_proj"), "gated_mlp", "act_fn"
            if block_mlp is None or any(not hasattr(block_mlp, n) for n in needed):
                _fail(model, f"layer {i} has no MLP with {', '.join(needed)}")
            plan.append(
                (block_mlp, _subclass(type(block_mlp), kind), {"_fused_act": _act_name(model, block_mlp, act_attr)})
            )
        if rope and family.rope:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                _fail(model, f"layer {i} has no self_attn")
            _check_rope(model, type(attn))
            plan.append((attn, _subclass(type(attn), "rope", model), {}))
        if norm and family.add_norm:
            children = {name for name, _ in layer.named_children()}
            if children - PHI3_DROPOUTS != DECODER_CHILDREN:
                _fail(model, f"layer {i} has children {sorted(children)}, expected {sorted(DECODER_CHILDREN)}")
            names = set(inspect.unwrap(type(layer).forward).__code__.co_names)
            if not DECODER_CHILDREN <= names:
                _fail(model, f"layer {i}'s forward does not use {sorted(DECODER_CHILDREN - names)}")
            plan.append((layer, _subclass(type(layer), "decoder"), {}))
    if loss and model.get_output_embeddings() is not None and not getattr(type(model), "_fused_patched", False):
        cls = type(model)
        if not inspect.unwrap(cls.forward).__module__.startswith("transformers."):
            _fail(model, "has a forward of its own (a subclass?): pass loss=False to patch the rest")
        if not cls.__name__.endswith(("ForCausalLM", "LMHeadModel")):
            _fail(model, "is not a causal LM with only a language-model head: pass loss=False to patch the rest")
        plan.append((model, _subclass(cls, "loss"), {}))
    return plan


def _wrapped(model):
    """The model inside a wrapper that forwards attribute reads to it (so its config reads as the model's, but its
    forward and class are the wrapper's): a PEFT model's transformers model, torch.compile's original module; None
    for anything else."""
    cls = type(model)
    if cls.__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    if cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo."):
        return model._orig_mod  # compile traces at the first call, and traces again after a patch (class guards)
    return None


def patch(model, *, rope: bool = True, norm: bool = True, mlp: bool = True, loss: bool = True):
    """Put fused into a built transformers model, in place, and return it: RMSNorm / LayerNorm (Gemma's 1 + weight
    kept exact), the gated MLP as fused.glu (GPT-2's as fused.linear_act), the rotary application as fused.rope,
    the residual add + post-attention norm as fused.add_rms_norm where the decoder layer is pre-norm, and, in
    training with labels, the CausalLM loss as fused.linear_cross_entropy over the final hidden states (Gemma 2's
    final logit softcap kept; a mixture of experts' load-balancing loss added with output_router_logits, as
    transformers adds it; the output's logits are None then). labels=None or eval: logits as before.
    Parameters and state_dict keys are unchanged. Supported model types: FAMILIES; another model, or one whose
    modules are not where expected, raises ValueError and is left as it was. A PEFT model (get_peft_model's) or a
    torch.compile'd model is patched through the transformers model it wraps (LoRA's adapted modules are called as
    they are) and returned."""
    inner = _wrapped(model)
    if inner is not None:
        patch(inner, rope=rope, norm=norm, mlp=mlp, loss=loss)
        return model
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None or not isinstance(model, nn.Module):
        _fail(model, f"(model_type {model_type!r}) is not a supported transformers model")
    for module, new_cls, attrs in _plan(model, family, rope, norm, mlp, loss):
        if not getattr(type(module), "_fused_patched", False) and type(module) is not fused.nn.FusedLayerNorm:
            module.__class__ = new_cls
            if "_old_forward" in vars(module):  # accelerate's hook on the instance calls the forward it wrapped
                module._old_forward = types.MethodType(new_cls.forward, module)
        for key, value in attrs.items():
            setattr(module, key, value)
    return model


__all__ = ["patch", "FAMILIES", "TESTED_TRANSFORMERS"]
