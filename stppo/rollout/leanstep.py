"""The decoding step of the rollout: one token per row through the model → next-token logits.

For the Qwen2 and Llama families (the tiny/small/base presets, SmolLM2, Qwen2.5), `decode_step`
runs the model's own code without the module machinery around it: its weights through
`F.linear` (what `nn.Linear.forward` is), its RMSNorm, rotary embedding and activation
`forward`s, its modeling module's `apply_rotary_pos_emb` and transformers' SDPA attention
function, in the order its decoder layers run them. What it leaves out is `nn.Module.__call__`,
the decorators and keyword plumbing of ~50 module calls per step, the reshapes around (B, 1, E)
hidden states and, but for one, the per-layer conversions of the boolean mask to SDPA's additive
one: about a fifth of a step on the tiny preset on one CPU thread (benchmarks/bench_rollout.py).

It is used only where it is the model's forward:
  * the exact classes (`Qwen2ForCausalLM`, `LlamaForCausalLM` and their layers, `nn.Linear`
    projections), full attention in every layer, SDPA, no forward hooks or patched `forward`s,
    and the 4-D mask (or None) the engine hands over for SDPA (`engine._step_mask`);
  * and once per model and setting (device, parameter dtype, autocast, mask or none) the first
    step runs both ways on the same cache and must give the same logits bit for bit; otherwise
    (a transformers release that changes a layer, or a device whose SDPA picks another kernel
    for the additive mask) the model's forward is used from then on, with one warning.
Anything else steps through `model(...)`.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# model → {setting: whether the lean step reproduced the model's forward}
_checked: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]]" = weakref.WeakKeyDictionary()


def _families() -> dict[type, tuple[type, type, type, type]]:
    """CausalLM class → (decoder layer, attention, MLP, RMSNorm) classes of its modeling module."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    return {qwen2.Qwen2ForCausalLM: (qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention,
                                     qwen2.Qwen2MLP, qwen2.Qwen2RMSNorm),
            llama.LlamaForCausalLM: (llama.LlamaDecoderLayer, llama.LlamaAttention,
                                     llama.LlamaMLP, llama.LlamaRMSNorm)}


def _hooked(model: nn.Module) -> bool:
    """Any forward hook on any module (or a global one), or a `forward` replaced on an instance
    (accelerate's device-map hooks do that): their effects live outside the classes' code."""
    from torch.nn.modules import module as mod
    if mod._global_forward_hooks or mod._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
               for m in model.modules())


def supported(model: nn.Module) -> bool:
    """The model is one whose decoding step `LeanStep` reproduces (classes, attention, hooks)."""
    classes = _families().get(type(model))
    if classes is None:
        return False
    layer_cls, attn_cls, mlp_cls, norm_cls = classes
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    core = model.model
    if type(core.norm) is not norm_cls or type(model.lm_head) is not nn.Linear:
        return False
    for layer in core.layers:
        a, m = layer.self_attn, layer.mlp
        if (type(layer) is not layer_cls or type(a) is not attn_cls or type(m) is not mlp_cls
                or type(layer.input_layernorm) is not norm_cls
                or type(layer.post_attention_layernorm) is not norm_cls
                or getattr(a, "sliding_window", None) is not None
                or any(type(p) is not nn.Linear for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                          m.gate_proj, m.up_proj, m.down_proj))):
            return False
    return not _hooked(model)


