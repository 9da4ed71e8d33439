"""Stale rollouts (trainer.offpolicy; docs/design.md §8): the batch of step t is sampled by the
weights that the checkpoint of step t − 1 − lag holds, π_old is the current policy, the lags of
uniform mode are seeded, a lag-0 run is the on-policy run, and a stale run resumes exactly."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import ROOT, THREADS, compose
from numerics import FORWARD_TOL
from stppo import metric_names as K
from stppo.config import OffPolicyConfig, to_config
from stppo.models import policy_log_probs
from stppo.tracker import Tracker
from stppo.train import checkpoint, loop
from stppo.batch import Batch
from stppo.train.offpolicy import PolicyHistory, draw_lags, offpolicy_metrics
from stppo.train.sampler import OnPolicySampler
from stppo.train.setup import build_components
from stppo.train.update import old_log_probs_from_update

pytestmark = pytest.mark.timeout(900)

# The rollout correction of the stale-run test (the check): geometric-mean rejection
CORRECTION = ("algo.rollout_correction=decoupled_geo_rs",)
QUICK = ["+experiment=quick", THREADS, "trainer.progress=false", "algo=ppo",
         "trainer.actor_lr=3e-3"]  # ppo: its critic's advantages move the policy at 0 success


def quick(tmp_path, *extra: str):
    return compose(QUICK + [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                            f"trainer.out_dir={tmp_path}/runs", *extra])


def train_recording(tmp_path, monkeypatch, *extra: str):
    """Train a quick run in-process with a checkpoint every step; returns the initial weights,
    each step's prepared batch and a copy of each step's checkpoint file."""
    cfg = to_config(quick(tmp_path, "trainer.save_every=1", "tracking.enabled=false", *extra))
    comps = build_components(cfg, progress=False)
    batches, saved = {}, {0: copy.deepcopy(comps.policy.state_dict())}
    prepare, save = loop.prepare_batch, checkpoint.save

    def spy_prepare(batch, *args, **kwargs):
        out = prepare(batch, *args, **kwargs)
        batches[len(batches) + 1] = out[0]
        return out

    def keep_every_checkpoint(run_dir, state):
        path = save(run_dir, state)
        shutil.copy(path, tmp_path / f"step{state['step']}.pt")
        return path

    monkeypatch.setattr(loop, "prepare_batch", spy_prepare)
    monkeypatch.setattr(checkpoint, "save", keep_every_checkpoint)
    trainer = loop.Trainer(cfg, comps, Tracker(None, "x", enabled=False), tmp_path / "run")
    trainer.train()
    for step in batches:
        saved[step] = torch.load(tmp_path / f"step{step}.pt", weights_only=False)["policy"]
    return cfg, comps, batches, saved




def forward(comps, state: dict, batch) -> torch.Tensor:
    """log π of the batch's agent tokens under `state`, by the trainer's forward."""
    model = copy.deepcopy(comps.policy).eval()
    model.load_state_dict(state)
    with torch.no_grad(), comps.precision.autocast():
        return policy_log_probs(model, batch.input_ids, batch.attention_mask, positions=batch.loss_mask)


def rollout_again(cfg, comps, state: dict, step: int, age: int, rows: torch.Tensor):
    """The rows `rows` of step `step` rolled out anew by a model holding `state`, from the
    generator the trainer gives rows of that age (seed, step, age: offpolicy.py)."""
    from stppo.rollout import rollout

    model = copy.deepcopy(comps.policy)
    model.load_state_dict(state)
    qs = loop.sample_questions(comps.task.split("train"), cfg.trainer.questions_per_step, cfg.seed, step)
    qs = [q for q in qs for _ in range(cfg.trainer.group_size)]
    gen = torch.Generator().manual_seed(loop.step_seed(cfg.seed, step, "rollout" if age == 0 else f"rollout-age{age}"))
    with comps.precision.autocast():
        return rollout(model, comps.tokenizer, comps.env, [qs[i] for i in torch.nonzero(rows).flatten().tolist()],
                       loop.rollout_config(cfg), generator=gen)


@pytest.mark.parametrize("mode", ["fixed", "uniform"])
def test_the_sampler_of_step_t_is_the_checkpoint_of_step_t_minus_1_minus_lag(tmp_path, monkeypatch, mode):
    steps, lag = 4, 2
    cfg, comps, batches, saved = train_recording(
        tmp_path, monkeypatch, f"trainer.total_steps={steps}", f"trainer.offpolicy.lag={lag}",
        f"trainer.offpolicy.lag_mode={mode}")
    assert sorted(batches) == list(range(1, steps + 1))
    ages_seen = set()
    for t, b in batches.items():
        m = b.loss_mask
        for age in b.rollout_lags.unique().tolist():
            rows = b.rollout_lags == age
            sel = m & rows[:, None]
            assert 0 <= age <= min(lag, t - 1) and (mode == "uniform" or age == min(lag, t - 1))
            ages_seen.add(age)
            # the checkpoint's weights, rolled out from the step's generator of that age, sample
            # these rows: the same ids, and the same sampling log-probs up to FORWARD_TOL …
            again = rollout_again(cfg, comps, saved[t - 1 - age], t, age, rows)
            n = again.input_ids.shape[1]
            assert torch.equal(b.input_ids[rows][:, :n], again.input_ids)
            torch.testing.assert_close(b.rollout_log_probs[rows][:, :n], again.rollout_log_probs,
                                       rtol=FORWARD_TOL, atol=FORWARD_TOL)
            assert not b.attention_mask[rows][:, n:].any()
            # … and the trainer's forward with those weights gives them (the rollout engine and
            # the forward round differently: docs/design.md §1)
            sampler = forward(comps, saved[t - 1 - age], b)
            torch.testing.assert_close(b.rollout_log_probs[sel], sampler[sel], rtol=FORWARD_TOL, atol=FORWARD_TOL)
            if age > 0:  # … the stale forward is the trainer's with those weights (over the rows of
                # that age alone: a narrower batch) …
                torch.testing.assert_close(b.stale_log_probs[sel], sampler[sel], rtol=FORWARD_TOL, atol=FORWARD_TOL)
                current = forward(comps, saved[t - 1], b)  # … and not the current policy's
                assert float((current[sel] - b.rollout_log_probs[sel]).abs().max()) > 100 * FORWARD_TOL
            else:
                assert not b.stale_log_probs[sel].any()
        # π_old: the current weights (before the step's update), recomputed by the trainer
        torch.testing.assert_close(b.old_log_probs[m], forward(comps, saved[t - 1], b)[m], rtol=FORWARD_TOL,
                                   atol=FORWARD_TOL)
        for g in b.group_ids.unique():  # a group shares its sampler
            assert b.rollout_lags[b.group_ids == g].unique().numel() == 1
    assert ages_seen == set(range(lag + 1)) if mode == "fixed" else len(ages_seen) >= 3


def test_uniform_lags_are_in_range_vary_across_groups_and_follow_the_seed():
    cfg = OffPolicyConfig(lag=4, lag_mode="uniform")
    a = draw_lags(cfg, 64, seed=loop.step_seed(0, 3, "lags"))
    assert set(a) == set(range(5))  # every lag 0..4 occurs among 64 groups, nothing else
    assert a == draw_lags(cfg, 64, seed=loop.step_seed(0, 3, "lags"))
    assert a != draw_lags(cfg, 64, seed=loop.step_seed(0, 4, "lags"))
    assert a != draw_lags(cfg, 64, seed=loop.step_seed(1, 3, "lags"))
    assert draw_lags(OffPolicyConfig(lag=4), 5, seed=7) == [4] * 5


def test_offpolicy_metrics_by_hand_and_over_the_sampled_tokens():
    """lag_mean over groups, lag_max, and kl_to_current = mean over agent tokens of k3 =
    e^r − 1 − r, r = log π_old − log π_stale (rows of age 0 count 0) — over the tokens as sampled: a decoupled
    correction that rejected every token of the prepared batch leaves the distance as it was."""
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    old = torch.full((4, 4), -1.0)
    stale = torch.tensor([[0, -0.5, -0.7, 0], [0, -0.9, -1.0, -0.8], [0, 0, 0, 0], [0, 0, 0, 0]])
    b = Batch(input_ids=torch.zeros(4, 4, dtype=torch.long), attention_mask=torch.ones(4, 4, dtype=torch.bool),
              loss_mask=mask, turn_ids=torch.zeros(4, 4, dtype=torch.long), group_ids=torch.tensor([0, 0, 1, 1]),
              scores=torch.zeros(4), old_log_probs=old, stale_log_probs=stale,
              rollout_lags=torch.tensor([3, 3, 0, 0]))
    m = offpolicy_metrics(b)
    k3 = lambda r: math.exp(r) - 1 - r  # noqa: E731  r = log π_live − log π_stale
    kl = (k3(-1 + 0.5) + k3(-1 + 0.7) + k3(-1 + 0.9) + k3(-1 + 1.0) + k3(-1 + 0.8)) / 8  # 8 agent tokens
    assert (m[K.OFFPOLICY_LAG_MEAN], m[K.OFFPOLICY_LAG_MAX]) == (1.5, 3.0)
    assert m[K.OFFPOLICY_KL_TO_CURRENT] == pytest.approx(kl, rel=1e-6)
    rejected = replace(b, loss_mask=torch.zeros_like(mask))
    assert offpolicy_metrics(rejected, agent_mask=mask) == m


def test_the_live_policy_is_pi_old_or_in_bypass_mode_its_own_forward():
    """kl_to_current measures against θ_{t−1}: the recomputed π_old, or — in bypass mode, where
    π_old is the sampler's — a forward of the live policy."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stppo.models import Precision
    from stppo.train.offpolicy import live_log_probs

    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(Qwen2Config(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)).train()
    ids = torch.randint(0, 30, (3, 7))
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[:, 3:] = True
    b = Batch(input_ids=ids, attention_mask=torch.ones(3, 7, dtype=torch.bool), loss_mask=mask,
              turn_ids=torch.where(mask, 0, -1), group_ids=torch.zeros(3, dtype=torch.long), scores=torch.zeros(3),
              old_log_probs=torch.full((3, 7), -9.0))  # bypass: the sampler's
    assert live_log_probs(b, policy, False, Precision(), 2) is b.old_log_probs
    got = live_log_probs(b, policy, True, Precision(), 2)
    assert policy.training  # its mode restored
    with torch.no_grad():
        want = policy_log_probs(policy.eval(), ids, b.attention_mask, positions=mask)
    torch.testing.assert_close(got[mask], want[mask])


def test_the_history_keeps_what_later_steps_read_and_restarts_at_a_rollback():
    policy = torch.nn.Linear(2, 2)
    h = PolicyHistory(lag=2)
    for step in range(1, 6):
        assert [h.source(step, lag) for lag in (0, 1, 2)] == [step - 1, max(0, step - 2), max(0, step - 3)]
        h.record(step, policy)  # θ_{step-1}, before the update
        with torch.no_grad():
            policy.weight += 1.0
        assert sorted(h.snapshots) == [s for s in (step - 2, step - 1) if s >= 0]
    assert float(h.snapshots[4]["weight"][0, 0] - h.snapshots[3]["weight"][0, 0]) == pytest.approx(1.0)
    h.restart(5)  # a rollback at step 5: every lag of step 6 reads the rolled-back weights
    assert [h.source(6, lag) for lag in (0, 1, 2)] == [5, 5, 5] and not h.snapshots
    h.record(6, policy)
    assert sorted(h.snapshots) == [5]


def test_lag_zero_is_the_on_policy_run(tmp_path):
    base = to_config(quick(tmp_path))
    zero = to_config(quick(tmp_path, "trainer.offpolicy.lag=0", "trainer.offpolicy.lag_mode=uniform"))
    stale = to_config(quick(tmp_path, "trainer.offpolicy.lag=1"))
    assert loop.run_dir_for(base) == loop.run_dir_for(to_config(quick(tmp_path, "trainer.offpolicy.lag=0")))
    assert loop.run_dir_for(stale) != loop.run_dir_for(base)  # a stale run keeps its own checkpoints
    one_minibatch = ("trainer.ppo_epochs=1", "trainer.minibatch_size=16", "algo=grpo")
    assert old_log_probs_from_update(to_config(quick(tmp_path, *one_minibatch)))
    assert not old_log_probs_from_update(to_config(quick(tmp_path, *one_minibatch, "trainer.offpolicy.lag=1")))
    comps = build_components(zero, progress=False)
    trainer = loop.Trainer(zero, comps, Tracker(None, "x", enabled=False), run_dir=None)
    assert type(trainer.sampler) is OnPolicySampler and "offpolicy" not in trainer.state_dict()
    m = trainer.train_step(1)
    assert not any(k.startswith("offpolicy/") for k in m)


