"""Optuna clip-range studies: a trial's state from its MLflow run (COMPLETE / PRUNED on collapse /
FAIL), resuming a study whose sweep process was killed, and pruning a collapsing trial end to end
(its job launched through submitit_local)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import optuna
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from optuna.trial import TrialState

from analysis.sweeps import trials_frame
from conftest import ROOT, TINY_OVERRIDES
from stppo import metric_names as K
from stppo.tracker import Tracker
from stppo.mlflow_store import process_token
from sweeps import study as S
from test_orchestration import run_py, warm_cache  # noqa: F401 - fixture
from test_tracking import fresh_sqlite

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _log_run(uri: str, experiment: str, study: str, number: int, val: dict[int, float], collapsed: bool,
             buffer_dir) -> str:
    """A finished trial's MLflow run, as the trainer leaves it."""
    tr = Tracker(uri, experiment, buffer_dir=buffer_dir)
    run_id = tr.start(tags={K.TAG_STUDY: study, K.TAG_TRIAL: number}, params={})
    for step, v in val.items():
        tr.log(step, {K.VAL_SUCCESS_RATE: v})
        if step:
            tr.log(step, {K.COLLAPSE_DETECTED: float(collapsed and step == max(val))})
    if collapsed:
        tr.log(max(val), {K.COLLAPSE_STEP: float(max(val))})
    tr.finish()
    return run_id


def test_outcomes_from_mlflow_runs_reach_the_dashboard(tmp_path):
    uri = fresh_sqlite(tmp_path)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="clip_range-ppo", storage=storage, direction="maximize")
    tracking = OmegaConf.create({"uri": uri, "experiment": "clip_range-ppo", "enabled": True})
    cases = [(0.6, None, {0: 0.5, 4: 0.7}, False), (0.3, None, {0: 0.5, 2: 0.1}, True),
             (None, FileNotFoundError("data.parquet: no such file"), {}, False)]
    runs = []
    for n, (value, error, val, collapsed) in enumerate(cases):
        trial = study.ask({"algo.clip_low": optuna.distributions.FloatDistribution(0.05, 0.4)})
        runs.append(_log_run(uri, study.study_name, study.study_name, n, val, collapsed, tmp_path / "b")
                    if val else "")
        S.tell(study, trial, S.outcome(value, error, tracking, study.study_name, n))
    done, pruned, failed = study.trials
    assert (done.state, done.value, done.intermediate_values) == (TrialState.COMPLETE, 0.6, {0: 0.5, 4: 0.7})
    assert pruned.state == TrialState.PRUNED and pruned.value == 0.1  # the last reported value
    assert pruned.user_attrs["collapse_step"] == 2
    assert failed.state == TrialState.FAIL and "no such file" in failed.user_attrs["error"]
    frame = trials_frame(storage, "clip_range-ppo")  # what the dashboard's Sweeps page reads
    assert frame["state"].tolist() == ["COMPLETE", "PRUNED", "FAIL"]
    assert frame["pruned"].tolist() == [False, True, False]
    assert frame["mlflow_run_id"].tolist() == runs and "param:algo.clip_low" in frame


