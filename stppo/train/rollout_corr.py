"""The run's rollout correction in the own trainer: one component, three implementations, chosen
once by the correction's mode (docs/design.md §2, "Rollout correction"), in verl 0.9.1's order
(`ray_trainer.py` / `v1/trainer_base.py`, `compute_rollout_correction_and_add_to_batch`,
`apply_bypass_mode`, `compute_policy_loss_bypass_mode`):

    NoCorrection   none: nothing acts; the sampler/trainer diagnostics of π_old per minibatch
    Decoupled      (π_rollout, π_old, π_θ): once per step in the batch preparation, from the
                   recomputed π_old and the sampler's log-probs over the whole batch: the rejected
                   tokens leave `Batch.loss_mask` — before the advantages, so GAE, whitening, the
                   critic's and the policy's losses and their denominators all see the kept
                   tokens, as verl's response_mask — and the IS weights ride along as
                   `Batch.rollout_is_weights`, multiplying the per-token policy-gradient term of
                   every minibatch (`policy_loss(..., rollout_is_weights=ω)`)
    Bypass         π_old := π_rollout (no old-log-prob forward); in each minibatch's loss, from the
                   current π_θ (detached) and π_rollout: the policy loss (only it) aggregates over
                   the kept tokens with the denominators of all agent tokens (verl's bypass loss
                   gets the mini-batch's counts from the unmodified mask); the loss is the
                   preset's against π_rollout, or (loss_type reinforce) the loss mode `reinforce`

The trainer asks the component (`correction_for(rc)`), never the mode:

    old_from_sampler        π_old is the sampler's log-probs (no old-policy forward)
    update_may_own_old      an on-policy update may take π_old from its own forward
    old_log_probs(batch)    the sampler's log-probs as π_old, or None (the trainer's forward)
    prepare(batch, old)     once per step, before the advantages: (batch, metrics)
    loss_inputs(lp, old, mb, denoms)   what one policy-loss call of rows `mb` takes: the agent
                            tokens it aggregates over, the IS weights, the denominators, metrics

Metrics: verl's `rollout_corr/*` (`RolloutCorrection.apply`) computed where the correction is,
over the original agent tokens. Under data parallelism every statistic of the batch (the IS
batch normaliser, every metric) is the whole batch's: computed on all ranks' rows
(`Dist.gather_rows`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Optional

import torch

from stppo.algos import Corrected, RolloutCorrection
from stppo.algos.aggregation import GlobalDenoms, agg_denoms
from stppo.batch import Batch

Gather = Optional[Callable[..., tuple[tuple[torch.Tensor, ...], slice]]]


class LossCorrection(NamedTuple):
    """What one policy-loss call takes from the correction."""
    loss_mask: torch.Tensor  # (n, T) bool: the agent tokens the loss aggregates over
    weights: Optional[torch.Tensor]  # (n, T) IS weights ω, or None
    denoms: GlobalDenoms  # the loss's denominators (None: the call's own)
    metrics: dict  # rollout_corr/* (empty unless asked for, and where the correction is)


class NoCorrection:
    """`algo.rollout_correction=none` (module docstring); the base of the other two."""

    old_from_sampler = False
    update_may_own_old = True

    def __init__(self, rc: RolloutCorrection) -> None:
        self.rc = rc

    def old_log_probs(self, batch: Batch) -> Optional[torch.Tensor]:
        return None

    def prepare(self, batch: Batch, old: Optional[torch.Tensor], gather: Gather = None,
                ) -> tuple[Batch, dict[str, float]]:
        return batch, {}

    def loss_inputs(self, lp: torch.Tensor, old: torch.Tensor, mb: Batch, denoms: GlobalDenoms,
                    gather: Gather = None, with_metrics: bool = True) -> LossCorrection:
        """The batch's mask and weights; with metrics, the mismatch diagnostics of π_old (`old`)
        against the sampler (when the batch has its log-probs)."""
        metrics = {}
        if with_metrics and mb.rollout_log_probs is not None:
            metrics = self._correct(old, mb, gather, True)[1]
        return LossCorrection(mb.loss_mask, mb.rollout_is_weights, denoms, metrics)

    def _correct(self, train_lp: torch.Tensor, batch: Batch, gather: Gather, with_metrics: bool,
                 ) -> tuple[Corrected, dict]:
        """The correction of `batch`'s rows (this rank's) and the metrics of the whole batch (all
        ranks' rows, when `gather`)."""
        xs = (train_lp.detach(), sampler_log_probs(batch, self.rc), batch.loss_mask)
        (lp, roll, mask), mine = gather(*xs) if gather is not None else (xs, slice(None))
        c = self.rc.apply(lp, roll, mask, with_metrics=with_metrics)
        t = train_lp.shape[1]
        weights = c.weights[mine, :t] if c.weights is not None else None
        return Corrected(weights, c.loss_mask[mine, :t], c.metrics), c.metrics


class Decoupled(NoCorrection):
    """Decoupled mode: weights and rejection once per step, from the recomputed π_old."""

    update_may_own_old = False  # it compares the recomputed π_old with the sampler's first

    def prepare(self, batch: Batch, old: Optional[torch.Tensor], gather: Gather = None,
                ) -> tuple[Batch, dict[str, float]]:
        """`batch` with the kept agent tokens as its loss mask and the IS weights (when the
        correction applies any), and the step's `rollout_corr/*` metrics. `old` (N, T): the
        recomputed log π_old."""
        if old is None:
            raise ValueError("a decoupled rollout correction needs the old log-probs: skip_old=False")
        c, metrics = self._correct(old, batch, gather, True)
        return (replace(batch, loss_mask=c.loss_mask, rollout_is_weights=c.weights),
                {k: float(v) for k, v in metrics.items()})

    def loss_inputs(self, lp: torch.Tensor, old: torch.Tensor, mb: Batch, denoms: GlobalDenoms,
                    gather: Gather = None, with_metrics: bool = True) -> LossCorrection:
        """The step's weights and mask (its metrics were logged with the correction)."""
        return LossCorrection(mb.loss_mask, mb.rollout_is_weights, denoms, {})


class Bypass(NoCorrection):
    """Bypass mode: π_old := π_rollout; weights and rejection in each loss call, from π_θ."""

    old_from_sampler = True
    update_may_own_old = False

    def old_log_probs(self, batch: Batch) -> Optional[torch.Tensor]:
        return sampler_log_probs(batch, self.rc)

    def loss_inputs(self, lp: torch.Tensor, old: torch.Tensor, mb: Batch, denoms: GlobalDenoms,
                    gather: Gather = None, with_metrics: bool = True) -> LossCorrection:
        """The correction of π_θ (`lp`) against the sampler; rejection inside the loss, so the
        denominators stay those of every agent token."""
        c, metrics = self._correct(lp, mb, gather, with_metrics)
        return LossCorrection(c.loss_mask, c.weights,
                              agg_denoms(mb.loss_mask) if denoms is None else denoms, metrics)


CORRECTIONS = {"none": NoCorrection, "decoupled": Decoupled, "bypass": Bypass}


def correction_for(rc: RolloutCorrection) -> NoCorrection:
    """The component of correction `rc`: the one place the trainer reads its mode."""
    return CORRECTIONS[rc.mode](rc)


def sampler_log_probs(batch: Batch, rc: RolloutCorrection) -> torch.Tensor:
    """The batch's sampler log-probs, which every correction but 'none' needs (one-line error)."""
    if batch.rollout_log_probs is None:
        raise ValueError(f"algo.rollout_correction={rc.name} needs the sampler's log-probs "
                         "(Batch.rollout_log_probs), which this batch does not carry")
    return batch.rollout_log_probs
