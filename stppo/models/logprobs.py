"""Per-token log-probabilities of a batch under a causal LM, and the frozen reference model.

Alignment (stppo/batch.py): log_probs[:, t] = log π(ids[t] | ids[:t]), read from the logits at
position t−1; position 0 carries no log-prob (0). Position ids come from the attention mask
(cumsum − 1, clamped at 0), so right- and left-padded layouts of the same rows give the same
numbers — the rollout engine left-pads, the trainer right-pads.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from stppo.algos.entropy import entropy_from_logits, token_log_probs


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, T) bool/int mask → (N, T) long positions: p_t = (Σ_{t'≤t} m_t') − 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def _check(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.dim() != 2 or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be (N, T)")


def policy_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                     return_entropy: bool = False):
    """log π(ids[t] | ids[:t]) at every position → (N, T); 0 at each row's first real token
    (t=0 when right-padded) and on padding.

    With `return_entropy`, also H_t = −Σ_v π(v | ids[:t]) log π(v | ids[:t]) → (N, T), the
    entropy of the distribution that produced token t (0 at t=0 and on padding).
    Gradients flow when the caller has them enabled.
    """
    _check(input_ids, attention_mask)
    mask = attention_mask.bool()
    out = model(input_ids=input_ids, attention_mask=mask.long(),
                position_ids=position_ids_from_mask(mask), use_cache=False)
    logits = out.logits  # (N, T, V) — logits[:, t] predicts ids[:, t+1]; kept contiguous
    targets = F.pad(input_ids[:, 1:], (0, 1))  # (N, T) — last column is a dummy
    lp = token_log_probs(logits, targets)[:, :-1].float()  # (N, T-1)
    valid = mask[:, 1:] & mask[:, :-1]  # (N, T-1) — a row's first real token has no log-prob
    zero = lp.new_zeros(lp.shape[0], 1)
    log_probs = torch.cat([zero, lp.masked_fill(~valid, 0.0)], dim=1)  # (N, T)
    if not return_entropy:
        return log_probs
    ent = entropy_from_logits(logits)[:, :-1].float().masked_fill(~valid, 0.0)  # (N, T-1)
    return log_probs, torch.cat([zero, ent], dim=1)


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` (eval mode, no gradients) — π_ref for the KL term."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref
