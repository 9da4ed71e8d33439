"""The step diagnostics (docs/design.md §4): per-turn breakdown, groups without signal, sampler vs
trainer log-probs, sampled trajectories as MLflow tables; and trainer.on_alarm (stop, rollback)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from numerics import FORWARD_TOL
from stppo import metric_names as K
from stppo.algos import group_signal_fractions, sampler_mismatch, turn_breakdown
from stppo.config import to_config
from stppo.tracker import Tracker
from stppo.train.job import run
from stppo.train.loop import Trainer
from stppo.train.samples import SampleRecorder, segments
from stppo.train.setup import build_components


def test_turn_breakdown_hand_computed():
    # one row: turn 0 = tokens 1-2, observation 3, turn 1 = token 4; row 2: turn 0 = token 1
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    turns = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, -1, -1, -1]])
    ratio = torch.tensor([[9.0, 1.0, 1.5, 9.0, 0.5], [9.0, 2.0, 9.0, 9.0, 9.0]])
    lp = torch.tensor([[0.0, -1.0, -1.0, 0.0, -2.0], [0.0, -1.0, 0.0, 0.0, 0.0]])
    old = torch.tensor([[float("nan"), -1.5, -0.5, 7.0, -2.0], [0.0, -2.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([[5.0, 1.0, 3.0, 5.0, -4.0], [0.0, 2.0, 0.0, 0.0, 0.0]])
    ent = torch.tensor([[0.0, 0.2, 0.4, 0.0, 0.6], [0.0, 0.3, 0.0, 0.0, 0.0]])
    clipped = torch.tensor([[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]], dtype=torch.bool)
    roll = torch.tensor([[float("inf"), -1.0, -1.0, 0.0, -1.5], [0.0, -2.5, 0.0, 0.0, 0.0]])
    without = turn_breakdown(ratio, lp, old, adv, ent, clipped, mask, turns, max_turns=3)
    m = turn_breakdown(ratio, lp, old, adv, ent, clipped, mask, turns, max_turns=3,
                       rollout_log_probs=roll)
    v = {k: float(x) for k, x in m.items()}
    assert set(v) == {K.turn_key(k, n) for k in (0, 1) for n in K.TURN_METRICS}  # no turn 2
    assert set(without) == set(m) - {K.turn_key(k, "rollout_kl") for k in (0, 1)}
    assert v["turn/k0/rollout_kl"] == pytest.approx((0.5 - 0.5 - 0.5) / 3)  # mean of roll − old
    assert v["turn/k1/rollout_kl"] == pytest.approx(0.5)
    assert v["turn/k0/pg_clipfrac"] == pytest.approx(2 / 3)
    assert v["turn/k0/ratio_mean"] == pytest.approx(4.5 / 3) and v["turn/k0/ratio_max"] == 2.0
    assert v["turn/k0/adv_mean"] == pytest.approx(2.0)
    assert v["turn/k0/ppo_kl"] == pytest.approx(-(0.5 - 0.5 + 1.0) / 3)  # mean of -(lp - old)
    assert v["turn/k0/entropy"] == pytest.approx(0.3) and v["turn/k0/tokens"] == 1.5
    assert v["turn/k1/ratio_max"] == 0.5 and v["turn/k1/adv_mean"] == -4.0
    assert v["turn/k1/tokens"] == 0.5 and v["turn/k1/ppo_kl"] == 0.0


def test_group_signal_fractions():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    f = group_signal_fractions(scores, groups)
    assert f == {K.ZERO_STD_GROUP_FRAC: 0.75, K.ALL_ZERO_GROUP_FRAC: 0.25, K.ALL_ONE_GROUP_FRAC: 0.25}


def test_sampler_mismatch_hand_computed_and_mask_invariant():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    roll = torch.tensor([[0.0, -1.5, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    r = torch.tensor([0.5, 0.0, -0.5])  # old - rollout on agent tokens
    m = sampler_mismatch(old, roll, mask, threshold=2.0)
    assert float(m[K.ROLLOUT_CORR_KL]) == pytest.approx(float(-r.mean()))
    assert float(m[K.ROLLOUT_CORR_K3_KL]) == pytest.approx(float((r.exp() - r - 1).mean()))
    assert float(m[K.ROLLOUT_CORR_LOG_PPL_DIFF]) == pytest.approx((-0.25 + 0.5) / 2)
    assert float(m[K.ROLLOUT_CORR_ABS_DIFF_MAX]) == pytest.approx(0.5)
    assert float(m[K.ROLLOUT_CORR_ABS_DIFF_MEAN]) == pytest.approx(1 / 3)
    assert float(m[K.ROLLOUT_IS_MAX]) == pytest.approx(math.exp(0.5))
    # verl's perplexities: per-row means of the log-probs, then the mean over rows
    assert float(m[K.ROLLOUT_CORR_TRAINING_LOG_PPL]) == pytest.approx((1.5 + 1.0) / 2)
    assert float(m[K.ROLLOUT_CORR_ROLLOUT_PPL]) == pytest.approx((math.exp(1.75) + math.exp(0.5)) / 2)
    assert float(m[K.ROLLOUT_CORR_LOG_PPL_DIFF_MAX]) == pytest.approx(0.5)
    assert float(m[K.ROLLOUT_CORR_LOG_PPL_DIFF_MIN]) == pytest.approx(-0.25)
    assert float(m[K.ROLLOUT_CORR_CHI2_TOKEN]) == pytest.approx(float((2 * r).exp().mean() - 1))
    assert float(m[K.ROLLOUT_CORR_CHI2_SEQ]) == pytest.approx((math.exp(1.0) + math.exp(-1.0)) / 2 - 1)
    garbage = torch.where(mask, old, torch.tensor(float("nan")))
    m2 = sampler_mismatch(garbage, torch.where(mask, roll, torch.tensor(float("inf"))), mask, 2.0)
    assert set(m2) == set(m) and all(torch.equal(m[k], m2[k]) for k in m)
    assert K.ROLLOUT_IS_MEAN not in sampler_mismatch(old, roll, mask)  # no threshold: no IS stats


def test_segments_of_a_trajectory():
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    turns = torch.tensor([-1, -1, 0, 0, -1, -1, 1, -1, -1])
    assert segments(mask, turns, 7) == [("prompt", -1, 0, 2), ("agent", 0, 2, 4),
                                        ("observation", -1, 4, 6), ("agent", 1, 6, 7)]


def _table(step: int) -> pd.DataFrame:
    return pd.DataFrame([dict.fromkeys(K.SAMPLE_COLUMNS, 0) | {"step": step, "collapse_step": -1}])


def test_sample_recorder_writes_the_steps_around_the_collapse():
    rec = SampleRecorder(every=10, count=2, keep=5, tokenizer=None, questions={})
    for step in range(1, 13):
        rec.recent.append((step, _table(step)))
        due = rec.due(step, collapse_step=8 if step >= 12 else None, detected_now=step == 12)
        if step == 10:
            assert [s for s, _ in due] == [10]
        elif step == 12:  # detected at 12 (onset 8): the kept tables of 8..12, 10 not again
            assert [s for s, _ in due] == [8, 9, 11, 12]
            assert all(int(t["collapse_step"].iloc[0]) == 8 for _, t in due)
        else:
            assert due == []
    assert rec.written == [10, 8, 9, 11, 12]


def test_quick_run_logs_every_diagnostic_and_readable_samples(tiny_cfg, tmp_path):
    """Per-turn keys, groups without signal, sampler-vs-trainer mismatch (fp32 CPU: the KV-cached
    sampler and the trainer's forward agree to float noise) and sample tables analysis can read."""
    from analysis.samples import load_samples, saved_steps

    run(tiny_cfg("algo=grpo", "diagnostics.samples_every=1", "diagnostics.samples_count=3"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("stppo").experiment_id])
    keys = set(r.data.metrics)
    assert {K.turn_key(0, n) for n in K.TURN_METRICS} <= keys
    assert {K.ZERO_STD_GROUP_FRAC, K.ALL_ZERO_GROUP_FRAC, K.ALL_ONE_GROUP_FRAC} <= keys
    for k in (K.ROLLOUT_CORR_KL, K.ROLLOUT_CORR_K3_KL, K.ROLLOUT_IS_ESS, K.ROLLOUT_CORR_ABS_DIFF_MAX):
        assert k in keys
    assert r.data.metrics[K.ROLLOUT_CORR_ABS_DIFF_MAX] < 1e-3
    assert all(K.known_metric(k) for k in keys)
    assert saved_steps(uri, r.info.run_id) == [1, 2] and r.data.tags[K.TAG_SAMPLES_STEPS] == "1,2"
    table = load_samples(uri, r.info.run_id, 2)
    assert sorted(table["sample"].unique()) == [0, 1, 2]
    agent = table[table["role"] == "agent"]
    assert set(agent["action"]) <= {"search", "answer", "invalid"} and len(agent) > 0
    assert agent["ratio_mean"].notna().all() and table["question"].str.len().min() > 0
    assert (table[table["role"] == "prompt"]["turn"] == -1).all()


@pytest.mark.parametrize("name,options,option", [
    ("decoupled_seq_is_rs", ["algo.rollout_correction_options.is_threshold=1.5"], "seq_sum_k1"),
    ("bypass_pg_geo_rs_token_tis", [], "seq_mean_k1")])
def test_a_quick_run_with_a_rollout_correction_logs_its_metrics(tiny_cfg, tmp_path, name, options,
                                                                option):
    """A run with `algo.rollout_correction=NAME` trains and logs the correction's statistics
    (its IS weights' and rejection's, verl's names), the off-policy diagnostics and the per-turn
    sampler KL every step; its params record the correction's arguments that ran."""
    cfg = tiny_cfg("algo=grpo", f"algo.rollout_correction={name}", *options)
    run(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("stppo").experiment_id])
    keys = set(r.data.metrics)
    wanted = {K.ROLLOUT_IS_MEAN, K.ROLLOUT_IS_SEQ_MEAN, K.ROLLOUT_IS_STD, K.ROLLOUT_IS_ESS,
              K.ROLLOUT_RS_MASKED_FRACTION, K.ROLLOUT_RS_SEQ_MASKED_FRACTION,
              K.rollout_rs_key(option, "mean"), K.rollout_rs_key(option, "seq_masked_fraction"),
              K.ROLLOUT_CORR_KL, K.ROLLOUT_CORR_TRAINING_PPL, K.ROLLOUT_CORR_CHI2_SEQ,
              K.turn_key(0, "rollout_kl"), K.PG_LOSS}
    assert wanted <= keys, wanted - keys
    assert all(K.known_metric(k) for k in keys)
    for k in (K.ROLLOUT_IS_MEAN, K.ROLLOUT_RS_MASKED_FRACTION):
        assert len(client.get_metric_history(r.info.run_id, k)) == 2  # every step
    p = r.data.params
    if name.startswith("decoupled"):  # fp32 on a CPU: π_old is the sampler's to float noise
        assert r.data.metrics[K.ROLLOUT_RS_MASKED_FRACTION] == 0.0
        # a sequence weight is e^(Σ r) over the row's agent tokens, each |r| ≤ FORWARD_TOL
        most = cfg.task.max_turns * cfg.trainer.rollout.max_new_tokens
        assert r.data.metrics[K.ROLLOUT_IS_MEAN] == pytest.approx(1.0, abs=2 * most * FORWARD_TOL)
    else:  # bypass: π_θ against π_rollout, which the minibatch updates move past the ±0.1% band
        assert 0.0 <= r.data.metrics[K.ROLLOUT_RS_MASKED_FRACTION] <= 1.0
    assert p["algo.rollout_correction"] == name
    assert p["derived.old_log_prob_pass"] == ("sampler" if name.startswith("bypass") else "computed")
    if name == "decoupled_seq_is_rs":
        assert (p["algo.rollout_correction_options.is_threshold"],
                p["algo.rollout_correction_options.rs_threshold"]) == ("1.5", "0.5_2.0")
    else:
        assert p["algo.rollout_correction_options.rs_threshold"] == "0.999_1.001"


