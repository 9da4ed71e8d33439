"""`policy_loss`: the one entry point of every preset's policy loss (docs/design.md §2).

    policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, spec, *, ...)
        -> LossOutput: loss, metrics, and per token ratio and clipped

`spec` (`stppo.algos.spec.LossSpec`) fixes the loss: loss mode 'clip' without rollout IS weights
→ the clip path (`stppo.algos.loss.clip_policy_loss`: token / turn / sequence ratios,
corrections); a built-in mode, or the clip path with IS weights ω as advantages ωA →
`stppo.algos.modes.dispatch`; a researcher's stabiliser → its function (`stppo.algos.plugins`);
a bypass-mode REINFORCE rollout correction (old_log_probs = π_rollout) → verl's REINFORCE loss
(`stppo.algos.rollout_corr.reinforce`).
The keywords are what a call adds to the spec: the data-parallel reduction (`global_denoms`,
`reduce`), the policy parameters (the `grad` estimator), the IS weights, a ‖C‖ the caller
computed, the subsentence labels (SSPO). Besides the loss and its metrics it returns what
callers need per token, so none recomputes it: ρ at the spec's ratio level and κ, the clip
path's clip indicator (whatever the mode: the per-turn breakdown, verl's dual-clip fraction and
the exact clipping bias read them).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

import torch

from stppo.algos.aggregation import GlobalDenoms, agg_weights, weighted_sum
from stppo.algos.clip_bias import Reduce, clip_bias_norm, clip_bias_sq, pg_loss_norm
from stppo.algos.clip_metrics import clip_metrics
from stppo.algos.loss import check_token_tensors, clip_policy_loss
from stppo.algos.modes import LOSS_MODES, dispatch
from stppo.algos.ratios import importance_ratio
from stppo.algos.rollout_corr.reinforce import reinforce_loss
from stppo.algos.spec import LossSpec
from stppo.algos.surrogate import clipped_surrogate


class LossOutput:
    """`policy_loss`'s result: `loss` (0-d, with the graph of log_probs), `metrics` (detached 0-d
    tensors keyed by `stppo.metric_names` constants; a plugin's own under its namespace), and per
    token, computed on first use: `ratio` (N, T) detached ρ at the spec's ratio level, `clipped`
    (N, T) bool κ, where the clip path's bounds bind (A's sign decides). Unpacks and indexes as
    the pair `(loss, metrics)`."""

    __slots__ = ("loss", "metrics", "_inputs", "_per_token")

    def __init__(self, loss: torch.Tensor, metrics: dict, inputs: tuple):
        self.loss, self.metrics, self._inputs, self._per_token = loss, metrics, inputs, None

    def __iter__(self):
        return iter((self.loss, self.metrics))

    def __getitem__(self, i):
        return (self.loss, self.metrics)[i]

    def __len__(self) -> int:
        return 2

    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._per_token is None:
            self._per_token = ratio_and_clip(*self._inputs)
        return self._per_token

    @property
    def ratio(self) -> torch.Tensor:
        return self._tokens()[0]

    @property
    def clipped(self) -> torch.Tensor:
        return self._tokens()[1]


class LossInputs(NamedTuple):
    """What a stabiliser gets besides the spec (`stppo.algos.plugins`): the tensors (N, T), and
    for a batch split over calls the whole batch's denominators and the all-reduce sum."""

    log_probs: torch.Tensor  # log π_θ, with graph
    old_log_probs: torch.Tensor  # log π_old
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # bool: agent tokens
    turn_ids: torch.Tensor  # long: turn of each agent token, -1 elsewhere
    global_denoms: GlobalDenoms = None  # (D_tok, D_seq) of the whole batch, or None: this call's
    reduce: Reduce = None  # sum over data-parallel shards, or None
    rollout_is_weights: Optional[torch.Tensor] = None  # ω (N, T), detached, or None


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, turn_ids: torch.Tensor, spec: LossSpec, *,
                global_denoms: GlobalDenoms = None, reduce: Reduce = None,
                params: Optional[Iterable[torch.Tensor]] = None,
                rollout_is_weights: Optional[torch.Tensor] = None,
                correction_grad_norm: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None) -> LossOutput:
    """The policy loss of `spec` and its diagnostics (see the module docstring).

    Tensors (N, T): log_probs (with graph), old_log_probs, advantages, loss_mask (bool, agent
    tokens), turn_ids (long); non-agent positions may hold anything (nan/inf). `global_denoms`,
    `reduce`: data parallelism / split batches (`stppo.algos.loss.clip_policy_loss`); `params`:
    the policy parameters, for the correction estimator 'grad' (or `correction_grad_norm`, its
    ‖C‖ computed by the caller); `rollout_is_weights`: the rollout correction's IS weights ω
    (N, T), applied by every mode (`stppo.algos.rollout_corr`). A rollout correction's rejection
    is the caller's: `loss_mask` holds the kept agent tokens. `segment_ids` (N, T) int: the
    subsentence labels of the agent tokens, for the loss modes that read them
    (`LossMode.segments`: sspo), ignored by the others."""
    if not isinstance(spec, LossSpec):
        raise TypeError(f"policy_loss takes a LossSpec, got {type(spec).__name__}")
    mode = LOSS_MODES[spec.loss_mode]
    if mode.plugin:
        check_token_tensors(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                            loss_mask=loss_mask, turn_ids=turn_ids)
        w = None if rollout_is_weights is None else rollout_is_weights.detach()
        loss, own = mode.fn(LossInputs(log_probs, old_log_probs, advantages, loss_mask, turn_ids,
                                       global_denoms, reduce, w), spec)
        metrics = {**stability_metrics(loss, log_probs, old_log_probs, advantages, loss_mask,
                                       turn_ids, spec, global_denoms, reduce), **own}
    else:
        kw = dict(ratio_level=spec.ratio_level, clip_low=spec.clip_low, clip_high=spec.clip_high,
                  loss_agg=spec.loss_agg, correction=spec.correction, dual_clip=spec.dual_clip,
                  global_denoms=global_denoms, params=params, reduce=reduce)
        if correction_grad_norm is not None:
            kw["correction_grad_norm"] = correction_grad_norm
        if spec.rollout_correction.reinforce:  # bypass mode: verl's REINFORCE, old = π_rollout
            loss, metrics = reinforce_loss(log_probs, old_log_probs, advantages, loss_mask,
                                           turn_ids, rollout_is_weights=rollout_is_weights, **kw)
        elif spec.loss_mode == "clip" and rollout_is_weights is None:
            loss, metrics = clip_policy_loss(log_probs, old_log_probs, advantages, loss_mask,
                                             turn_ids, **kw)
        else:
            loss, metrics = dispatch(log_probs, old_log_probs, advantages, loss_mask, turn_ids,
                                     loss_mode=spec.loss_mode, options=spec.options,
                                     rollout_is_weights=rollout_is_weights,
                                     segment_ids=segment_ids, **kw)
    return LossOutput(loss, metrics, (log_probs, old_log_probs, advantages, loss_mask, turn_ids, spec))


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


@torch.no_grad()
def ratio_and_clip(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, turn_ids: torch.Tensor,
                   spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ at the spec's ratio level, κ the clip path's clip indicator) (N, T), detached."""
    ratio, _ = importance_ratio(log_probs.detach(), old_log_probs, loss_mask, turn_ids,
                                spec.ratio_level)
    adv = torch.where(loss_mask, advantages, 0.0)
    clipped = clipped_surrogate(ratio, adv, spec.clip_low, spec.clip_high, spec.dual_clip).clipped
    return ratio, clipped
