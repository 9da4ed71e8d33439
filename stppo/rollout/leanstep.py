"""The rollout's calls into the model (`ModelSteps`): the prefill of a turn's new tokens over
the cached ones, and the decoding steps → next-token logits.

For the Qwen2 and Llama families (the tiny/small/base presets, SmolLM2, Qwen2.5), both run the
model's own code without the module machinery around it (`LeanStep`): its weights through
`F.linear` (what `nn.Linear.forward` is), its RMSNorm, rotary embedding and activation
`forward`s, its modeling module's `rotate_half` in `apply_rotary_pos_emb`'s formula and
transformers' SDPA attention function, in the order its decoder layers run them. Left out:
`nn.Module.__call__`, the decorators and keyword plumbing of ~50 module calls per step, the
reshapes around (B, W, E) hidden states and, in a prefill, the last layer's work on positions
whose output nobody reads (all but the last; their keys and values are still cached). Measured
on the tiny preset on one CPU thread: a rollout 1.24x faster (benchmarks/bench_rollout.py).

A decoding step is the model's forward bit for bit, and is used only where that was shown:
  * the exact classes (`Qwen2ForCausalLM`, `LlamaForCausalLM` and their layers, `nn.Linear`
    projections), full attention in every layer, SDPA, no forward hooks or patched `forward`s,
    and the 4-D mask (or None) the engine hands over for SDPA (`engine._step_mask`);
  * and once per model and setting (device, parameter dtype, autocast, mask or none) the first
    step runs both ways on the same cache and must give the same logits bit for bit; otherwise
    (a transformers release that changes a layer, say) the model's forward is used from then on,
    with one warning.
A prefill with a cache runs the same code once the masked decoding step passed that check; its
cache is the forward's bit for bit, its last-position logits (a turn's first token) the same
computation on fewer rows, equal up to other matrix kernels' rounding (~1e-7 measured), as when
a group's shared prompt is prefilled once. Anything else goes through `model(...)`.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from stppo.rollout.kvcache import supports_row_caches

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
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if not supports_row_caches(model):  # a sliding-window or other non-full attention layer
        return False
    core = model.model
    if type(core.norm) is not norm_cls or type(model.lm_head) is not nn.Linear:
        return False
    for layer in core.layers:
        a, m = layer.self_attn, layer.mlp
        if (type(layer) is not layer_cls or type(a) is not attn_cls or type(m) is not mlp_cls
                or type(layer.input_layernorm) is not norm_cls
                or type(layer.post_attention_layernorm) is not norm_cls
                or any(type(p) is not nn.Linear for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                          m.gate_proj, m.up_proj, m.down_proj))):
            return False
    return not _hooked(model)


class LeanStep:
    """`model(input_ids, position_ids, attention_mask, cache).logits[:, -1]` for a supported
    model, without the module machinery. The weights are read at construction: build one per
    turn (they do not change during it)."""

    def __init__(self, model: nn.Module):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        modeling = sys.modules[type(model).__module__]
        core = model.model
        self.embed = core.embed_tokens.weight
        self.rotary = core.rotary_emb.forward
        self.norm = core.norm.forward
        self.head = (model.lm_head.weight, model.lm_head.bias)
        self.rotate_half: Callable = modeling.rotate_half
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
        """(B, W) ids and positions, the (B, 1, W, n) bool mask or None (as transformers builds
        it for SDPA), the KV cache (appended to) → (B, V) logits of the last position.

        Hidden states are kept (B·W, E): the same matrix products as on (B, W, E), without the
        reshapes around them. With W > 1 (a prefill) the last layer runs its keys and values
        over all W positions (the cache needs them) and the rest — query, attention, output
        projection, MLP — on the last position only, the only one whose output is read: the
        same computation on fewer rows, so the logits may differ from the forward's by the
        rounding of other matrix kernels (~1e-7 measured), the cache not at all."""
        b, w = input_ids.shape
        h = F.embedding(input_ids.reshape(-1), self.embed)  # (B·W, E)
        cos, sin = self.rotary(h, position_ids)  # (B, W, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, W, D): over heads
        last = len(self.layers) - 1
        for i, (norm1, attn, q, k, v, o, norm2, act, gate, up, down) in enumerate(self.layers):
            x = norm1(h)
            heads = (b, w, -1, attn.head_dim)
            ks = self._rope(F.linear(x, *k).view(heads).transpose(1, 2), cos, sin)  # (B, H, W, D)
            vs = F.linear(x, *v).view(heads).transpose(1, 2)
            ks, vs = cache.update(ks, vs, i)
            mask = attention_mask
            if i == last and w > 1:  # from here on, the last position only
                h, x, cos, sin = h[w - 1::w], x[w - 1::w], cos[:, :, -1:], sin[:, :, -1:]
                mask = None if mask is None else mask[:, :, -1:]
                heads = (b, 1, -1, attn.head_dim)
            qs = self._rope(F.linear(x, *q).view(heads).transpose(1, 2), cos, sin)
            out, _ = self.attend(attn, qs, ks, vs, mask,
                                 dropout=0.0 if not attn.training else attn.attention_dropout,
                                 scaling=attn.scaling)
            h = h + F.linear(out.reshape(h.shape[0], -1), *o)
            x = norm2(h)
            h = h + F.linear(act(F.linear(x, *gate)) * F.linear(x, *up), *down)
        return F.linear(self.norm(h), *self.head)  # (B, V)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotary_pos_emb`'s formula for one of q, k (the two may differ in length)."""
        return (x * cos) + (self.rotate_half(x) * sin)