def _trainer(tiny_cfg, run_dir, *extra):
    cfg = to_config(tiny_cfg("algo=grpo", "tracking.enabled=false", *extra))
    comps = build_components(cfg, progress=False)
    return Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=run_dir), comps


def test_rollback_restores_the_checkpoint_weights_exactly(tiny_cfg, tmp_path):
    trainer, c = _trainer(tiny_cfg, tmp_path / "run", "trainer.on_alarm=rollback", "trainer.save_every=1",
                          "trainer.rollback_lr_factor=0.25", "trainer.actor_lr=3e-3")
    trainer.step = 1
    trainer.train_step(1)
    trainer._save()
    saved = {k: v.clone() for k, v in c.policy.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in trainer.actor_opt.state_dict()["state"][0].items()}
    trainer.train_step(2)
    assert any(not torch.equal(saved[k], v) for k, v in c.policy.state_dict().items())
    trainer.alarms.update = lambda step, metrics: ["grad_norm_spike"]  # an alarm at this step
    metrics: dict = {}
    trainer._on_alarms(2, metrics)
    for k, v in c.policy.state_dict().items():
        assert torch.equal(saved[k], v), k
    for k, v in trainer.actor_opt.state_dict()["state"][0].items():
        assert torch.equal(saved_opt[k], v), k
    assert trainer.actor_opt.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)
    assert metrics[K.alarm_key("grad_norm_spike")] == 1.0 and metrics[K.COLLAPSE_ROLLBACKS] == 1.0


