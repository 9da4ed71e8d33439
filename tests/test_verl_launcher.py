"""backend=verl from stppo's side (this environment; verl only as a subprocess in .venv-verl).

No GPU here, so verl cannot train: `tests/verl_standin/verl_standin.py` takes the launcher's real
command line in the verl environment and logs verl-named metrics through verl's own `Tracking`
class (mlflow backend, attached by MLFLOW_RUN_ID), then exits 0, fails with a stderr tail, or
hangs until stopped. Everything around it is the real launcher: run creation, data conversion,
subprocess, run monitor, collapse rule, final status, and the analysis / sweep / dashboard reads.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from stppo import metric_names as K
from stppo.config import compose, to_config
from stppo.diagnostics import CollapseConfig, detect_collapse
from stppo.integrations.verl import launcher as L
from stppo.integrations.verl.monitor import late_mean

ROOT = Path(__file__).resolve().parents[1]
VERL_PY = ROOT / ".venv-verl" / "bin" / "python"
STANDIN = ROOT / "tests" / "verl_standin"
WORLD = ["task.options.n_people=60", "task.options.n_cities=20", "task.options.n_countries=6",
         "task.options.n_orgs=15", "task.options.n_distractors=50", "task.options.n_sft=10",
         "task.options.n_train=24", "task.options.n_val=8", "task.options.n_test=4"]
EXPERIMENT = "verl_study"


@pytest.fixture(scope="module")
def verl_python() -> Path:
    if not VERL_PY.exists():
        pytest.fail(f"{VERL_PY} is missing: run `make verl-env`")
    return VERL_PY


def make_cfg(tmp: Path, *extra: str):
    return to_config(compose([
        "backend=verl", "model=qwen2_5_0_5b", "trainer.warmstart.enabled=false", "task.prompt_style=search_r1",
        "trainer.rollout.max_total_tokens=1024", "trainer.total_steps=6", "trainer.val_every=2",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"tracking.experiment={EXPERIMENT}",
        f"backend.python={VERL_PY}", "backend.entry=verl_standin", "backend.poll_s=0.5", "backend.stop_grace_s=5",
        f"backend.data_dir={tmp}/data", f"trainer.out_dir={tmp}/runs", *WORLD, *extra]))


def launch(monkeypatch, cfg, mode: str):
    """The launcher after its checks (no GPU here), with the stand-in as verl's entry point."""
    monkeypatch.setenv("STANDIN_MODE", mode)
    monkeypatch.setenv("PYTHONPATH", str(STANDIN))
    return L.launch(cfg, check=lambda c: c.backend.python)


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def run_of(client, seed: int):
    exp = client.get_experiment_by_name(EXPERIMENT)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.seed = '{seed}' and tags.backend = 'verl'")
    return run


@pytest.fixture(scope="module")
def study(tmp_path_factory, verl_python):
    """One store: a verl run that trains to the end (seed 0), one that collapses and is stopped
    (seed 1, a sweep trial), one whose clipping bias grows until an alarm stops it (seed 4,
    trainer.on_alarm=stop), and own-backend runs of the same experiment (fixtures.runs)."""
    from fixtures.runs import write_demo_study

    tmp = tmp_path_factory.mktemp("verl_study")
    mp = pytest.MonkeyPatch()
    try:
        ok = make_cfg(tmp, "seed=0")
        objective = launch(mp, ok, "ok")
        bad = make_cfg(tmp, "seed=1", "trainer.stop_on_collapse=true", "trainer.collapse.patience=2",
                       "+tracking.tags.study=clip_range-st_ppo", "+tracking.tags.trial=3")
        launch(mp, bad, "collapse")
        launch(mp, make_cfg(tmp, "seed=4", "trainer.on_alarm=stop"), "alarm")
    finally:
        mp.undo()
    uri = f"sqlite:///{tmp}/mlflow.db"
    write_demo_study(uri, EXPERIMENT, presets=("ppo",), seeds=(0, 1), steps=12)
    return {"uri": uri, "tmp": tmp, "objective": objective, "ok": ok, "bad": bad, "client": MlflowClient(uri)}