@pytest.mark.parametrize("override, message", [
    ("trainer.offpolicy.lag=-1", "trainer.offpolicy.lag must be an integer >= 0, got -1"),
    ("trainer.offpolicy.lag_mode=random", "trainer.offpolicy.lag_mode='random' is not valid; allowed: fixed, uniform"),
])
def test_invalid_offpolicy_settings_are_one_line(tmp_path, override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        to_config(quick(tmp_path, override))


def test_the_static_engines_bfloat16_copy_samples_with_the_snapshot(tmp_path):
    """Under bfloat16 autocast the static path decodes with a bfloat16 copy of the behaviour
    policy (stppo.rollout.weights): loading a snapshot refreshes it."""
    from stppo.rollout.weights import sampler_model

    cfg = to_config(quick(tmp_path, "tracking.enabled=false", "trainer.rollout.engine=static",
                          "model.dtype=bfloat16", "trainer.offpolicy.lag=1", "trainer.warmstart.enabled=false",
                          "trainer.questions_per_step=4", "trainer.minibatch_size=8"))
    comps = build_components(cfg, progress=False)
    trainer = loop.Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=None)
    trainer.train_step(1)
    snapshot = trainer.sampler.history.snapshots[0]  # θ_0, which samples step 2 at lag 1
    trainer.train_step(2)
    assert trainer.sampler.held == 0
    with comps.precision.autocast():
        copy16 = sampler_model(trainer.sampler.behaviour)
    assert copy16 is not trainer.sampler.behaviour
    for name, p in copy16.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, snapshot[name].to(torch.bfloat16)), name
    assert any(not torch.equal(p, snapshot[n]) for n, p in comps.policy.named_parameters())