class ModelSteps:
    """The rollout's two calls into `model`, each (ids (B, W), positions (B, W), mask, cache) →
    (B, V) next-token logits of the last position: `prefill` (W new tokens per row after the
    cached ones) and `decode` (W = 1). `cache_key`: the forward's keyword for the cache
    (`kvcache.cache_kwarg`). Build one per turn: it reads the weights and the autocast state."""

    def __init__(self, model: nn.Module, cache_key: str):
        self.model, self.cache_key = model, cache_key
        self.lean = LeanStep(model) if supported(model) else None
        self.checked = _checked.setdefault(model, {}) if self.lean is not None else {}
        self.setting = _setting(model) if self.lean is not None else ()

    def forward(self, ids, positions, mask, past, *, logits_to_keep: int = 0) -> torch.Tensor:
        """The model's own forward."""
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                          use_cache=True, logits_to_keep=logits_to_keep,
                          **{self.cache_key: past}).logits[:, -1]

    def decode(self, ids, positions, mask, past) -> torch.Tensor:
        """One token per row: the lean step once checked bit for bit on this setting, else the
        forward (the first step of a setting runs both and returns the forward's logits)."""
        if self.lean is None or (mask is not None and mask.dim() != 4):
            return self.forward(ids, positions, mask, past)  # a 2-D mask: the model builds one
        key = (*self.setting, mask is None)
        ok = self.checked.get(key)
        if ok is None:
            ok, logits = _compare(self.lean, self.forward, ids, positions, mask, past)
            self.checked[key] = ok
            if not ok:
                log.warning("stppo: the rollout's lean decoding step of %s differs from its "
                            "forward here; stepping through the forward",
                            type(self.model).__name__)
            return logits
        return (self.lean if ok else self.forward)(ids, positions, mask, past)

    def prefill(self, ids, positions, mask, past) -> torch.Tensor:
        """The new tokens over the cached ones: the lean step (its last layer on the last
        position only) where decoding steps with a mask passed the check, else the forward."""
        if (self.lean is not None and mask is not None and mask.dim() == 4
                and self.checked.get((*self.setting, False))):
            return self.lean(ids, positions, mask, past)
        return self.forward(ids, positions, mask, past, logits_to_keep=1)


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
