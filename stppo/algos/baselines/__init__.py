"""The policy losses people compare against (docs/design.md §2), one module each, in this order: cispo, gmpo,
sapo, clip_cov and kl_cov (cov), bapo, dppo_tv and dppo_kl (dppo), dro, sspo. `stppo.algos.modes`
registers them as loss modes beside the clip path."""

# in the order of the table above: importing registers the loss modes, and the registry lists them so
from stppo.algos.baselines.cispo import cispo_loss  # isort: skip
from stppo.algos.baselines.gmpo import gmpo_loss  # isort: skip
from stppo.algos.baselines.sapo import sapo_gate, sapo_loss  # isort: skip
from stppo.algos.baselines.cov import clip_cov_loss, kl_cov_loss  # isort: skip
from stppo.algos.baselines.bapo import bapo_loss, bapo_schedule, positive_share  # isort: skip
from stppo.algos.baselines.dppo import binary_kl_mask, binary_tv_mask, dppo_kl_loss, dppo_tv_loss  # isort: skip
from stppo.algos.baselines.dro import dro_loss  # isort: skip
from stppo.algos.baselines.sspo import clip_scale, sspo_loss  # isort: skip

__all__ = ["bapo_loss", "bapo_schedule", "binary_kl_mask", "binary_tv_mask", "cispo_loss",
           "clip_cov_loss", "clip_scale", "dppo_kl_loss", "dppo_tv_loss", "dro_loss", "gmpo_loss",
           "kl_cov_loss", "positive_share", "sapo_gate", "sapo_loss", "sspo_loss"]