def test_a_verl_run_carries_stppos_tags_params_and_metric_names(study):
    client = study["client"]
    run = run_of(client, 0)
    tags, params, rid = run.data.tags, run.data.params, run.info.run_id
    assert run.info.status == "FINISHED"
    assert {k: tags[k] for k in ("algo", "model", "task", "seed", "backend")} == {
        "algo": "st_ppo", "model": "qwen2_5_0_5b", "task": "testbed", "seed": "0", "backend": "verl"}
    assert params["algo.clip_low"] == "0.2" and params["backend.name"] == "verl"  # stppo's config
    assert params["trainer/project_name"] == EXPERIMENT  # verl's own Tracking logged into the same run
    score, success = history(client, rid, "critic/score/mean"), history(client, rid, K.SUCCESS_RATE)
    assert sorted(success) == list(range(1, 7)) and success == score
    turns = history(client, rid, "num_turns/mean")
    assert history(client, rid, K.NUM_TURNS_MEAN) == {s: v / 2 for s, v in turns.items()}
    val = history(client, rid, K.VAL_SUCCESS_RATE)
    assert val == history(client, rid, "val-core/testbed/acc/mean_at_1") and sorted(val) == [0, 2, 4, 6]
    assert set(history(client, rid, K.COLLAPSE_DETECTED).values()) == {0.0}
    assert set(history(client, rid, K.SKIPPED_STEPS).values()) == {0.0}
    assert study["objective"] == late_mean(sorted(val.items()), 6, 6) == val[6]
    artifacts = {a.path for a in client.list_artifacts(rid)}
    assert {"config.yaml", "verl_command.sh"} <= artifacts


def test_stppos_loss_metrics_arrive_under_stppos_names(study):
    """The stand-in logs what verl's trainer logs for the actor update with stppo_st_ppo
    (`actor/clip_bias/norm`, `actor/turn/k0/pg_clipfrac`, ...): each is in the run under
    stppo's name too, the per-turn values divided by their turn's token weight."""
    client = study["client"]
    run = run_of(client, 0)
    rid, logged = run.info.run_id, set(run.data.metrics)
    norm = history(client, rid, "actor/clip_bias/norm")
    assert sorted(norm) == list(range(1, 7)) and history(client, rid, K.CLIP_BIAS_NORM) == norm
    weight = history(client, rid, "actor/turn/k0/tokens")
    clip = history(client, rid, "actor/turn/k0/pg_clipfrac")
    assert history(client, rid, K.turn_key(0, "tokens")) == weight and set(weight.values()) == {4.0}
    got = history(client, rid, K.turn_key(0, "pg_clipfrac"))
    assert got == pytest.approx({s: clip[s] / weight[s] for s in weight}) and 0 < got[1] <= 1
    prefixed = {k[len("actor/"):] for k in logged if k.startswith("actor/") and "/" in k[len("actor/"):]}
    assert {"clip_bias/norm", "clip_bias/scale", "turn/k2/ratio_max", "turn/k3/tokens"} <= prefixed
    assert all(K.known_metric(k) for k in prefixed)
    missing = {k for k in prefixed if k not in logged}  # turn k3: no token in the batch, no value
    assert missing == {K.turn_key(3, n) for n in ("pg_clipfrac", "ratio_mean", "ratio_max", "adv_mean", "ppo_kl")}
    assert run.data.metrics["actor/turn/k3/tokens"] == 0.0 and K.turn_key(0, "entropy") not in logged
    assert not any(k.startswith(K.ALARM_PREFIX) for k in logged)


def test_an_alarm_stops_verl_with_on_alarm_stop(study):
    client = study["client"]
    run = run_of(client, 4)
    rid = run.info.run_id
    assert history(client, rid, K.alarm_key("clip_bias_growth")) == {9: 1.0}  # 5 baseline values, 2 beyond
    stopped = run.data.tags[K.TAG_STOPPED]  # the clipped fraction grows with the spread too
    assert stopped.startswith("alarm clip_bias_growth") and stopped.endswith(" at step 9")
    assert run.info.status == "FINISHED" and max(history(client, rid, K.SUCCESS_RATE)) == 9
    assert set(history(client, rid, K.COLLAPSE_DETECTED).values()) == {0.0}


