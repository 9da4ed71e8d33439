"""Importance ratios at token, turn and sequence level (DESIGN.md §2).

With m the loss mask (agent tokens) and δ_t = clamp(log π_θ(y_t) − log π_old(y_t), −20, 20):

    token:    ρ_t = exp(δ_t)
    turn:     ρ_t = exp( (1/|y^k|) Σ_{t'∈k} δ_t' )      for t in turn k   (Turn-PPO / ST-PPO)
    sequence: ρ_t = exp( (1/|y_i|) Σ_{t'∈i} δ_t' )      for t in trajectory i   (GSPO)

The turn ratio is the geometric mean of the turn's token ratios, shared by its tokens, with *no*
stop-gradient: by Lemma 4.1 of ST-PPO (arXiv 2511.20718 v1) its policy gradient is
w^k Â^k / |y^k| ∇ log π(y^k), with w^k the turn ratio and Â^k = Σ_{t∈k} 1[(k,t) unclipped] A_t.

Masking is done with `torch.where` *before* any nonlinearity, so garbage (nan/inf) on prompt,
observation and padding positions never reaches a result or a gradient. Every ratio function
returns ρ = 1 on non-agent positions. Turns are segments of (row, turn id), flattened into one
segment index; a segment mean is one `scatter_add_` and its broadcast one `index_select` (no loop
over samples, turns or time).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from stppo.algos.registry import Registry

LOG_RATIO_CLAMP = 20.0


def log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
              loss_mask: torch.Tensor) -> torch.Tensor:
    """δ = clamp(log_probs − old_log_probs, −20, 20) on agent tokens, exactly 0 elsewhere. (N, T)

    Half-precision inputs are computed in float32 (ratios and segment sums need the range)."""
    if log_probs.dtype in (torch.float16, torch.bfloat16):
        log_probs = log_probs.float()
    diff = torch.where(loss_mask, log_probs - old_log_probs, 0.0)  # (N, T) garbage → 0 first
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


INTERLEAVE = 8  # accumulators per segment: consecutive tokens of a turn hit different slots


@functools.lru_cache(maxsize=16)
def _ramp(length: int, modulo: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """arange(length) % modulo, cached (read-only: callers never modify it)."""
    return torch.arange(length, dtype=dtype, device=device) % modulo


class TurnSegments(NamedTuple):
    """The (row, turn) segments of a batch: segment id = row·K + turn + 1 on agent tokens and
    row·K (the row's non-agent segment, weight 0) elsewhere, with K = max turn id + 2. Agent
    tokens must carry turn ids ≥ 0 (DESIGN.md §1): an agent token with id -1 falls into the
    non-agent segment (ratio 1, no gradient).

    Scatters address tokens by `slot` = segment·B + (t mod B): B interleaved accumulators per
    segment, so the adds of consecutive tokens of one turn do not form one serial dependency
    chain (≈4x faster on CPU); the B partial sums are added afterwards.
    """

    seg: torch.Tensor  # (N·T,) int32 (int64 for huge batches) segment of each token
    slot: torch.Tensor  # (N·T,) long
    inv_count: torch.Tensor  # (S,) 1/|segment| over agent tokens, 0 for non-agent segments
    num: int  # S = N·K

    @staticmethod
    def build(loss_mask: torch.Tensor, turn_ids: torch.Tensor) -> "TurnSegments":
        """Turn ids off agent tokens are ignored. One host sync: the number of turns K."""
        n, t = loss_mask.shape
        dev = turn_ids.device
        # index arithmetic in int32 (vectorised on CPU, int64 is not), in place where possible
        # (fresh (N, T) buffers cost page faults); masking by multiplication is exact on ints
        itype = torch.int32 if n * (t + 2) * INTERLEAVE < 2**31 else torch.int64
        seg = turn_ids.to(itype).add_(1).mul_(loss_mask.view(torch.uint8))  # (N, T) turn+1 or 0
        k = (int(seg.max()) if seg.numel() else 0) + 1
        seg.add_(_ramp(n, n, itype, dev).unsqueeze(1) * k)  # (N, T) row·K + turn + 1
        slot = torch.empty(n, t, dtype=torch.int64, device=dev)
        torch.add(_ramp(t, INTERLEAVE, itype, dev), seg, alpha=INTERLEAVE, out=slot)
        slot = slot.view(-1)  # (N·T,)
        num = n * k
        count = torch.bincount(slot, minlength=num * INTERLEAVE).view(num, INTERLEAVE).sum(1)
        count.view(n, k)[:, 0] = 0  # the non-agent segments carry no weight
        inv = count.to(torch.float32).reciprocal_().nan_to_num_(posinf=0.0)  # (S,)
        return TurnSegments(seg.view(-1), slot, inv, num)

    def scatter(self, x_flat: torch.Tensor) -> torch.Tensor:
        """(N·T,) → (S,) segment sums through the B interleaved accumulators."""
        acc = x_flat.new_zeros(self.num * INTERLEAVE).scatter_add_(0, self.slot, x_flat)
        return acc.view(self.num, INTERLEAVE).sum(1)

    def gather(self, v: torch.Tensor) -> torch.Tensor:
        """(S,) → (N·T,): each token's segment value."""
        return v.index_select(0, self.seg)


class _TurnRatio(torch.autograd.Function):
    """ρ_t = exp(mean_{t'∈k(t)} δ_t') in one node. With ρ^k the turn ratio and g the incoming
    gradient, ∂L/∂δ_t = ρ^k / |y^k| · Σ_{t'∈k} g_t' for t in turn k (one scatter, one gather)."""

    @staticmethod
    def forward(ctx, delta: torch.Tensor, segs: TurnSegments) -> torch.Tensor:
        inv = segs.inv_count.to(delta.dtype)  # (S,)
        rho_seg = (segs.scatter(delta.reshape(-1)) * inv).exp()  # (S,); 1 on non-agent segments
        ctx.segs, ctx.shape = segs, delta.shape
        ctx.save_for_backward(rho_seg * inv)
        return segs.gather(rho_seg).view(delta.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rho_inv,) = ctx.saved_tensors
        g_seg = ctx.segs.scatter(grad.reshape(-1).to(rho_inv.dtype)) * rho_inv  # (S,)
        return ctx.segs.gather(g_seg).view(ctx.shape), None


RATIO_LEVELS: Registry = Registry("ratio_level")


@RATIO_LEVELS.register("token")
def token_ratio(delta: torch.Tensor, loss_mask: torch.Tensor,
                turn_ids: torch.Tensor | None = None) -> torch.Tensor:
    """ρ_t = exp(δ_t). (N, T); 1 where δ = 0, i.e. on non-agent positions."""
    return delta.exp()


@RATIO_LEVELS.register("turn")
def turn_ratio(delta: torch.Tensor, loss_mask: torch.Tensor,
               turn_ids: torch.Tensor) -> torch.Tensor:
    """ρ_t = exp(mean of δ over the (row, turn) segment of t); no stop-gradient. (N, T)

    exp is taken per turn (S values), then broadcast; non-agent segments have mean 0 → ρ = 1.
    """
    return _TurnRatio.apply(delta, TurnSegments.build(loss_mask, turn_ids))


@RATIO_LEVELS.register("sequence")
def sequence_ratio(delta: torch.Tensor, loss_mask: torch.Tensor,
                   turn_ids: torch.Tensor | None = None) -> torch.Tensor:
    """ρ_t = exp(mean of δ over the agent tokens of t's trajectory) — GSPO. (N, T)"""
    count = loss_mask.sum(dim=1, keepdim=True).clamp(min=1).to(delta.dtype)  # (N, 1)
    rho_seq = (delta.sum(dim=1, keepdim=True) / count).exp()  # (N, 1)
    return torch.where(loss_mask, rho_seq, 1.0)  # (N, T)


def importance_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                     loss_mask: torch.Tensor, turn_ids: torch.Tensor,
                     ratio_level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ, δ) at `ratio_level` ∈ RATIO_LEVELS; both (N, T), ρ = 1 and δ = 0 off agent tokens."""
    fn = RATIO_LEVELS[ratio_level]
    delta = log_ratio(log_probs, old_log_probs, loss_mask)  # (N, T)
    return fn(delta, loss_mask, turn_ids), delta
