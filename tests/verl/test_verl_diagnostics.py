"""stppo's sampler-vs-trainer diagnostics equal verl's own `compute_offpolicy_metrics` and token
`rollout_is` statistics on the same tensors (the `rollout_corr/*` names are verl's)."""

from __future__ import annotations

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import sampler_mismatch


def test_sampler_mismatch_equals_verls_offpolicy_metrics():
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    g = torch.Generator().manual_seed(0)
    n, t = 6, 40
    mask = torch.rand(n, t, generator=g) < 0.6
    mask[3] = False  # an empty row: verl asserts a valid token somewhere, not in every row
    mask[3, 5] = True
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 4
    roll = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ours = {k: float(v) for k, v in sampler_mismatch(old, roll, mask).items()}
    theirs = compute_offpolicy_metrics(old, roll, mask.to(old.dtype))
    assert ours[K.ROLLOUT_CORR_KL] == pytest.approx(theirs["kl"], abs=1e-6)
    assert ours[K.ROLLOUT_CORR_K3_KL] == pytest.approx(theirs["k3_kl"], abs=1e-6)
    assert ours[K.ROLLOUT_CORR_LOG_PPL_DIFF] == pytest.approx(theirs["log_ppl_diff"], abs=1e-6)
