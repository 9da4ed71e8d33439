"""Collapse from the live policy (stppo.diagnostics, the trainer's live checks): the greedy
success of the weights being trained, on a fixed held-out subset, decides — at lag k as at lag 0
— and the checks change nothing about training."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from stppo import metric_names as K
from stppo.config import to_config
from stppo.tracker import Tracker
from stppo.train import loop
from stppo.train.job import run
from stppo.train.setup import build_components

pytestmark = pytest.mark.timeout(900)


def _history(uri: str, experiment: str) -> dict[str, dict[int, float]]:
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {k: {m.step: m.value for m in client.get_metric_history(r.info.run_id, k)} for k in r.data.metrics}


def test_a_stale_run_collapses_when_its_live_policy_does_not_when_its_sampler_does(tiny_cfg, monkeypatch):
    """lag 3: the policy is broken from the update of step 3 on (its head zeroed: greedy emits
    junk). The rollouts of steps 4–6 still come from the snapshots of steps 0–2 and succeed as
    before, so the rollouts' success would show the break only from step 7; the live checks at
    steps 3 and 4 read 0 and the onset is step 3. The updates of steps 1–2 are undone, so the
    live checks of steps 0–2 read the warm start's one greedy success (no update can make a
    drop of its own), and any peak counts (min_peak 0): the verdict needs only that the warm
    start answers one of the 16 questions."""
    cfg = to_config(tiny_cfg("algo=grpo", "trainer.total_steps=7", "trainer.offpolicy.lag=3",
                             "trainer.collapse.every=1", "trainer.collapse.questions=16",
                             "trainer.collapse.patience=2", "trainer.collapse.min_peak=0.0", "tracking.enabled=false"))
    comps = build_components(cfg, progress=False)
    real, calls = loop.actor_update, []

    def update_then_break(policy, opt, batch, ctx):
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        out = real(policy, opt, batch, ctx)
        calls.append(1)
        with torch.no_grad():
            if len(calls) < 3:  # steps 1–2: the weights stay the warm start's
                policy.load_state_dict(before)
            else:  # after the update of step 3, and every one after it
                policy.lm_head.weight.zero_()
        return out

    monkeypatch.setattr(loop, "actor_update", update_then_break)
    trainer = loop.Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=None)
    live, sampled = {}, {}
    real_check, real_step = trainer._live_check, trainer.train_step

    def check(step):
        out = real_check(step)
        live[step] = out[K.VAL_LIVE_SUCCESS_RATE]
        return out

    def step_and_record(step):
        out = real_step(step)
        sampled[step] = out[K.SUCCESS_RATE]
        return out

    monkeypatch.setattr(trainer, "_live_check", check)
    monkeypatch.setattr(trainer, "train_step", step_and_record)
    trainer.train()
    assert live[0] == live[1] == live[2] > 0.0 and live[3] == live[4] == 0.0
    assert sum(sampled[s] for s in (4, 5, 6)) > 0.0, sampled  # the stale samplers did not break
    assert trainer.detector.collapse_step == 3 and trainer.detector.reason.startswith("live greedy success")
    assert "sampled_collapse" not in trainer.alarms.fired  # the rollouts' rule has not seen it


def test_live_checks_are_logged_and_change_no_training_number(tiny_cfg, tmp_path):
    """A run with live checks every 2 steps logs them at steps 0, 2, 4 with their cost, and
    every training metric of a run without them, bit for bit (greedy checks draw no random
    numbers, and the weights are the same)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    base = ("algo=ppo", "trainer.total_steps=4", "trainer.questions_per_step=4")
    run(tiny_cfg(*base, "trainer.collapse.every=2", "tracking.experiment=with"))
    run(tiny_cfg(*base, "trainer.collapse.every=0", "tracking.experiment=without"))
    a, b = _history(uri, "with"), _history(uri, "without")
    assert sorted(a[K.VAL_LIVE_SUCCESS_RATE]) == [0, 2, 4] and sorted(a[K.LIVE_CHECK_TIME]) == [0, 2, 4]
    assert K.VAL_LIVE_SUCCESS_RATE not in b
    keys = [k for k in b if not k.startswith("perf/")]
    assert K.STEP_KL in keys and K.SUCCESS_RATE in keys
    for k in keys:
        assert a[k] == b[k], k