def test_resume_fails_orphaned_trials_requeues_them_and_counts_the_rest(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/optuna.db", direction="maximize")
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    child = subprocess.Popen(["sleep", "60"])
    dead = process_token(child.pid)
    child.kill()
    child.wait()
    study.tell(study.ask(dist), 0.5)
    orphan = study.ask(dist)
    orphan.set_user_attr(S.OWNER_ATTR, dead)  # its sweep process was killed
    live = study.ask(dist)
    S.claim(live)  # a sweep still running (this process): left alone
    assert S.resume(study, n_trials=4) == 3  # done: trial 0 only
    states = {t.number: t.state for t in study.trials}
    assert states[orphan.number] == TrialState.FAIL and states[live.number] == TrialState.RUNNING
    retry = study.ask()
    assert retry.suggest_float("x", 0, 1) == orphan.params["x"]  # the enqueued parameters
    assert retry.user_attrs[S.RETRY_ATTR] == orphan.number


def _sweep_args(tmp_path, uri, extra=()):
    return ["-m", "+sweep=clip_range", *TINY_OVERRIDES, f"tracking.uri={uri}",
            f"trainer.out_dir={tmp_path}/runs", f"hydra.sweeper.storage=sqlite:///{tmp_path}/optuna.db",
            f"hydra.sweep.dir={tmp_path}/m", *extra]


def _trials(tmp_path, name):
    try:
        return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db").trials
    except KeyError:  # not created yet
        return []


def _mlflow_trial_runs(uri: str, experiment: str = "clip_range-grpo") -> dict:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return {r.data.tags[K.TAG_TRIAL]: r for r in client.search_runs([exp.experiment_id])} if exp else {}


def test_killed_study_resumes_where_it_stopped(tmp_path, warm_cache):  # noqa: F811
    uri = fresh_sqlite(tmp_path)
    args = [sys.executable, str(ROOT / "run.py"), *_sweep_args(tmp_path, uri, ["algo=grpo",
            "hydra.sweeper.n_trials=3"])]
    # mid-study, mid-trial: the sweep's process group is killed right after trial 1's job logs its
    # first training step (tests/kill_point), whatever the machine's speed
    env = dict(os.environ, OMP_NUM_THREADS="1", STPPO_TEST_KILL=f"after:1:{K.TAG_TRIAL}=1", STPPO_TEST_KILL_GROUP="1",
               PYTHONPATH=str(ROOT / "tests" / "kill_point"))
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=900)  # a hang guard: two tiny trials take about a minute
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the sweep did not reach trial 1's first step within 900 s: {proc.communicate()[1][-2000:]}")
    assert proc.returncode == -signal.SIGKILL, f"the sweep was not killed in trial 1: {err[-2000:]}"
    assert _mlflow_trial_runs(uri)["1"].info.status == "RUNNING"
    before = _trials(tmp_path, "clip_range-grpo")
    assert [t.state for t in before] == [TrialState.COMPLETE, TrialState.RUNNING]

    res = run_py(_sweep_args(tmp_path, uri, ["algo=grpo", "hydra.sweeper.n_trials=3"]), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    after = _trials(tmp_path, "clip_range-grpo")
    assert [t.state for t in after] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE,
                                        TrialState.COMPLETE]  # numbers continue: 3 done in total
    assert after[0].params == before[0].params and after[2].params == before[1].params  # retried
    assert after[3].params != after[0].params  # a fresh sample, not a replay of the first run
    runs = _mlflow_trial_runs(uri)
    assert runs["1"].info.status == "KILLED"  # the killed job's run, closed by the next job
    for n in ("0", "2", "3"):
        r = runs[n]
        assert r.info.status == "FINISHED" and after[int(n)].user_attrs[S.RUN_ID_ATTR] == r.info.run_id
        assert r.data.tags[K.TAG_STUDY] == "clip_range-grpo" and r.data.tags[K.TAG_SWEEP] == "clip_range"
        assert float(r.data.params["algo.clip_low"]) == pytest.approx(after[int(n)].params["algo.clip_low"])


def test_collapsing_trial_is_pruned_early_through_submitit(tmp_path, warm_cache):  # noqa: F811
    """The trial's job runs in its own process through the submitit_local launcher (the code path
    of submitit_slurm); its trainer detects the collapse and stops; the sweeper prunes the trial."""
    uri = fresh_sqlite(tmp_path)
    res = run_py(_sweep_args(tmp_path, uri, [
        "algo=st_ppo", "hydra.sweeper.n_trials=1", "trainer.total_steps=6", "trainer.debug_nan_steps=[1,2,3]",
        "trainer.collapse.nonfinite_patience=2", "hydra/launcher=submitit_local"]), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list((tmp_path / "m" / ".submitit").rglob("*_result.pkl")), "the job did not go through submitit"
    (trial,) = _trials(tmp_path, "clip_range-st_ppo")
    assert trial.state == TrialState.PRUNED and trial.user_attrs["collapse_step"] == 1
    assert set(trial.params) == {"algo.clip_low", "algo.clip_high", "algo.clip_bias.tau"}
    assert 0 in trial.intermediate_values and max(trial.intermediate_values) == 2
    client = MlflowClient(uri)
    run = client.get_run(trial.user_attrs[S.RUN_ID_ATTR])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, K.PG_LOSS)]
    assert max(steps) == 2 < 6  # stopped at the collapse, not run to the end
    assert run.data.tags[K.TAG_TRIAL] == "0" and run.data.params["trainer.stop_on_collapse"] == "True"


def test_a_stabilisers_option_is_a_sweep_dimension(tmp_path, warm_cache):  # noqa: F811
    """The example plugin (tests/plugin_example) swept over its β with the clip range: each trial
    a run of the stabiliser with the sampled option."""
    uri = fresh_sqlite(tmp_path)
    res = run_py(_sweep_args(tmp_path, uri, [
        "algo=turn_drift", "hydra.sweeper.n_trials=2",
        "+algo.loss_options.beta=interval(0.01, 1.0)"]), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    trials = _trials(tmp_path, "clip_range-turn_drift")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    runs = _mlflow_trial_runs(uri, "clip_range-turn_drift")
    for t in trials:
        r = runs[str(t.number)]
        assert float(r.data.params["algo.loss_options.beta"]) == pytest.approx(
            t.params["+algo.loss_options.beta"])
        assert "turn_drift/penalty" in r.data.metrics
