"""The `Batch`: one padded token sequence per trajectory (docs/design.md §1).

Layout: right-padded, shape (N, T). Position t of every per-token tensor refers to token
`input_ids[:, t]`; `log_probs[:, t]` is log π(input_ids[:, t] | input_ids[:, :t]), so position 0
(always a prompt token) carries no log-prob. `loss_mask` is True exactly on tokens the policy
sampled (every turn); prompt, observation and padding positions are False and carry turn id -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch

PER_TOKEN = (
    "input_ids", "attention_mask", "loss_mask", "turn_ids", "rollout_log_probs",
    "stale_log_probs", "old_log_probs", "ref_log_probs", "values", "rewards", "advantages", "returns",
    "rollout_is_weights", "segment_ids",
)
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
