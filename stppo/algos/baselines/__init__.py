"""The policy losses people compare against (docs/design.md §2), one module each: cispo, gmpo,
sapo, clip_cov and kl_cov (cov), bapo. `stppo.algos.modes` registers them as loss modes beside
the clip path."""

from stppo.algos.baselines.bapo import bapo_loss, bapo_schedule, positive_share
from stppo.algos.baselines.cispo import cispo_loss
from stppo.algos.baselines.cov import clip_cov_loss, kl_cov_loss
from stppo.algos.baselines.gmpo import gmpo_loss
from stppo.algos.baselines.sapo import sapo_gate, sapo_loss

__all__ = ["bapo_loss", "bapo_schedule", "cispo_loss", "clip_cov_loss", "gmpo_loss", "kl_cov_loss",
           "positive_share", "sapo_gate", "sapo_loss"]