def _alarm_run(tiny_cfg, on_alarm: str, tmp_path):
    run(tiny_cfg("algo=grpo", f"trainer.on_alarm={on_alarm}", "trainer.total_steps=5",
                 "trainer.save_every=2", "trainer.alarm.indicators=[response_length]",
                 "trainer.alarm.threshold=1e-9", "trainer.alarm.persist=1",
                 "trainer.alarm.baseline_steps=3", "diagnostics.samples_every=0",
                 f"tracking.experiment={on_alarm}"))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name(on_alarm).experiment_id])
    hist = {k: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k))
            for k in r.data.metrics}
    return r, hist


def test_on_alarm_rollback_and_stop_end_to_end(tiny_cfg, tmp_path):
    """An alarm that fires at the first step after its baseline (a threshold of 1e-9): rollback
    logs it and goes on to the last step; stop ends the run there, after a last validation."""
    r, hist = _alarm_run(tiny_cfg, "rollback", tmp_path)
    assert hist[K.alarm_key("response_length")][0][0] == 4
    rollbacks = dict(hist[K.COLLAPSE_ROLLBACKS])
    assert rollbacks[3] == 0.0 and rollbacks[4] == 1.0 and rollbacks[5] >= 1.0  # re-armed at 5
    assert [s for s, _ in hist[K.PG_LOSS]] == [1, 2, 3, 4, 5]
    r, hist = _alarm_run(tiny_cfg, "stop", tmp_path)
    assert [s for s, _ in hist[K.PG_LOSS]] == [1, 2, 3, 4]
    assert r.data.tags["stopped"] == "alarm response_length at step 4"
    assert hist[K.VAL_SUCCESS_RATE][-1][0] == 4 and r.info.status == "FINISHED"
