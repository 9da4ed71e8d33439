"""A run killed with SIGKILL mid-step and resumed with trainer.resume=true continues its own
MLflow run with no missing or duplicated steps and the same metrics as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import ROOT, TINY_OVERRIDES
from stppo import metric_names as K
from stppo.train import checkpoint

STEPS = 5
KILL_POINT = ROOT / "tests" / "kill_point"
KILL_HANG_S = 900  # a hang guard: a tiny run of 5 steps takes about a minute


def _runs(uri, experiment):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def _history(uri, run_id):
    client = MlflowClient(uri)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path, tiny_cfg):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = [f"trainer.total_steps={STEPS}", "trainer.save_every=1", "trainer.val_every=2", "algo=ppo"]
    from stppo.train.job import run

    run(tiny_cfg(*common, "tracking.experiment=uninterrupted"))  # also warms the caches

    args = [sys.executable, str(ROOT / "run.py"), *TINY_OVERRIDES, *common,
            f"tracking.uri={uri}", f"trainer.out_dir={tmp_path}/runs", "tracking.experiment=killed",
            f"hydra.run.dir={tmp_path}/hydra"]
    # SIGKILL right after step 3's training metrics are logged, before its checkpoint: the resumed
    # run redoes step 3 and must not log it twice (tests/kill_point)
    env = dict(os.environ, OMP_NUM_THREADS="1", STPPO_TEST_KILL="after:3", PYTHONPATH=str(KILL_POINT))
    proc = subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=KILL_HANG_S)
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed at step 3: {proc.stderr[-2000:]}"
    (killed,) = _runs(uri, "killed")
    assert killed.info.status == "RUNNING"  # SIGKILL leaves no chance to close it
    (ckpt,) = (tmp_path / "runs" / "killed").glob("*/checkpoint.pt")
    assert checkpoint.load(ckpt.parent)["step"] == 2
    assert max(m.step for m in MlflowClient(uri).get_metric_history(killed.info.run_id, K.SUCCESS_RATE)) == 3

    run(tiny_cfg(*common, "tracking.experiment=killed", "trainer.resume=true"))
    (resumed,) = _runs(uri, "killed")
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
    (ref,) = _runs(uri, "uninterrupted")
    h_ref, h_res = _history(uri, ref.info.run_id), _history(uri, resumed.info.run_id)
    assert set(h_ref) == set(h_res)
    for key, ref_hist in h_ref.items():
        steps = [s for s, _ in h_res[key]]
        assert steps == sorted(set(steps)), f"{key}: duplicated steps {steps}"
        assert steps == [s for s, _ in ref_hist], f"{key}: missing steps"
        if not key.startswith("perf/"):
            assert h_res[key] == ref_hist, key


def test_checkpoint_write_is_atomic(tmp_path):
    checkpoint.save(tmp_path, {"step": 1, "w": torch.ones(2)})
    (tmp_path / (checkpoint.FILE + ".tmp")).write_bytes(b"partial write")  # a kill mid-save
    assert checkpoint.load(tmp_path)["step"] == 1


def test_sigterm_closes_the_run_killed_and_keeps_what_it_logged(tmp_path):
    """A scheduler's SIGTERM, wherever it lands (inside an MLflow call included), ends the command
    with 143 and closes the run KILLED with the steps logged so far."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [sys.executable, str(ROOT / "run.py"), *TINY_OVERRIDES, "trainer.total_steps=200", "algo=ppo", "trainer.warmstart.enabled=false",
            f"tracking.uri={uri}", f"trainer.out_dir={tmp_path}/runs", "tracking.experiment=term",
            f"hydra.run.dir={tmp_path}/hydra"]
    proc = subprocess.Popen(args, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline, logged = time.monotonic() + KILL_HANG_S, []  # a hang guard: 2 steps take seconds
    while proc.poll() is None and len(logged) < 2:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run logged no 2 steps within {KILL_HANG_S} s: {proc.communicate()[1][-2000:]}")
        runs = _runs(uri, "term")
        logged = MlflowClient(uri).get_metric_history(runs[0].info.run_id, K.SUCCESS_RATE) if runs else []
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before it could be stopped: {proc.stderr.read()[-2000:]}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    (run,) = _runs(uri, "term")
    assert run.info.status == "KILLED" and run.data.tags["error"] == "Terminated: received SIGTERM"
    assert len(MlflowClient(uri).get_metric_history(run.info.run_id, K.SUCCESS_RATE)) >= len(logged)
