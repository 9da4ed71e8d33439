"""DAPO's batch-level equations (arXiv 2503.14476 v1 §3.2 and §3.4; verl 0.9.1): which groups
dynamic sampling keeps, and the overlong reward penalty. The trainer side (refilling the batch,
applying the penalty) is `stppo.train.dapo`. docs/design.md §2, "DAPO".

Dynamic sampling keeps a group of G > 1 trajectories of one question only if its rewards do not
all agree (0 < #correct < G for 0/1 rewards): a group whose rewards agree has zero group-relative
advantage and adds no gradient. Groups of one are kept (verl: `len(values) > 1 and std == 0`
filters).

Soft overlong punishment (Eq. 13), with L the trajectory length, L_max the length limit and
L_cache = `buffer_len` the buffer before it:

    R_length(L) = 0                                   if L ≤ L_max − L_cache
                = ((L_max − L_cache) − L) / L_cache    if L_max − L_cache < L ≤ L_max
                = −1                                   if L > L_max

times `penalty_factor`, added to the trajectory's score — verl's DAPO reward manager computes
min(−(L − (L_max − L_cache)) / L_cache · factor, 0), the same for L ≤ L_max (stppo's rollout never
exceeds L_max; beyond it the paper's −1 is used).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def groups_with_signal(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(N,) bool: True for trajectories whose group has ≥ 2 members whose scores differ, or only
    one member. scores, group_ids (N,)."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must have one shape (N,), got "
                         f"{tuple(scores.shape)} and {tuple(group_ids.shape)}")
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=scores.device)
    _, inv = torch.unique(group_ids, return_inverse=True)  # (N,)
    g = int(inv.max()) + 1
    r = scores.to(torch.float64)
    lo = torch.full((g,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, reduce="amin")
    hi = torch.full((g,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, reduce="amax")
    count = torch.zeros(g, dtype=torch.long, device=r.device).index_add_(
        0, inv, torch.ones_like(inv))
    keep = (hi > lo) | (count == 1)  # (G,)
    return keep[inv]


@torch.no_grad()
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """R_length · penalty_factor of the module docstring, per trajectory. lengths (N,) → (N,)."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    length = lengths.to(torch.float32)
    start = float(max_len - buffer_len)
    pen = ((start - length) / buffer_len).clamp(max=0.0)  # (N,) 0 before the buffer
    pen = torch.where(length > max_len, -1.0, pen)
    return pen * penalty_factor
