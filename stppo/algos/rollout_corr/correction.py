"""`RolloutCorrection`: a run's sampler/trainer mismatch correction, read once (docs/design.md §2,
"Rollout correction").

Its name (`algo.rollout_correction`) and options resolve to verl 0.9.1's seven
`RolloutCorrectionConfig` fields (`stppo.algos.rollout_corr.presets`), and from those to one
`mode`, decided here and nowhere else:

    none        no weights, no rejection: the sampler/trainer diagnostics only
    decoupled   three policies (π_rollout, π_old, π_θ): IS weights and rejection once per step,
                from the recomputed π_old
    bypass      π_old := π_rollout (no old-policy forward): weights and rejection in each loss
                call, from the current π_θ; loss_type 'reinforce' runs the loss mode `reinforce`

`apply(train_log_probs, rollout_log_probs, loss_mask)` is the correction of one batch — the IS
weights the policy loss multiplies by (None when it applies none), the kept agent tokens and
verl's `rollout_corr/*` metrics (the off-policy diagnostics and the IS / RS statistics) — for
every mode and caller: the own trainer (`stppo.train.rollout_corr`, which decides *when* by the
mode) and verl's losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional

import torch

from stppo.algos.breakdown import sampler_mismatch
from stppo.algos.rollout_corr.presets import ROLLOUT_CORRECTIONS, resolve
from stppo.algos.rollout_corr.rejection import rejection_mask
from stppo.algos.rollout_corr.weights import Reduce, is_weights

# The C of the token IS statistics logged as a diagnostic when a run's correction applies no IS
# weights (verl's default rollout_is_threshold).
DIAGNOSTIC_IS_THRESHOLD = 2.0
MODES = ("none", "decoupled", "bypass")


class Corrected(NamedTuple):
    weights: Optional[torch.Tensor]  # (N, T) ω, detached, 0 off agent tokens; None: no IS weights
    loss_mask: torch.Tensor  # (N, T) bool: the agent tokens rejection sampling keeps
    metrics: dict  # detached 0-d float64 tensors under verl's rollout_corr/* names


@torch.no_grad()
def rollout_correction(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       loss_mask: torch.Tensor, rc: Any, reduce: Reduce = None) -> Corrected:
    """IS weights and rejection mask of correction `rc` (fields rollout_is, rollout_is_threshold,
    rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold) from r = log π_train −
    log π_rollout (N, T) on agent tokens `loss_mask` (bool), computed in float64; the weights come
    back in train_log_probs' dtype. `reduce`: a sum over data-parallel ranks for the batch
    normaliser (verl's `distributed_masked_mean`). verl's
    `compute_rollout_correction_and_rejection_mask` without its off-policy diagnostics."""
    if train_log_probs.shape != rollout_log_probs.shape or train_log_probs.shape != loss_mask.shape:
        raise ValueError(f"train_log_probs, rollout_log_probs and loss_mask must have one shape "
                         f"(N, T); got {tuple(train_log_probs.shape)}, "
                         f"{tuple(rollout_log_probs.shape)}, {tuple(loss_mask.shape)}")
    r = train_log_probs.double() - rollout_log_probs.double()  # (N, T)
    weights, kept, metrics = None, loss_mask, {}
    if rc.rollout_is is not None:
        weights, m = is_weights(r, loss_mask, rc.rollout_is, rc.rollout_is_threshold,
                                rc.rollout_is_batch_normalize, reduce)
        weights = weights.to(train_log_probs.dtype)
        metrics.update(m)
    if rc.rollout_rs is not None:
        kept, m = rejection_mask(r, loss_mask, rc.rollout_rs, rc.rollout_rs_threshold)
        metrics.update(m)
    return Corrected(weights, kept, metrics)


@dataclass(frozen=True)
class RolloutCorrection:
    """The run's correction (module docstring): a name of `ROLLOUT_CORRECTIONS` — verl 0.9.1's
    `RolloutCorrectionConfig` presets, or 'none' — and `options`, the arguments of verl's
    classmethod of that name (resolved: every argument, its default unless given). The other
    fields are verl's, derived from the two (`algorithm.rollout_correction.*` under the verl
    backend); `mode` is derived from those."""

    name: str = "none"
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    rollout_is: Optional[str] = field(init=False, default=None)  # None | token | sequence
    rollout_is_threshold: Any = field(init=False, default=2.0)  # C, or 'lower_upper' (IcePop)
    rollout_is_batch_normalize: bool = field(init=False, default=False)
    rollout_rs: Optional[str] = field(init=False, default=None)  # rejection option(s)
    rollout_rs_threshold: Any = field(init=False, default=None)
    bypass_mode: bool = field(init=False, default=False)  # π_old := π_rollout
    loss_type: str = field(init=False, default="ppo_clip")  # bypass: ppo_clip | reinforce
    mode: str = field(init=False, default="none")  # MODES

    def __post_init__(self) -> None:
        if self.name not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"algo.rollout_correction={self.name!r} is not valid; allowed: "
                             f"{', '.join(ROLLOUT_CORRECTIONS)}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"algo.rollout_correction_options must be a mapping, got {self.options!r}")
        try:
            resolved, options = resolve(self.name, self.options)
        except ValueError as e:
            raise ValueError(f"algo.rollout_correction_options.{e}") from None
        object.__setattr__(self, "options", MappingProxyType(options))
        for k, v in resolved.items():
            object.__setattr__(self, k, v)
        acts = self.rollout_is is not None or self.rollout_rs is not None
        object.__setattr__(self, "mode", "bypass" if self.bypass_mode else
                           "decoupled" if acts else "none")

    @property
    def reinforce(self) -> bool:
        """Bypass mode with verl's REINFORCE loss (the loss mode `reinforce`) in place of the
        preset's."""
        return self.mode == "bypass" and self.loss_type == "reinforce"

    @property
    def applies_weights(self) -> bool:
        """Whether IS weights multiply the policy loss (decoupled; bypass REINFORCE)."""
        return self.rollout_is is not None and (self.mode == "decoupled" or self.reinforce)

    @property
    def decoupled(self) -> bool:
        """Decoupled mode (weights or rejection, once per step from π_old)."""
        return self.mode == "decoupled"

    @property
    def batch_normalized_weights(self) -> bool:
        """Whether the loss's weights are divided by a statistic of the whole batch: then a
        batch's loss is not the sum of its parts' (bypass mode computes them in the loss)."""
        return self.mode == "bypass" and self.applies_weights and self.rollout_is_batch_normalize

    @torch.no_grad()
    def apply(self, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
              loss_mask: torch.Tensor, reduce: Reduce = None, *,
              with_metrics: bool = True) -> Corrected:
        """The correction of one batch (N, T): (the IS weights the policy loss applies, or None;
        the kept agent tokens; the `rollout_corr/*` metrics — `sampler_mismatch` of the two
        log-probs, its token IS statistics at `DIAGNOSTIC_IS_THRESHOLD` when the correction has
        no IS weights, and the correction's IS / RS statistics; {} unless `with_metrics`).
        `train_log_probs`: π_old (decoupled, none) or the current π_θ (bypass), detached here;
        `reduce`: a sum over data-parallel ranks for the batch normaliser."""
        lp = train_log_probs.detach()
        acts = self.rollout_is is not None or self.rollout_rs is not None
        c = (rollout_correction(lp, rollout_log_probs, loss_mask, self, reduce) if acts
             else Corrected(None, loss_mask, {}))
        metrics = {}
        if with_metrics:
            threshold = None if self.rollout_is is not None else DIAGNOSTIC_IS_THRESHOLD
            metrics = {**sampler_mismatch(lp, rollout_log_probs, loss_mask, threshold), **c.metrics}
        return Corrected(c.weights if self.applies_weights else None, c.loss_mask, metrics)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.options)}
