"""`policy_loss`: the one entry point of every preset's policy loss (docs/design.md §2).

    policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, spec, *, ...)
        -> LossOutput: loss, metrics, and per token ratio and clipped

`spec` (`stppo.algos.spec.LossSpec`) fixes the loss: its loss mode's function
(`stppo.algos.contract`: the clip path, a baseline, verl's bypass REINFORCE, a researcher's
stabiliser — one registry, one contract) gets the tensors and the call's keywords as
`LossInputs` and the spec. The keywords are what a call adds to the spec: the
data-parallel reduction (`global_denoms`, `reduce`), the policy parameters (the clip bias's
`grad` estimator), the IS weights, a ‖C‖ the caller computed, the subsentence labels (SSPO).
Tensors are checked here, the spec was validated when it was built; a mode's metrics are
checked to be stppo's keys or its own namespace's. A mode that returns only its own metrics
(a stabiliser's) gets the clip path's diagnostics beside them (`stability_metrics`). Besides the
loss and its metrics the output holds what callers need per token, so none recomputes it: ρ at
the spec's ratio level and κ, the clip path's clip indicator (whatever the mode: the per-turn
breakdown, verl's dual-clip fraction and the exact clipping bias read them) — κ as the loss mode
returned it, else computed once on first use.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from stppo.algos.aggregation import GlobalDenoms, agg_weights, weighted_sum
from stppo.algos.clip_bias import Reduce, clip_bias_norm, clip_bias_sq, pg_loss_norm
from stppo.algos.clip_metrics import clip_metrics
from stppo.algos.contract import LossInputs, check_dtypes, check_metric_names, check_token_tensors
from stppo.algos.loss import ratio_and_clip
from stppo.algos.modes import LOSS_MODES
from stppo.algos.ratios import importance_ratio
from stppo.algos.spec import LossSpec
from stppo.algos.surrogate import clipped_surrogate
from stppo.metric_names import PG_CLIPFRAC


class LossOutput:
    """`policy_loss`'s result: `loss` (0-d, with the graph of log_probs), `metrics` (detached 0-d
    tensors keyed by `stppo.metric_names` constants; a mode's own under its namespace), and per
    token: `ratio` (N, T) detached ρ at the spec's ratio level, `clipped` (N, T) bool κ, where
    the clip path's bounds bind (A's sign decides) — the loss mode's own κ when it returned one,
    else computed on first use. Unpacks and indexes as the pair `(loss, metrics)`."""

    __slots__ = ("loss", "metrics", "_inputs", "_clipped", "_per_token")

    def __init__(self, loss: torch.Tensor, metrics: dict, inputs: tuple,
                 clipped: Optional[torch.Tensor] = None):
        self.loss, self.metrics, self._inputs, self._clipped = loss, metrics, inputs, clipped
        self._per_token = None

    def __iter__(self):
        return iter((self.loss, self.metrics))

    def __getitem__(self, i):
        return (self.loss, self.metrics)[i]

    def __len__(self) -> int:
        return 2

    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._per_token is None:
            if self._clipped is None:
                self._per_token = ratio_and_clip(*self._inputs)
            else:
                lp, old, _, mask, turn_ids, spec = self._inputs
                ratio, _ = importance_ratio(lp.detach(), old, mask, turn_ids, spec.ratio_level)
                self._per_token = ratio, self._clipped
        return self._per_token

    @property
    def ratio(self) -> torch.Tensor:
        return self._tokens()[0]

    @property
    def clipped(self) -> torch.Tensor:
        return self._tokens()[1]


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, turn_ids: torch.Tensor, spec: LossSpec, *,
                global_denoms: GlobalDenoms = None, reduce: Reduce = None,
                params: Optional[Iterable[torch.Tensor]] = None,
                rollout_is_weights: Optional[torch.Tensor] = None,
                clip_bias_grad_norm: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None) -> LossOutput:
    """The policy loss of `spec` and its diagnostics (see the module docstring).

    Tensors (N, T): log_probs (with graph), old_log_probs, advantages, loss_mask (bool, agent
    tokens), turn_ids (integers); non-agent positions may hold anything (nan/inf).
    `global_denoms`, `reduce`: data parallelism / split batches (the loss of the whole batch's
    denominators, batch statistics summed over shards); `params`: the policy parameters, for
    the clip bias's estimator 'grad' (or `clip_bias_grad_norm`, its ‖C‖ computed by the
    caller); `rollout_is_weights`: the rollout correction's IS weights ω (N, T), applied by every
    mode (`stppo.algos.rollout_corr`). A rollout correction's rejection is the caller's:
    `loss_mask` holds the kept agent tokens. `segment_ids` (N, T) int: the subsentence labels
    of the agent tokens, for the loss modes that read them (`segments`: sspo)."""
    if not isinstance(spec, LossSpec):
        raise TypeError(f"policy_loss takes a LossSpec, got {type(spec).__name__}")
    mode = LOSS_MODES[spec.runs]  # the preset's mode, or bypass REINFORCE's (`LossSpec.runs`)
    check_token_tensors(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                        loss_mask=loss_mask, turn_ids=turn_ids)
    check_dtypes(log_probs, loss_mask, turn_ids)
    if rollout_is_weights is not None:
        check_token_tensors(log_probs=log_probs, rollout_is_weights=rollout_is_weights)
        rollout_is_weights = rollout_is_weights.detach()
    if mode.segments:
        if segment_ids is None:
            raise ValueError(f"loss_mode={spec.runs!r} needs segment_ids, the subsentence labels "
                             "of the agent tokens (stppo.algos.segments.subsentence_ids)")
        check_token_tensors(log_probs=log_probs, segment_ids=segment_ids)
    if reduce is not None and global_denoms is None:
        raise ValueError("policy_loss: reduce (data parallelism) needs global_denoms")
    x = LossInputs(log_probs, old_log_probs, advantages, loss_mask, turn_ids, global_denoms, reduce,
                   rollout_is_weights, segment_ids, params, clip_bias_grad_norm)
    inputs = (log_probs, old_log_probs, advantages, loss_mask, turn_ids, spec)
    out = mode.fn(x, spec)
    if not (isinstance(out, tuple) and len(out) in (2, 3) and hasattr(out[1], "keys")):
        raise ValueError(f"loss mode {spec.runs!r} must return (loss, metrics) or (loss, "
                         f"metrics, clipped), got {type(out).__name__}")
    loss, metrics, clipped = (*out, None)[:3]
    check_metric_names(spec.runs, metrics)
    metrics = dict(metrics)
    if PG_CLIPFRAC not in metrics:  # a stabiliser's own metrics: the clip path's diagnostics too
        metrics = {**stability_metrics(loss, log_probs, old_log_probs, advantages, loss_mask,
                                       turn_ids, spec, global_denoms, reduce), **metrics}
    return LossOutput(loss, metrics, inputs, clipped)


@torch.no_grad()
def stability_metrics(loss: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                      advantages: torch.Tensor, loss_mask: torch.Tensor, turn_ids: torch.Tensor,
                      spec: LossSpec, global_denoms: GlobalDenoms = None,
                      reduce: Reduce = None) -> dict[str, torch.Tensor]:
    """The clip path's diagnostics for a loss that is not the clip path (a stabiliser): the
    clip fractions, ρ's mean and max, −δ, the clipping-bias norm and the surrogate's norm of the
    clipped surrogate at the spec's ratio level and clip range — what the alarms and the
    collapse-diagnosis panels read — with `actor/pg_loss` the stabiliser's own loss. As on the
    clip path, the clipping-bias norm is the whole batch's under `reduce` (data parallelism)."""
    ratio, delta = importance_ratio(log_probs.detach(), old_log_probs, loss_mask, turn_ids,
                                    spec.ratio_level)
    adv = torch.where(loss_mask, advantages, 0.0)
    sur = clipped_surrogate(ratio, adv, spec.clip_low, spec.clip_high, spec.dual_clip)
    n = loss_mask.sum().clamp(min=1)
    ratio_m = torch.where(loss_mask, ratio, 0.0)
    return clip_metrics(
        loss, loss_norm=pg_loss_norm(sur.loss, loss_mask, spec.loss_agg),
        clipfrac_high=(sur.clipped_high & loss_mask).sum() / n,
        clipfrac_low=(sur.clipped_low & loss_mask).sum() / n,
        ppo_kl=-torch.where(loss_mask, delta, 0.0).sum() / n, ratio_mean=ratio_m.sum() / n,
        ratio_max=ratio_m.max() if ratio_m.numel() else n.new_zeros(()).to(ratio.dtype),
        bias_norm=_bias_norm(ratio, adv, sur.clipped, loss_mask, spec.loss_agg, global_denoms,
                             reduce),
        scale=None, lengths=loss_mask.sum(dim=1))


def _bias_norm(ratio, adv, clipped, loss_mask, loss_agg, global_denoms, reduce) -> torch.Tensor:
    """clip_bias/norm = sqrt(agg(κ(ρA)²)): this call's, or with `reduce` the whole batch's."""
    if reduce is None:
        return clip_bias_norm(ratio, adv, clipped, loss_mask, loss_agg)
    w = agg_weights(loss_mask, loss_agg, global_denoms, ratio.dtype)
    return reduce(weighted_sum(clip_bias_sq(ratio, adv, clipped), w)).sqrt()
