"""The actor's loss from log-probs: the preset's policy loss, the KL term, the entropy bonus and
the step's diagnostics (docs/design.md §2, §4).

`actor_loss(lp, ent, mb, ctx, scope)` takes the (n, T) log-probs and entropies of minibatch rows
`mb` — with the policy forward's graph, or detached leaves (`stppo.train.microbatch`) — so one
assembly serves the whole-minibatch loss, a micro-batch's share of it and the metrics pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stppo.algos import (LossOutput, LossSpec, agg_loss, agg_weights, clip_bias_term,
                         importance_ratio, kl_loss, policy_loss, turn_breakdown)
from stppo.algos.aggregation import GlobalDenoms
from stppo.algos.clip_bias import Reduce
from stppo.batch import Batch
from stppo.metric_names import ENTROPY, PG_LOSS
from stppo.train.context import UpdateContext
from stppo.train.distributed import Dist
from stppo.train.rollout_corr import Gather, correction_for



@dataclass(frozen=True)
class Scope:
    """How one loss call relates to its minibatch.

    denoms: (D_tok, D_seq) of the whole minibatch (over ranks), or None for the call's own counts.
    reduce: the all-reduce sum of the loss's batch statistics over ranks, or None.
    metrics: whether the call reports the step's metrics (a micro-batch's share does not).
    clip_bias_grad_norm: the `grad` estimator's ‖C‖ when the caller computed it (micro-batches).
    gather: every rank's rows (`Dist.gather_rows`) for the rollout correction's statistics, or None."""

    denoms: GlobalDenoms = None
    reduce: Reduce = None
    metrics: bool = True
    clip_bias_grad_norm: Optional[torch.Tensor] = None
    gather: Gather = None


def whole(mb: Batch, d: Dist, clip_bias_grad_norm: Optional[torch.Tensor] = None) -> Scope:
    """The minibatch in one call (this rank's rows of it under data parallelism, docs/design.md §5)."""
    return Scope(d.global_denoms(mb.loss_mask), d.reduce, True, clip_bias_grad_norm,
                 d.gather_rows if d.active else None)


def share(denoms: GlobalDenoms) -> Scope:
    """One part of a minibatch: its share of the minibatch's loss; no metrics, no collectives."""
    return Scope(denoms, None, False)


def old_log_probs(lp: torch.Tensor, mb: Batch) -> torch.Tensor:
    """log π_old: the batch's, or (on-policy update) the forward's own detached log-probs."""
    return mb.old_log_probs if mb.old_log_probs is not None else lp.detach()


def grad_estimator(spec: LossSpec) -> bool:
    return spec.clip_bias is not None and spec.clip_bias.estimator == "grad"


def policy_inputs(lp: torch.Tensor, old: torch.Tensor, mb: Batch, spec: LossSpec, scope: Scope,
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], GlobalDenoms, dict]:
    """(the agent tokens the policy loss aggregates over, its IS weights or None, its
    denominators, the rollout correction's metrics) of rows `mb`: what the run's rollout
    correction gives this call (`stppo.train.rollout_corr`)."""
    return tuple(correction_for(spec.rollout_correction).loss_inputs(
        lp, old, mb, scope.denoms, scope.gather, scope.metrics))


