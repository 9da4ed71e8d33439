"""Per-token log-probabilities of a batch under a causal LM, and the frozen reference model.

Alignment (stppo/batch.py): log_probs[:, t] = log π(ids[t] | ids[:t]), read from the hidden state
at position t−1; position 0 carries no log-prob (0). Position ids come from the attention mask
(cumsum − 1, clamped at 0), so right- and left-padded layouts of the same rows give the same
numbers — the rollout engine left-pads, the trainer right-pads.

Only the positions whose log-probs are needed pay for the vocabulary: the backbone runs over the
whole sequence (under the caller's autocast), then the LM head, log-softmax and entropy run on the
gathered hidden states of the `positions` tokens only (agent tokens in the trainer; at a 152k
vocabulary the head is most of a forward's cost, and prompt and observation tokens are often more
than half of a multi-turn sequence). The head runs in float32 (autocast off, float32 weights):
log-probs and entropies are never computed from low-precision logits.

Chunked head (`head_log_probs`): the head, log-softmax and entropy run over `logits_chunk`
positions at a time, so the float32 logits of one chunk exist at once (a micro-batch of 8 rows
with 2,000 agent tokens each at a 151,936 vocabulary would otherwise hold 9.7 GB per (M, V)
tensor). With gradients each chunk is checkpointed (`torch.utils.checkpoint`, non-reentrant):
its logits are recomputed in the backward pass, one chunk at a time, instead of being saved.
The chunk size is the model's `set_logits_chunk` value, else as many positions as fit
`LOGITS_CHUNK_BYTES` of float32 logits; one chunk holding every position is today's single pass.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from stppo.algos.entropy import entropy_from_logits, sum_pi_squared_from_logits, token_log_probs
from stppo.models.precision import full_precision

LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits of one automatic chunk (~441 positions at 152k)
_CHUNK_ATTR = "stppo_logits_chunk"


def set_logits_chunk(model: torch.nn.Module, positions: int) -> None:
    """LM-head positions per chunk of `policy_log_probs` for `model` (copies inherit it)."""
    if not isinstance(positions, int) or positions < 1:
        raise ValueError(f"logits chunk must be a positive number of positions, got {positions!r}")
    setattr(model, _CHUNK_ATTR, positions)


def logits_chunk(model: torch.nn.Module, vocab: int) -> int:
    """The model's `set_logits_chunk` value, else ⌊LOGITS_CHUNK_BYTES / (4 · vocab)⌋ (≥ 1)."""
    n = getattr(model, _CHUNK_ATTR, None)
    return n if n is not None else max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, T) bool/int mask → (N, T) long positions: p_t = (Σ_{t'≤t} m_t') − 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def _check(input_ids: torch.Tensor, attention_mask: torch.Tensor,
           positions: torch.Tensor | None = None) -> None:
    if input_ids.dim() != 2 or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be (N, T)")
    if positions is not None and (tuple(positions.shape) != tuple(input_ids.shape)
                                  or positions.dtype != torch.bool):
        raise ValueError(f"positions must be a bool (N, T) tensor like input_ids, got "
                         f"{positions.dtype} {tuple(positions.shape)}")


def split_head(model) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(backbone returning `last_hidden_state`, linear LM head) of a causal LM whose logits are
    exactly head(backbone(x)) — Qwen2, Llama and the like; None for models that post-process
    logits (soft-capping, scaling), which then take the full forward."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    cfg = getattr(model, "config", None)
    post = any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if not isinstance(head, torch.nn.Linear) or base is None or base is model or post:
        return None
    return base, head


def linear_fp32(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """layer(x) in float32 with autocast off (a float32 copy of low-precision weights); float64
    weights keep float64 (exactness checks)."""
    w, b = layer.weight, layer.bias
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    if w.dtype != dtype:
        w, b = w.to(dtype), (b.to(dtype) if b is not None else None)
    with full_precision(x.device.type):
        return F.linear(x.to(dtype), w, b)


def hidden_states(backbone, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T, H) last hidden states (after the final norm), position ids from the mask."""
    return backbone(input_ids=input_ids, attention_mask=mask.long(),
                    position_ids=position_ids_from_mask(mask), use_cache=False).last_hidden_state


def target_positions(attention_mask: torch.Tensor,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T−1) bool: token t+1 gets a log-prob — real, not a row's first real token, and in
    `positions` when given."""
    mask = attention_mask.bool()
    sel = mask[:, 1:] & mask[:, :-1]
    return sel if positions is None else sel & positions[:, 1:]


def scatter_rows(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """(M,) values of the True entries of `sel` (N, T−1) → (N, T) float32, 0 elsewhere and at
    t = 0 (differentiable in `values`)."""
    n = sel.shape[0]
    out = values.new_zeros(sel.shape).masked_scatter(sel, values)  # (N, T-1)
    return torch.cat([values.new_zeros(n, 1), out], dim=1)


def _head_chunk(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Linear,
                entropy: bool, entropy_grad: bool, pi_sq: bool = False):
    """(log-probs (c,), entropies (c,) or None[, Σπ² (c,) without graph]) of one chunk: float32
    logits, then each; the third only with `pi_sq`."""
    logits = linear_fp32(hidden, head)  # (c, V) float32
    with full_precision(logits.device.type):
        lp = token_log_probs(logits, targets)
        extra = ()
        if pi_sq:
            with torch.no_grad():
                extra = (sum_pi_squared_from_logits(logits.detach()),)
        if not entropy:
            return (lp, None, *extra)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return (lp, entropy_from_logits(logits), *extra)


def head_log_probs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *,
                   chunk: int, entropy: bool = False, entropy_grad: bool = True,
                   sum_pi_squared: bool = False):
    """log softmax(head(hidden))[targets] (M,) and, with `entropy`, the entropies (M,) (else None),
    from hidden states (M, H) in float32, `chunk` positions at a time (module docstring).
    `entropy_grad=False` computes the entropies without graph (they only feed metrics).
    `sum_pi_squared`: a third value, Σ_v π(v)² (M,) without graph (the optimal token baseline)."""
    m = hidden.shape[0]
    if m <= chunk:  # one pass: the logits are saved for backward as by any autograd op
        return _head_chunk(hidden, targets, head, entropy, entropy_grad, sum_pi_squared)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    parts = []
    for i in range(0, m, chunk):
        args = (hidden[i:i + chunk], targets[i:i + chunk], head, entropy, entropy_grad,
                sum_pi_squared)
        parts.append(checkpoint(_head_chunk, *args, use_reentrant=False, preserve_rng_state=False)
                     if recompute else _head_chunk(*args))
    return tuple(torch.cat(xs) if xs[0] is not None else None for xs in zip(*parts))


def policy_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                     return_entropy: bool = False, positions: torch.Tensor | None = None,
                     entropy_grad: bool = True, chunk: int | None = None):
    """log π(ids[t] | ids[:t]) → (N, T) float32, 0 at each row's first real token (t=0 when
    right-padded), on padding, and off `positions` (bool (N, T); None = every real token).

    With `return_entropy`, also H_t = −Σ_v π(v | ids[:t]) log π(v | ids[:t]) → (N, T), the
    entropy of the distribution that produced token t (0 where the log-prob is 0 by the rule
    above); `entropy_grad=False` returns it without graph. Gradients flow when the caller has
    them enabled. `chunk`: LM-head positions per chunk (None: `logits_chunk(model, V)`).
    """
    lp, ent, _ = _token_stats(model, input_ids, attention_mask, positions, return_entropy,
                              entropy_grad, chunk, False)
    return (lp, ent) if return_entropy else lp


@torch.no_grad()
def policy_log_probs_sum_pi_squared(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                    *, positions: torch.Tensor | None = None,
                                    chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(ids[t] | ids[:t]), Σ_v π(v | ids[:t])²), both (N, T) float32 and 0 where
    `policy_log_probs` gives 0, from one forward without graph: the old-policy pass of the optimal
    token baseline (stppo.algos.advantages; verl's `calculate_sum_pi_squared`)."""
    lp, _, s2 = _token_stats(model, input_ids, attention_mask, positions, False, False, chunk,
                             True)
    return lp, s2


def _token_stats(model, input_ids, attention_mask, positions, entropy, entropy_grad, chunk,
                 pi_sq):
    """(log-probs, entropies or None, Σπ² or None) (N, T) of `policy_log_probs`."""
    _check(input_ids, attention_mask, positions)
    mask = attention_mask.bool()
    sel = target_positions(mask, positions)  # (N, T-1)
    targets = input_ids[:, 1:][sel]  # (M,)
    parts = split_head(model)
    if parts is not None:
        backbone, head = parts
        hidden = hidden_states(backbone, input_ids, mask)  # (N, T, H)
        chunk = chunk or logits_chunk(model, head.out_features)
        out = head_log_probs(hidden[:, :-1][sel], head, targets, chunk=chunk, entropy=entropy,
                             entropy_grad=entropy_grad, sum_pi_squared=pi_sq)  # (M,) each
        lp, ent, s2 = out if pi_sq else (*out, None)
        with full_precision(lp.device.type):
            return tuple(scatter_rows(x, sel) if x is not None else None for x in (lp, ent, s2))
    # full forward; the logits of the needed positions in float32
    out = model(input_ids=input_ids, attention_mask=mask.long(),
                position_ids=position_ids_from_mask(mask), use_cache=False)
    logits = out.logits[:, :-1][sel].float()  # (M, V)
    with full_precision(logits.device.type):
        lp = scatter_rows(token_log_probs(logits, targets), sel)  # (N, T)
        ent = scatter_rows(entropy_from_logits(logits), sel) if entropy else None
        s2 = None
        if pi_sq:
            with torch.no_grad():
                s2 = scatter_rows(sum_pi_squared_from_logits(logits.detach()), sel)
        return lp, ent, s2


def reference_model(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A frozen copy of `model` (eval mode, no gradients) — π_ref for the KL term; held in
    `dtype` when given (a bfloat16 reference halves its memory; its log-probs still come from a
    float32 head)."""
    ref = copy.deepcopy(model)
    if dtype is not None:
        ref = ref.to(dtype=dtype)
    ref.eval()
    ref.requires_grad_(False)
    return ref
