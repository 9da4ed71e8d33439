"""The `Batch`: one padded token sequence per trajectory (docs/design.md §1).

Layout: right-padded, shape (N, T). Position t of every per-token tensor refers to token
`input_ids[:, t]`; `log_probs[:, t]` is log π(input_ids[:, t] | input_ids[:, :t]), so position 0
(always a prompt token) carries no log-prob. `loss_mask` is True exactly on tokens the policy
sampled (every turn); prompt, observation and padding positions are False and carry turn id -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

import torch

PER_TOKEN = (
    "input_ids", "attention_mask", "loss_mask", "turn_ids", "rollout_log_probs",
    "stale_log_probs", "old_log_probs", "ref_log_probs", "values", "rewards", "advantages", "returns",
    "rollout_is_weights", "segment_ids",
)
PAD = {"attention_mask": False, "loss_mask": False, "turn_ids": -1}  # else 0 (input_ids: the pad id)
PER_TRAJECTORY = (
    "group_ids", "scores", "num_turns", "num_searches", "num_valid", "num_invalid",
    "finished", "truncated", "response_length", "rollout_lags",
)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (N, T) long — exact ids; sampled ids never re-encoded
    attention_mask: torch.Tensor  # (N, T) bool — True on real tokens (prompt, agent, observation)
    loss_mask: torch.Tensor  # (N, T) bool — True on agent (sampled) tokens only
    turn_ids: torch.Tensor  # (N, T) long — 0..K_i-1 on agent tokens, -1 elsewhere
    group_ids: torch.Tensor  # (N,) long — prompt id, for group-relative advantages
    scores: torch.Tensor  # (N,) float — outcome reward of the trajectory (0 if truncated)
    rollout_log_probs: Optional[torch.Tensor] = None  # (N, T) float — sampler's log-probs
    old_log_probs: Optional[torch.Tensor] = None  # (N, T) float — log π_old, recomputed
    ref_log_probs: Optional[torch.Tensor] = None  # (N, T) float — log π_ref
    values: Optional[torch.Tensor] = None  # (N, T) float — critic values
    rewards: Optional[torch.Tensor] = None  # (N, T) float — outcome at last agent token (+KL)
    advantages: Optional[torch.Tensor] = None  # (N, T) float
    returns: Optional[torch.Tensor] = None  # (N, T) float
    # (N, T) float — the decoupled rollout correction's IS weights ω (detached; set with the
    # old log-probs, stppo.train.rollout_corr), or None
    rollout_is_weights: Optional[torch.Tensor] = None
    segment_ids: Optional[torch.Tensor] = None  # (N, T) long — subsentence of agent tokens (SSPO)
    num_turns: Optional[torch.Tensor] = None  # (N,) long — generation calls made
    num_searches: Optional[torch.Tensor] = None  # (N,) long
    num_valid: Optional[torch.Tensor] = None  # (N,) long — parseable actions
    num_invalid: Optional[torch.Tensor] = None  # (N,) long
    finished: Optional[torch.Tensor] = None  # (N,) bool — ended with an <answer>
    truncated: Optional[torch.Tensor] = None  # (N,) bool — hit the total-length limit
    response_length: Optional[torch.Tensor] = None  # (N,) long — agent tokens
    # Stale rollouts (trainer.offpolicy.lag > 0; docs/design.md §8), else None:
    rollout_lags: Optional[torch.Tensor] = None  # (N,) long — updates between sampler and π_old
    # (N, T) float — log π of the policy that sampled the row, by the trainer's forward (rows of
    # lag 0: zeros — their sampler is π_old)
    stale_log_probs: Optional[torch.Tensor] = None
    meta: dict = field(default_factory=dict)  # non-tensor extras (question ids, answers, …)

    def __post_init__(self) -> None:
        n, t = self.input_ids.shape
        for name in PER_TOKEN:
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (n, t):
                raise ValueError(f"Batch.{name} has shape {tuple(x.shape)}, expected {(n, t)}")
        for name in PER_TRAJECTORY:
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (n,):
                raise ValueError(f"Batch.{name} has shape {tuple(x.shape)}, expected {(n,)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "Batch":
        """Rows `index` (a long tensor or bool mask) — for minibatches and data-parallel shards."""
        out = {}
        for f in fields(self):
            x = getattr(self, f.name)
            out[f.name] = x[index] if isinstance(x, torch.Tensor) else x
        return Batch(**out)

    def to(self, device: torch.device | str) -> "Batch":
        return replace(self, **{f.name: getattr(self, f.name).to(device)
                                for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})


def rows(batch: Batch, index: torch.Tensor) -> Batch:
    """`batch.select(index)` with the per-row lists of `meta` selected too."""
    out = batch.select(index)
    idx = torch.arange(len(batch))[index].tolist()
    meta = {k: [v[i] for i in idx] if isinstance(v, list) and len(v) == len(batch) else v
            for k, v in batch.meta.items()}
    return replace(out, meta=meta)


def concat_batches(parts: Sequence[Batch], pad_id: int) -> Batch:
    """Rows of `parts` in order, right-padded to the longest; group ids renumbered so that groups
    of different parts never merge. Per-token fields must be set in all parts or in none."""
    parts = [p for p in parts if len(p) > 0]
    if len(parts) == 1:
        return parts[0]
    t = max(p.input_ids.shape[1] for p in parts)
    out, offset, gids = {}, 0, []
    for p in parts:
        gids.append(p.group_ids + offset)
        offset += int(p.group_ids.max()) + 1
    for f in fields(Batch):
        xs = [getattr(p, f.name) for p in parts]
        if f.name == "group_ids":
            out[f.name] = torch.cat(gids)
        elif f.name == "meta":  # per-row lists are joined; anything else is the first part's
            out[f.name] = {k: sum((p.meta[k] for p in parts), []) if all(
                isinstance(p.meta.get(k), list) for p in parts) else v
                for k, v in parts[0].meta.items()}
        elif all(x is None for x in xs):
            out[f.name] = None
        elif any(x is None for x in xs):
            raise ValueError(f"concat_batches: Batch.{f.name} is set in some parts only")
        elif f.name in PER_TOKEN:
            fill = pad_id if f.name == "input_ids" else PAD.get(f.name, 0)
            out[f.name] = torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1]), value=fill)
                                     for x in xs])
        else:
            out[f.name] = torch.cat(xs)
    return Batch(**out)