def actor_loss(lp: torch.Tensor, ent: torch.Tensor, mb: Batch, ctx: UpdateContext,
               scope: Scope, params: Optional[list] = None) -> tuple[torch.Tensor, dict, LossOutput]:
    """(loss, metrics, the policy loss's output — its ρ and κ per token) of rows `mb` from their
    log-probs `lp` and entropies `ent` (n, T). `params`: the policy parameters, read by the
    `grad` estimator unless `scope` brings ‖C‖."""
    algo, spec, d = ctx.algo, ctx.algo.spec, ctx.dist
    old = old_log_probs(lp, mb)
    grad_est = grad_estimator(spec)
    mask, weights, denoms, corr_metrics = policy_inputs(lp, old, mb, spec, scope)
    out = policy_loss(lp, old, mb.advantages, mask, mb.turn_ids, spec,
                      global_denoms=denoms, reduce=scope.reduce,
                      params=params if grad_est else None, rollout_is_weights=weights,
                      clip_bias_grad_norm=scope.clip_bias_grad_norm if grad_est else None,
                      segment_ids=mb.segment_ids)
    loss, m = out.loss, out.metrics
    entropy = agg_loss(ent, mb.loss_mask, spec.loss_agg, scope.denoms)
    if scope.metrics:
        m[PG_LOSS] = d.all_sum(m[PG_LOSS])  # this rank's share of the minibatch's loss → the whole
        m.update(diagnostics(out, lp, ent, old, mb, mask, ctx))
        m.update(corr_metrics)
        m[ENTROPY] = d.all_sum(entropy.detach())
    if algo.kl.coef > 0 and not algo.kl.in_reward and mb.ref_log_probs is not None:
        kl, km = kl_loss(lp, mb.ref_log_probs, mb.loss_mask, kind=algo.kl.estimator,
                         loss_agg=spec.loss_agg, global_denoms=scope.denoms)
        loss = loss + algo.kl.coef * kl
        if scope.metrics:
            m.update({k: d.all_sum(v) for k, v in km.items()})
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * entropy
    return loss, m, out


def clip_bias_of(lp: torch.Tensor, mb: Batch, spec: LossSpec, denoms: GlobalDenoms,
                 clipped: torch.Tensor, *, as_corrected: bool = False) -> torch.Tensor:
    """agg(κ ρ A) of rows `mb` with lp's graph — its gradient is the clipping bias C — weighted
    as in the minibatch (`denoms`), so the parts' terms sum to the minibatch's; κ (n, T) as the
    policy loss of these rows returned it (`LossOutput.clipped`). `as_corrected`: the term the
    `grad` estimator scales by, ωA in place of A under the rollout correction's IS weights (the
    clip path's advantages, `stppo.algos.loss`); else the diagnostic's, with A. Over the tokens
    the policy loss aggregates (a rollout correction's rejection applied)."""
    old = old_log_probs(lp, mb)
    mask, w, bypass_denoms, _ = policy_inputs(lp, old, mb, spec, share(denoms))
    denoms = denoms if denoms is not None else bypass_denoms
    adv = mb.advantages
    if as_corrected and w is not None:
        adv = mb.advantages * w
    ratio, _ = importance_ratio(lp, old, mask, mb.turn_ids, spec.ratio_level)  # with graph
    adv = torch.where(mask, adv, 0.0)
    w = agg_weights(mask, spec.loss_agg, denoms, ratio.dtype)
    return clip_bias_term(ratio, adv, clipped, mask, spec.loss_agg, weights=w)


def loss_clipped(lp: torch.Tensor, mb: Batch, spec: LossSpec, denoms: GlobalDenoms) -> torch.Tensor:
    """κ of rows `mb` from a policy loss call on their detached log-probs, without the clip-bias
    scale: for the one pass that needs κ before the loss exists (the `grad` estimator's ‖C‖
    over micro-batches, `stppo.train.microbatch`)."""
    with torch.no_grad():
        lp = lp.detach()
        old = old_log_probs(lp, mb)
        mask, weights, d, _ = policy_inputs(lp, old, mb, spec, share(denoms))
        return policy_loss(lp, old, mb.advantages, mask, mb.turn_ids, spec.replace(clip_bias=None),
                           global_denoms=d, rollout_is_weights=weights, segment_ids=mb.segment_ids).clipped


def diagnostics(out, lp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor, mb: Batch,
                mask: torch.Tensor, ctx: UpdateContext) -> dict[str, torch.Tensor]:
    """The minibatch's per-turn breakdown (from the loss's own ρ and κ, `out`, over the agent
    tokens `mask` the loss aggregates) (docs/design.md §4)."""
    if not ctx.max_turns:
        return {}
    return turn_breakdown(out.ratio, lp, old, mb.advantages, ent, out.clipped, mask, mb.turn_ids,
                          ctx.max_turns, rollout_log_probs=mb.rollout_log_probs)