def test_analysis_report_fits_the_growth_of_verl_runs(study, tmp_path):
    import pandas as pd

    from analysis.report import main

    out = tmp_path / "report"
    assert main(["--experiment", EXPERIMENT, "--out", str(out), "--tracking-uri", study["uri"], "--no-cache",
                 "--bootstrap", "200"]) == 0
    import numpy as np

    growth = pd.read_csv(out / "growth.csv").set_index("run_id")
    ok, alarmed = run_of(study["client"], 0).info.run_id, run_of(study["client"], 4).info.run_id
    assert growth.loc[ok, "points"] == 6 and growth.loc[ok, "growth_rate"] == pytest.approx(0.0, abs=1e-9)
    # the alarmed run logged steps 1–9 (flat, then the spread × 1.5 per step from step 7) and was
    # stopped there: the report fits all nine, as a least-squares line through log norm does
    norm = sorted(history(study["client"], alarmed, K.CLIP_BIAS_NORM).items())
    assert [s for s, _ in norm] == list(range(1, 10)) and growth.loc[alarmed, "points"] == 9
    slope = np.polyfit([s for s, _ in norm], np.log([v for _, v in norm]), 1)[0]
    assert slope > 0 and growth.loc[alarmed, "growth_rate"] == pytest.approx(slope, rel=1e-9)  # float64 OLS, 9 points


def test_a_collapse_stops_verl_and_is_recorded_as_by_the_own_trainer(study):
    from sweeps.study import outcome

    client, cfg = study["client"], study["bad"]
    run = run_of(client, 1)
    rid = run.info.run_id
    steps = sorted(history(client, rid, K.SUCCESS_RATE))
    # verl's validations are the live checks (test_freq = min(val_every 2, collapse.every 5)):
    # 0.3 before training, 0.6 at step 2, 0.05 at steps 4 and 6 → onset 4, detected at 6
    live = history(client, rid, K.VAL_LIVE_SUCCESS_RATE)
    assert live == history(client, rid, K.VAL_SUCCESS_RATE) and sorted(live)[:4] == [0, 2, 4, 6]
    expected, _ = detect_collapse(sorted(live.items()), cfg=CollapseConfig(patience=2))
    assert expected == 4 and run.data.metrics[K.COLLAPSE_DETECTED] == 1.0
    assert history(client, rid, K.COLLAPSE_STEP) == {6: 4.0}  # logged once, when detected
    assert run.info.status == "FINISHED" and steps[-1] == 6  # stopped where the collapse was detected
    assert run.data.tags[K.TAG_STOPPED].startswith("collapse at step 4")
    trial = outcome(0.05, None, cfg.tracking, "clip_range-st_ppo", 3)  # what the Optuna sweeper reads
    assert trial.state.name == "PRUNED" and trial.collapse_step == 4 and trial.run_id == rid


