"""The baselines in the trainer: every new preset trains two steps on the tiny setup and moves
the policy; TIS and DAPO's dynamic sampling / overlong shaping reach the metrics; run.py finishes
for every new preset (docs/design.md §2)."""

from __future__ import annotations


import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import TINY_OVERRIDES
from stppo import metric_names as K
from stppo.config import to_config
from stppo.tracker import Tracker
from stppo.train.loop import Trainer
from stppo.train.setup import build_components
from test_orchestration import run_py

BASELINES = ["dapo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "bapo", "rloo", "reinforce_pp",
             "dppo_tv", "dppo_kl", "dro", "sspo", "tir_optimal_token_baseline"]


def _two_steps(cfg):
    comps = build_components(cfg, progress=False)
    before = [p.detach().clone() for p in comps.policy.parameters()]
    trainer = Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=None)
    ms = [trainer.train_step(1), trainer.train_step(2)]
    changed = any(not torch.equal(a, b) for a, b in zip(before, comps.policy.parameters()))
    return comps, ms, changed


@pytest.mark.parametrize("algo", BASELINES)
def test_every_baseline_preset_trains_two_steps_and_changes_the_policy(tiny_cfg, algo):
    cfg = to_config(tiny_cfg(f"algo={algo}", "tracking.enabled=false"))
    comps, ms, changed = _two_steps(cfg)
    assert changed, f"{algo}: the policy did not change"
    assert comps.critic is None
    for m in ms:
        for key in (K.PG_LOSS, K.PG_CLIPFRAC, K.PPO_KL, K.RATIO_MEAN, K.CLIP_BIAS_NORM,
                    K.GRAD_NORM, K.SUCCESS_RATE, K.ENTROPY):
            assert key in m and torch.isfinite(torch.tensor(m[key])), (algo, key)
        assert m[K.SKIPPED_STEPS] == 0 and K.VF_LOSS not in m
        assert all(K.known_metric(k) for k in m), [k for k in m if not K.known_metric(k)]
    if algo == "bapo":
        assert 0.6 - 1e-9 <= ms[0][K.BAPO_CLIP_LOW] <= 0.9 + 1e-9
        assert 1.2 - 1e-9 <= ms[0][K.BAPO_CLIP_HIGH] <= 3.0 + 1e-9
    if algo in ("clip_cov", "kl_cov"):
        assert K.COV_SELECTED_FRAC in ms[0]
    if algo in ("dppo_tv", "dppo_kl"):
        assert K.PG_CLIPFRAC_LOWER in ms[0]  # the truncation's share, verl's key
    if algo == "sspo":  # subsentences from the tokenizer's punctuation, inside the turns
        assert 1.0 <= ms[0][K.SSPO_SUBSENTENCE_LENGTH] and K.SSPO_CLIP_SCALE_STD in ms[0]
    if algo == "dapo":
        for m in ms:
            assert m[K.DS_ROLLOUTS] >= 1 and m[K.DS_GROUPS_ROLLED] >= 4
            assert K.OVERLONG_PENALTY_MEAN in m and m[K.OVERLONG_PENALTY_MEAN] <= 0


def test_truncated_is_weights_reach_the_loss_and_the_metrics(tiny_cfg):
    cfg = to_config(tiny_cfg("algo=grpo", "algo.rollout_correction=decoupled_token_is",
                             "tracking.enabled=false"))
    _, ms, changed = _two_steps(cfg)
    assert changed
    for m in ms:  # sampler and trainer compute π_old the same way here: ω ≈ 1
        assert m[K.ROLLOUT_IS_MEAN] == pytest.approx(1.0, abs=0.05)
        assert 0.0 < m[K.ROLLOUT_IS_ESS] <= 1.0 + 1e-6
        assert m[K.ROLLOUT_IS_MAX] <= 2.0


def test_run_py_finishes_for_every_baseline_preset(tmp_path):
    """`python run.py +experiment=quick algo=NAME` for the new presets, one multirun (one
    process, one warm start shared through the cache)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    res = run_py(["-m", f"algo={','.join(BASELINES)}", "+experiment=quick", *TINY_OVERRIDES,
                  "trainer.total_steps=1", f"tracking.uri={uri}",
                  f"trainer.out_dir={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/multirun"],
                 cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("stppo").experiment_id])
    assert sorted(r.data.tags[K.TAG_ALGO] for r in runs) == sorted(BASELINES)
    for r in runs:
        assert r.info.status == "FINISHED", r.data.tags.get("error")
        assert K.PG_LOSS in r.data.metrics and K.VAL_SUCCESS_RATE in r.data.metrics
    (dapo,) = [r for r in runs if r.data.tags[K.TAG_ALGO] == "dapo"]
    assert K.DS_ROLLOUTS in dapo.data.metrics and K.OVERLONG_FRAC in dapo.data.metrics
