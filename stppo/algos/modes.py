"""The built-in loss modes behind `policy_loss` (docs/design.md §2), in one registry, `LOSS_MODES`.

clip (the clipped surrogate of `stppo.algos.loss`: every ratio level, the clip-bias scales), and
the losses people compare against, one module each in `stppo.algos.baselines`: cispo, gmpo, sapo,
clip_cov and kl_cov, bapo, dppo_tv and dppo_kl, dro, sspo; and `reinforce`, verl's bypass-mode
REINFORCE loss (`stppo.algos.rollout_corr.reinforce`), which a bypass rollout correction with
loss_type 'reinforce' runs in place of the clip path. Each is registered by the decorator a
researcher's stabiliser uses (`stppo.algos.contract.loss_mode`), with the same contract
`fn(x: LossInputs, spec) -> (loss, metrics[, κ])`; importing this module registers them all.
Rollout IS weights ω (the rollout correction's, `stppo.algos.rollout_corr`; ω ≥ 0) multiply every
mode's per-token loss, as verl's. Unknown names list the valid ones.
"""

from __future__ import annotations

from stppo.algos import loss  # noqa: F401  (registers clip first)  # isort: skip
from stppo.algos import baselines  # noqa: F401  (then the baselines, in their order)  # isort: skip
from stppo.algos.rollout_corr import reinforce  # noqa: F401  (then bypass REINFORCE)  # isort: skip
from stppo.algos.contract import LOSS_MODES, LossInputs, LossMode, loss_mode, resolve_options

__all__ = ["LOSS_MODES", "LossInputs", "LossMode", "loss_mode", "resolve_options"]