def test_analysis_and_dashboard_read_verl_runs_next_to_own_runs(study, monkeypatch):
    from analysis.collapse import collapse_table
    from analysis.load import load_study

    s = load_study(EXPERIMENT, study["uri"], use_cache=False)
    assert len(s.runs) == 5 and sorted(s.runs["algo"]) == ["ppo", "ppo", "st_ppo", "st_ppo", "st_ppo"]
    table = collapse_table(s).set_index("run_id")
    ok, bad = run_of(study["client"], 0).info.run_id, run_of(study["client"], 1).info.run_id
    assert not table.loc[ok, "collapsed"] and table.loc[bad, "collapse_step"] == 4
    assert table.loc[bad, "source"] == "live"

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("STPPO_CACHE_DIR", str(study["tmp"] / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", study["uri"])
    st.cache_data.clear()
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    runs = at.dataframe[0].value
    assert sorted(runs["algo"]) == ["ppo", "ppo", "st_ppo", "st_ppo", "st_ppo"]
    assert runs.set_index("seed").query("algo == 'st_ppo'").loc["1", "collapsed"]


def test_a_failed_verl_leaves_a_failed_run_with_the_end_of_its_stderr(tmp_path, monkeypatch, verl_python):
    cfg = make_cfg(tmp_path, "seed=2")
    with pytest.raises(L.VerlFailed, match=r"verl exited with status 3: torch.OutOfMemoryError: CUDA out of memory"):
        launch(monkeypatch, cfg, "fail")
    run = run_of(MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), 2)
    assert run.info.status == "FAILED" and "Traceback (most recent call last)" in run.data.tags["error"]
    assert "CUDA out of memory (stand-in)" in run.data.tags["mlflow.note.content"]


DRIVER = """
import sys
from stppo.config import compose, to_config
from stppo.integrations.verl import launcher
cfg = to_config(compose(sys.argv[1:]))
launcher.launch(cfg, check=lambda c: c.backend.python)
"""


def test_sigterm_stops_verl_and_closes_the_run_killed(tmp_path, verl_python):
    pid_file = tmp_path / "verl.pid"
    env = {**os.environ, "STANDIN_MODE": "hang", "STANDIN_PID_FILE": str(pid_file), "PYTHONPATH": f"{ROOT}{os.pathsep}{STANDIN}"}
    job = subprocess.Popen([sys.executable, "-c", DRIVER, *_args(tmp_path)], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    deadline = time.monotonic() + 600  # a hang guard: the stand-in logs its steps within seconds
    while not (pid_file.exists() and _logged(client)):
        assert job.poll() is None, job.stderr.read()
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the verl stand-in wrote no pid or logged no step within 600 s: {job.communicate()[1][-2000:]}")
        time.sleep(0.5)
    verl_pid = int(pid_file.read_text())
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) != 0
    assert "Terminated: received SIGTERM" in job.stderr.read()
    with pytest.raises(ProcessLookupError):
        os.kill(verl_pid, 0)  # verl's process group was stopped
    run = run_of(client, 3)
    assert run.info.status == "KILLED" and run.data.tags["error"] == "Terminated: received SIGTERM"


def test_a_signal_inside_the_metrics_poll_is_not_taken_for_a_tracking_hiccup():
    """SIGTERM lands wherever the launcher is; inside the poll (MLflow reads) it must still stop the job.
    Before Terminated was a BaseException the poll's `except Exception` logged it and went on."""
    class Busy:
        def poll(self):
            L._raise(signal.SIGTERM, None)  # what the handler does when the signal arrives here

    class Hiccup:
        calls = 0

        def poll(self):
            self.calls += 1
            raise OSError("database is locked")

    with pytest.raises(L.Terminated, match="received SIGTERM"):
        L._poll(Busy())
    hiccup = Hiccup()
    L._poll(hiccup)  # a tracking error is logged, the training goes on
    assert hiccup.calls == 1


def _args(tmp: Path) -> list[str]:
    return ["backend=verl", "model=qwen2_5_0_5b", "trainer.warmstart.enabled=false", "task.prompt_style=search_r1",
            "trainer.rollout.max_total_tokens=1024", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            f"tracking.experiment={EXPERIMENT}", f"backend.python={VERL_PY}", "backend.entry=verl_standin",
            "backend.poll_s=0.5", "backend.stop_grace_s=5", f"backend.data_dir={tmp}/data",
            f"trainer.out_dir={tmp}/runs", "seed=3", *WORLD]


def _logged(client) -> bool:
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return bool(runs and runs[0].data.metrics.get(K.SUCCESS_RATE) is not None)


def test_outcome_of_verls_exit():
    assert L.outcome(0, False, []) == ("FINISHED", None)
    assert L.outcome(-9, True, ["x"]) == ("FINISHED", None)  # stopped on collapse
    status, note = L.outcome(-signal.SIGKILL, False, ["Killed\n"])
    assert status == "KILLED" and note.startswith("verl was terminated by SIGKILL")
    status, note = L.outcome(1, False, ["a\n", "ValueError: bad key\n", "\n"])
    assert status == "FAILED" and note.splitlines()[0] == "verl exited with status 1: ValueError: bad key"


@pytest.mark.parametrize("extra, message", [
    (["model=tiny"], "model=tiny is a random preset built by stppo's own trainer"),
    (["trainer.warmstart.enabled=true"], "trainer.warmstart.enabled=true: verl has no SFT warm start"),
    (["algo=grpo", "trainer.group_size=3", "trainer.minibatch_size=32"], "must be a multiple of trainer.group_size=3"),
    (["algo.clip_bias.estimator=grad"], "algo.clip_bias.estimator=grad: the 'grad' estimator needs the policy"),
    (["task.prompt_style=compact"], "task.prompt_style=compact is for stppo's random-init models"),
])
def test_settings_verl_cannot_honour_are_one_line_errors(extra, message, tmp_path):
    cfg = make_cfg(tmp_path, *extra)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        L.make_plan(cfg, run_id="x")


SYNC, ONE_STEP, FULLY_ASYNC = ("verl.trainer.main_ppo", "verl.experimental.one_step_off_policy.main_ppo",
                                "verl.experimental.fully_async_policy.fully_async_main")


@pytest.mark.parametrize("lag, entry", [(0, SYNC), (1, ONE_STEP), (2, FULLY_ASYNC), (5, FULLY_ASYNC)])
def test_the_lag_picks_verls_trainer_and_the_dry_run_prints_it(lag, entry, tmp_path, capsys):
    cfg = make_cfg(tmp_path, f"backend.entry={SYNC}", f"trainer.offpolicy.lag={lag}", "backend.dry_run=true")
    assert math.isnan(L.run(cfg))
    argv = _command(capsys.readouterr().out)
    assert argv[0].endswith(f" -m {entry}")
    if lag >= 2:  # the fully async trainer: at most `lag` steps' batches in flight, a sync per step
        assert {f"async_training.staleness_threshold={lag}", "async_training.trigger_parameter_sync_step=1",
                "data.train_batch_size=0", "algorithm.rollout_correction.bypass_mode=false"} <= set(argv)
    assert ("rollout.n_gpus_per_node=4" in argv) == (lag > 0)  # half of the node's 8 GPUs roll out
    assert not (tmp_path / "mlflow.db").exists()  # nothing started


def test_a_stale_dry_run_from_the_command_line_prints_the_fully_async_trainer(tmp_path):
    out = subprocess.run([sys.executable, "run.py", "backend=verl", "+experiment=paper_search", "trainer.offpolicy.lag=3",
                          "backend.rollout_gpus_per_node=2", "backend.dry_run=true",
                          f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/hydra"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    argv = _command(out.stdout.split("MLFLOW_TRACKING_URI=", 1)[1])
    assert argv[0].endswith(f" -m {FULLY_ASYNC}")
    assert {"rollout.n_gpus_per_node=2", "trainer.n_gpus_per_node=6", "async_training.require_batches=2",
            "rollout.total_rollout_steps=514560"} <= set(argv)  # 512 prompts = 2 mini-batches of 256; 1005 steps


@pytest.mark.parametrize("extra, message", [
    (["trainer.offpolicy.lag=2", "trainer.offpolicy.lag_mode=uniform"],
     "trainer.offpolicy.lag_mode=uniform: verl's off-policy trainers have no per-group lag draw"),
    ([f"backend.entry={FULLY_ASYNC}"], f"backend.entry={FULLY_ASYNC} is one of verl's off-policy trainers, "
                                       "which have no on-policy setting"),
    (["backend.entry=verl_standin", "trainer.offpolicy.lag=1"], "backend.entry=verl_standin cannot run "
                                                                "trainer.offpolicy.lag=1"),
    ([f"backend.entry={ONE_STEP}", "trainer.offpolicy.lag=2"], f"backend.entry={ONE_STEP} cannot run "
                                                               "trainer.offpolicy.lag=2"),
    (["trainer.offpolicy.lag=1", "backend.n_gpus_per_node=1"], "trainer.offpolicy.lag=1 with backend=verl needs >= 2 GPUs"),
    (["trainer.offpolicy.lag=2", "algo=dapo"], "algo.dynamic_sampling with trainer.offpolicy.lag > 0: verl's off-policy"),
    (["trainer.offpolicy.lag=2", "trainer.questions_per_step=6", "trainer.minibatch_size=16"],
     "trainer.questions_per_step=6 must be a multiple of trainer.minibatch_size / group_size = 4"),
    (["trainer.offpolicy.lag=1", "backend.rollout_gpus_per_node=2", "backend.rollout_tp=4"],
     "backend.rollout_tp=4 must divide the rollout's 2 GPUs"),
])
def test_stale_settings_verl_cannot_run_are_one_line_errors(extra, message, tmp_path):
    cfg = make_cfg(tmp_path, f"backend.entry={SYNC}", *extra)
    with pytest.raises(ValueError, match=re.escape(message)):
        L.make_plan(cfg, run_id="x")


def test_a_stale_setting_verl_cannot_run_exits_1_with_one_line_before_anything_starts(tmp_path):
    out = subprocess.run([sys.executable, "run.py", "backend=verl", "+experiment=paper_search", "trainer.offpolicy.lag=2",
                          "trainer.offpolicy.lag_mode=uniform", "backend.dry_run=true",
                          f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/hydra"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1].startswith("run.py: error: trainer.offpolicy.lag_mode=uniform: ")


def test_checks_before_ray_starts_are_one_line_errors(tmp_path, verl_python):
    from conftest import free_port

    with pytest.raises(ValueError, match="backend.python=/nonexistent/python: no such interpreter; build"):
        L.preflight(make_cfg(tmp_path, "backend.python=/nonexistent/python"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no readable config.json there"):
        L.preflight(make_cfg(tmp_path, f"model.path={tmp_path}/empty"))
    with pytest.raises(ConnectionError, match="is not answering"):
        L.preflight(make_cfg(tmp_path, "task.retriever.kind=http", f"task.retriever.url=http://127.0.0.1:{free_port()}"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"asks for 1 node\(s\) x 8 GPUs but this node has 0 visible GPU"):
        L.preflight(make_cfg(tmp_path, f"model.path={tmp_path}/model"))  # imports verl in .venv-verl


def test_a_multirun_of_failing_verl_jobs_records_each_and_ends_with_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = subprocess.run([sys.executable, "run.py", "-m", "backend=verl", "+experiment=paper_search", "algo=ppo",
                          "seed=0,1", "backend.python=/nonexistent/python", f"tracking.uri={uri}",
                          f"hydra.sweep.dir={tmp_path}/sweep"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("run.py: error: 2 jobs failed (their MLflow runs are FAILED with the error): job #0")
    exp = MlflowClient(uri).get_experiment_by_name("paper_search")
    runs = MlflowClient(uri).search_runs([exp.experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FAILED"}
    assert all("no such interpreter" in r.data.tags["error"] and r.data.tags["backend"] == "verl" for r in runs)


def _command(chunk: str) -> list[str]:
    """A printed command: its first line, then one override per line (up to the line without ' \\')."""
    lines = chunk.splitlines()
    end = next(i for i, ln in enumerate(lines) if not ln.endswith(" \\"))
    return [lines[0].removesuffix(" \\")] + [ln.strip().removesuffix(" \\") for ln in lines[1:end + 1]]


def test_the_dry_run_of_the_readme_study_prints_one_command_per_job(tmp_path):
    store = tmp_path / "mlflow.db"
    out = subprocess.run([sys.executable, "run.py", "-m", "backend=verl", "+experiment=paper_search",
                          "algo=ppo,s_ppo,st_ppo", "seed=0,1,2", "backend.dry_run=true", f"tracking.uri=sqlite:///{store}",
                          f"hydra.sweep.dir={tmp_path}/sweep"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    commands = [_command(c) for c in re.split(r"(?m)^MLFLOW_TRACKING_URI=", out.stdout)[1:]]
    assert len(commands) == 9 and all(c[0].endswith(" -m verl.trainer.main_ppo") for c in commands)
    for algo in ("ppo", "s_ppo", "st_ppo"):
        assert sum(f"actor_rollout_ref.actor.policy_loss.loss_mode=stppo_{algo}" in c for c in commands) == 3
    assert all(len(c) > 60 and all("=" in o and " " not in o for o in c[1:]) for c in commands)  # one per line
    assert not store.exists()  # nothing started, no run created
    assert math.isnan(L.run(to_config(compose(["backend=verl", "+experiment=paper_search", "backend.dry_run=true"]))))


def test_the_sweep_and_the_slurm_launcher_compose_with_backend_verl(tmp_path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stppo.config import CONF_DIR, register_configs
    from sweeps import register_hydra_plugins

    register_configs()
    register_hydra_plugins()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        c = hydra_compose("config", overrides=["+sweep=clip_range", "backend=verl", "+experiment=paper_search",
                                               "hydra/launcher=submitit_slurm", "algo=s_ppo",
                                               "algo.clip_bias.tau=1.5"], return_hydra_config=True)
    assert c.hydra.sweeper._target_ == "sweeps.hydra_sweeper.StppoOptunaSweeper"
    assert c.hydra.launcher._target_.endswith("SlurmLauncher")
    from omegaconf import open_dict

    with open_dict(c):
        del c["hydra"]
    cfg = to_config(c)
    assert cfg.backend.name == "verl" and cfg.trainer.stop_on_collapse  # the sweep prunes collapsed verl runs
    argv = L.make_plan(cfg, run_id="x").argv
    assert "+actor_rollout_ref.actor.policy_loss.spec.clip_bias.tau=1.5" in argv  # the trial's τ reaches verl's loss


@pytest.mark.parametrize("override, field", [
    ("backend.name=trl", "backend.name"), ("backend.rollout_tp=3", "backend.rollout_tp"),
    ("backend.n_gpus_per_node=0", "backend.nnodes and backend.n_gpus_per_node"),
    ("backend.gpu_memory_utilization=1.5", "backend.gpu_memory_utilization"),
    ("backend.rollout_gpus_per_node=8", "backend.rollout_gpus_per_node"),
])
def test_invalid_backend_settings_name_the_field(override, field):
    with pytest.raises(Exception, match=field.replace(".", r"\.")):
        to_config(compose(["backend=verl", override]))
