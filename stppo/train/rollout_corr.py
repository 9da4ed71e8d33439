"""Where the run's rollout correction acts in the own trainer (docs/design.md §2, "Rollout
correction"), in verl 0.9.1's order (`ray_trainer.py` / `v1/trainer_base.py`,
`compute_rollout_correction_and_add_to_batch`, `apply_bypass_mode`,
`compute_policy_loss_bypass_mode`):

  decoupled (π_rollout, π_old, π_θ)   once per step in the batch preparation, from the recomputed
      π_old and the sampler's log-probs over the whole batch (`step_correction`): the rejected
      tokens leave `Batch.loss_mask` — before the advantages, so GAE, whitening, the critic's and
      the policy's losses and their denominators all see the kept tokens, as verl's response_mask
      — and the IS weights ride along as `Batch.rollout_is_weights`, multiplying the per-token
      policy-gradient term of every minibatch (`policy_loss(..., rollout_is_weights=ω)`).
  bypass (π_old := π_rollout)          no old-log-prob forward; in each minibatch's loss, from the
      current π_θ (detached) and π_rollout (`minibatch_correction`): the policy loss (only it)
      aggregates over the kept tokens with the denominators of all agent tokens (verl's bypass
      loss gets the mini-batch's counts from the unmodified mask); `ppo_clip` is the preset's loss
      against π_rollout, `reinforce` verl's REINFORCE loss with the IS weights.
  none                                 nothing acts; the mismatch diagnostics per minibatch.

Metrics: verl's `rollout_corr/*` — the off-policy diagnostics of `sampler_mismatch` and the
correction's IS / RS statistics — computed where the correction is, over the original agent
tokens. Under data parallelism every statistic of the batch (the IS batch normaliser, every
metric) is the whole batch's: computed on all ranks' rows (`Dist.gather_rows`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from stppo.algos import Corrected, sampler_mismatch
from stppo.algos.rollout_corr import DIAGNOSTIC_IS_THRESHOLD, rollout_correction
from stppo.batch import Batch

Gather = Optional[Callable[..., tuple[tuple[torch.Tensor, ...], slice]]]


def sampler_log_probs(batch: Batch, rc) -> torch.Tensor:
    """The batch's sampler log-probs, which every correction but 'none' needs (one-line error)."""
    if batch.rollout_log_probs is None:
        raise ValueError(f"algo.rollout_correction={rc.name} needs the sampler's log-probs "
                         "(Batch.rollout_log_probs), which this batch does not carry")
    return batch.rollout_log_probs


def _correct(train_lp: torch.Tensor, batch: Batch, rc, gather: Gather, with_metrics: bool,
             ) -> tuple[Corrected, dict]:
    """The correction of `batch`'s rows (this rank's) and the metrics of the whole batch (all
    ranks' rows, when `gather`)."""
    xs = (train_lp.detach(), sampler_log_probs(batch, rc), batch.loss_mask)
    (lp, roll, mask), mine = gather(*xs) if gather is not None else (xs, slice(None))
    acts = rc.rollout_is is not None or rc.rollout_rs is not None
    c = rollout_correction(lp, roll, mask, rc) if acts else Corrected(None, mask, {})
    metrics = {}
    if with_metrics:
        threshold = None if rc.rollout_is is not None else DIAGNOSTIC_IS_THRESHOLD
        metrics = {**sampler_mismatch(lp, roll, mask, threshold), **c.metrics}
    t = train_lp.shape[1]
    weights = c.weights[mine, :t] if c.weights is not None and rc.applies_weights else None
    return Corrected(weights, c.loss_mask[mine, :t], c.metrics), metrics


def step_correction(batch: Batch, old: torch.Tensor, rc, gather: Gather = None,
                    ) -> tuple[Batch, dict[str, float]]:
    """Decoupled mode, once per step: `batch` with the kept agent tokens as its loss mask and the
    IS weights (when the correction applies any), and the step's `rollout_corr/*` metrics.
    `old` (N, T): the recomputed log π_old."""
    c, metrics = _correct(old, batch, rc, gather, with_metrics=True)
    return (replace(batch, loss_mask=c.loss_mask, rollout_is_weights=c.weights),
            {k: float(v) for k, v in metrics.items()})


def minibatch_correction(lp: torch.Tensor, old: torch.Tensor, mb: Batch, rc, gather: Gather,
                         with_metrics: bool) -> tuple[Corrected, dict]:
    """What the policy loss of minibatch rows `mb` takes — (IS weights or None, the agent tokens
    it aggregates over) — and, `with_metrics`, the minibatch's `rollout_corr/*` metrics: bypass
    mode's correction from π_θ (`lp`), else (decoupled, none) the step's weights and mask and, for
    'none', the mismatch diagnostics of π_old (`old`) against the sampler (when the batch has its
    log-probs). `gather`: all ranks' rows for the metrics and a batch normaliser."""
    if rc.bypass_mode:
        return _correct(lp, mb, rc, gather, with_metrics)
    c = Corrected(mb.rollout_is_weights, mb.loss_mask, {})
    if not with_metrics or rc.decoupled or mb.rollout_log_probs is None:
        return c, {}  # decoupled: the step's metrics were logged with the correction
    return c, _correct(old, mb, rc, gather, with_metrics=True)[1]
