"""The turn_drift stabiliser (docs/extending.md): PPO's clipped surrogate, plus a penalty on how
far each agent turn moved as a whole,

    L = agg(s_t)  +  β · agg(d_t²),     d_t = mean_{t' ∈ turn(t)} δ_t',  δ = log π_θ − log π_old,

s the clipped surrogate loss of token-level ratios (−min(ρA, clip(ρ)A), with the dual clip when
the spec has one, `clipped_surrogate`), agg the spec's aggregation over agent tokens (each token
of a turn carries its turn's d²) with the batch's denominators — so the loss of a batch is the sum
of its parts' losses (`separable=True`). Where the ratio clip only bounds single tokens, the
penalty pulls back a turn whose tokens all drift the same way. Rollout IS weights multiply the
surrogate as on stppo's clip path.
"""

from __future__ import annotations

import torch

from stppo.algos import agg_loss, clipped_surrogate, importance_ratio, loss_mode, turn_ratio


def check(options: dict) -> None:
    """Reject what makes no sense (one line, before any work)."""
    if options["beta"] < 0:
        raise ValueError(f"turn_drift: beta must be >= 0, got {options['beta']}")


@loss_mode(options={"beta": 0.1}, separable=True, ratio_levels=("token",), dual_clip=True, check=check,
           namespace="turn_drift")
def turn_drift(x, spec):
    """(loss, metrics) of the module docstring; `x` the `stppo.algos.LossInputs`, `spec` the
    run's `LossSpec` (its options hold the resolved β)."""
    mask = x.loss_mask
    ratio, delta = importance_ratio(x.log_probs, x.old_log_probs, mask, x.turn_ids, "token")
    adv = torch.where(mask, x.advantages, 0.0)
    if x.rollout_is_weights is not None:
        adv = adv * x.rollout_is_weights
    s = clipped_surrogate(ratio, adv, spec.clip_low, spec.clip_high, spec.dual_clip)
    d = torch.log(turn_ratio(delta, mask, x.turn_ids))  # (N, T) each token's turn mean of δ
    penalty = agg_loss(d.square(), mask, spec.loss_agg, x.global_denoms)
    loss = agg_loss(s.loss, mask, spec.loss_agg, x.global_denoms) + spec.options["beta"] * penalty
    with torch.no_grad():
        shift = torch.where(mask, d.abs(), 0.0)
        metrics = {"turn_drift/penalty": penalty.detach(),
                   "turn_drift/turn_shift_max": shift.max() if shift.numel() else shift.sum()}
    return loss, metrics