class LeanStep:
    """`model(input_ids, position_ids, attention_mask, cache).logits[:, -1]` for a supported
    model, without the module machinery. The weights are read at construction: build one per
    rollout (they do not change during it)."""

    def __init__(self, model: nn.Module):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        modeling = sys.modules[type(model).__module__]
        core = model.model
        self.embed = core.embed_tokens.weight
        self.rotary = core.rotary_emb.forward
        self.norm = core.norm.forward
        self.head = (model.lm_head.weight, model.lm_head.bias)
        self.rope: Callable = modeling.apply_rotary_pos_emb
        self.attend: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            model.config._attn_implementation, modeling.eager_attention_forward)
        self.layers = []
        for layer in core.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.forward, a,
                (a.q_proj.weight, a.q_proj.bias), (a.k_proj.weight, a.k_proj.bias),
                (a.v_proj.weight, a.v_proj.bias), (a.o_proj.weight, a.o_proj.bias),
                layer.post_attention_layernorm.forward, m.act_fn.forward,
                (m.gate_proj.weight, m.gate_proj.bias), (m.up_proj.weight, m.up_proj.bias),
                (m.down_proj.weight, m.down_proj.bias)))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], cache) -> torch.Tensor:
        """(B, 1) ids and positions, the (B, 1, 1, n) bool mask or None (as transformers builds
        it for SDPA), the KV cache (appended to) → (B, V) logits. The hidden states are kept
        (B, E): the same matrix products as on (B, 1, E), without the reshapes around them."""
        h = F.embedding(input_ids[:, 0], self.embed)  # (B, E)
        cos, sin = self.rotary(h, position_ids)  # (B, 1, D)
        mask = attention_mask
        for i, (norm1, attn, q, k, v, o, norm2, act, gate, up, down) in enumerate(self.layers):
            x = norm1(h)
            heads = (x.shape[0], 1, -1, attn.head_dim)
            qs = F.linear(x, *q).view(heads).transpose(1, 2)  # (B, H, 1, D)
            ks = F.linear(x, *k).view(heads).transpose(1, 2)
            vs = F.linear(x, *v).view(heads).transpose(1, 2)
            qs, ks = self.rope(qs, ks, cos, sin)
            ks, vs = cache.update(ks, vs, i)
            if mask is not None and mask.dtype == torch.bool:
                # SDPA turns a boolean mask into this additive one at every call: once here.
                mask = torch.zeros(mask.shape, dtype=qs.dtype, device=mask.device
                                   ).masked_fill_(~mask, float("-inf"))
            out, _ = self.attend(attn, qs, ks, vs, mask,
                                 dropout=0.0 if not attn.training else attn.attention_dropout,
                                 scaling=attn.scaling)
            h = h + F.linear(out.reshape(x.shape[0], -1), *o)
            x = norm2(h)
            h = h + F.linear(act(F.linear(x, *gate)) * F.linear(x, *up), *down)
        return F.linear(self.norm(h), *self.head)  # (B, V)


def decode_step(model: nn.Module, cache_key: str) -> Callable:
    """The rollout's one-token step for `model`: (ids (B, 1), positions (B, 1), mask, cache) →
    (B, V) logits. `cache_key`: the forward's keyword for the cache (`kvcache.cache_kwarg`)."""

    def forward(ids, positions, mask, past):
        return model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                     **{cache_key: past}).logits[:, -1]

    if not supported(model):
        return forward
    lean = LeanStep(model)
    checked = _checked.setdefault(model, {})
    setting = _setting(model)  # fixed for the step's life (a turn): built under one autocast

    def step(ids, positions, mask, past):
        if mask is not None and mask.dim() != 4:  # a 2-D mask: the model builds the 4-D one
            return forward(ids, positions, mask, past)
        key = (*setting, mask is None)
        ok = checked.get(key)
        if ok is None:
            ok, logits = _compare(lean, forward, ids, positions, mask, past)
            checked[key] = ok
            if not ok:
                log.warning("stppo: the rollout's lean decoding step of %s differs from its "
                            "forward here; stepping through the forward",
                            type(model).__name__)
            return logits
        return lean(ids, positions, mask, past) if ok else forward(ids, positions, mask, past)

    return step


def _setting(model: nn.Module) -> tuple:
    """What may change which kernels run, but the mask: device, parameter dtype, autocast."""
    p = model.lm_head.weight
    device = p.device.type
    autocast = torch.is_autocast_enabled(device)
    return device, p.dtype, autocast, torch.get_autocast_dtype(device) if autocast else None


def _compare(lean: LeanStep, forward: Callable, ids, positions, mask, past
             ) -> tuple[bool, torch.Tensor]:
    """Run the step both ways on the same cache, rewound in between → (equal bit for bit, the
    forward's logits). The forward runs last, so the cache ends as it leaves it."""
    mine = lean(ids, positions, mask, past)
    past.crop(-ids.shape[1])  # negative: drop that many positions (every transformers release)
    theirs = forward(ids, positions, mask, past)
    return mine.dtype == theirs.dtype and torch.equal(mine, theirs), theirs