def _history(uri, experiment):
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run, {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
                 for k in run.data.metrics}


def test_a_stale_run_with_a_correction_logs_lag_and_mismatch_and_resumes_after_sigkill(tmp_path):
    steps, lag = 6, 4
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = [f"trainer.total_steps={steps}", "trainer.save_every=1", f"trainer.offpolicy.lag={lag}", *CORRECTION]
    from stppo.train.job import run

    run(quick(tmp_path, *common, "tracking.experiment=uninterrupted"))
    args = [sys.executable, str(ROOT / "run.py"), *QUICK, *common, f"tracking.uri={uri}",
            f"trainer.out_dir={tmp_path}/runs", "tracking.experiment=killed", f"hydra.run.dir={tmp_path}/hydra"]
    # SIGKILL inside step 4, after step 3's checkpoint and before step 4 logs anything (tests/kill_point)
    env = dict(os.environ, OMP_NUM_THREADS="1", STPPO_TEST_KILL="before:4", PYTHONPATH=str(ROOT / "tests" / "kill_point"))
    proc = subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=900)  # a hang guard: the run takes about a minute
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed in step 4: {proc.stderr[-2000:]}"
    (ckpt,) = (tmp_path / "runs" / "killed").glob("*/checkpoint.pt")
    state = checkpoint.load(ckpt.parent)
    assert state["step"] == 3 and sorted(state["offpolicy"]["snapshots"]) == list(range(3))[-lag:]

    run(quick(tmp_path, *common, "tracking.experiment=killed", "trainer.resume=true"))
    ref_run, ref = _history(uri, "uninterrupted")
    res_run, res = _history(uri, "killed")
    assert res_run.info.status == "FINISHED" and set(ref) == set(res)
    for key, hist in ref.items():
        assert [s for s, _ in res[key]] == [s for s, _ in hist], key  # no step missing or twice
        if not key.startswith("perf/"):
            assert res[key] == hist, key  # bit for bit
    assert [v for _, v in ref[K.OFFPOLICY_LAG_MEAN]] == [0, 1, 2, 3, 4, 4]
    assert [v for _, v in ref[K.OFFPOLICY_LAG_MAX]] == [0, 1, 2, 3, 4, 4]
    kl = [v for _, v in ref[K.OFFPOLICY_KL_TO_CURRENT]]
    assert kl[0] == 0.0 and all(v != 0 for v in kl[1:]) and sum(kl) > 0  # KL(π_stale ‖ π_old) > 0
    for key in (K.ROLLOUT_CORR_KL, K.ROLLOUT_CORR_K3_KL, K.ROLLOUT_IS_MEAN):
        assert [s for s, _ in ref[key]] == list(range(1, steps + 1)), key
    assert ref_run.data.params["trainer.offpolicy.lag"] == str(lag)
    assert ref_run.data.params["derived.old_log_prob_pass"] == "computed"
