"""The Tracker against real stores: a remote `mlflow server` (round trip; killed mid-run and
restarted on the same port), sqlite under concurrent first use, a store that is down when the run
ends, flushes that fail midway, runs orphaned by a killed process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import free_port, start_on_free_port, wait_healthy
from mlflow.tracking import MlflowClient

from stppo import tracker as TR
from stppo import metric_names as K
from stppo import mlflow_store as io

MLFLOW = Path(sys.executable).parent / "mlflow"


def fresh_sqlite(directory: Path, name: str = "mlflow.db") -> str:
    """A new, empty MLflow sqlite store in `directory` (a copy of one initialised per session:
    creating MLflow's schema takes seconds). Returns its URI."""
    import fcntl

    from stppo.cache import cache_dir

    folder = cache_dir("test_mlflow_template")  # shared by the pytest-xdist workers
    template = folder / "mlflow.db"
    if not template.exists():
        with open(folder / ".lock", "w") as lock:  # one worker builds it; the other waits here
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not template.exists():  # built aside and moved in whole: never copied half-made
                build = folder / f"build-{os.getpid()}" / "mlflow.db"
                io.make_client(f"sqlite:///{build}").search_experiments()
                os.replace(build, template)
                build.parent.rmdir()
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, directory / name)
    return f"sqlite:///{directory / name}"


class Server:
    """A real `mlflow server` on a fixed port, started and stopped (SIGKILL) by its own pid."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.proc, self.uri = root, None, None, None

    def _command(self, port: int) -> list[str]:
        return [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root}/server.db",
                "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
                "--port", str(port), "--workers", "1"]

    def start(self, timeout: float = 120) -> None:
        """Start on a free port the first time, on the same port after that (a restart)."""
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job-runner workers
        log = self.root / "server.log"
        if self.port is None:
            self.proc, self.uri = start_on_free_port(self._command, "/health", timeout, log, env=env,
                                                     start_new_session=True)
            self.port = int(self.uri.rsplit(":", 1)[1])
            return
        with open(log, "a") as out:
            self.proc = subprocess.Popen(self._command(self.port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            wait_healthy(f"{self.uri}/health", self.proc, timeout, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the server (its process group: the uvicorn worker too), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow_server"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _history(client: MlflowClient, run_id: str) -> dict[str, list[int]]:
    keys = client.get_run(run_id).data.metrics
    return {k: [m.step for m in client.get_metric_history(run_id, k)] for k in keys}


def _only_run(client: MlflowClient, experiment: str):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def test_remote_server_round_trip(server, tiny_cfg, tmp_path):
    from stppo.train.job import run

    run(tiny_cfg("algo=grpo", f"tracking.uri={server.uri}", "tracking.experiment=remote",
                 f"tracking.buffer_dir={tmp_path}/buffer"))
    client = MlflowClient(server.uri)
    r = _only_run(client, "remote")
    assert r.info.status == "FINISHED"
    assert {r.data.tags[t] for t in (K.TAG_ALGO, K.TAG_MODEL, K.TAG_SEED)} == {"grpo", "tiny", "0"}
    assert r.data.params["algo.name"] == "grpo" and r.data.params["trainer.total_steps"] == "2"
    h = _history(client, r.info.run_id)
    assert h[K.PG_LOSS] == [1, 2] and h[K.VAL_SUCCESS_RATE] == [0, 2]
    yaml_text = Path(client.download_artifacts(r.info.run_id, "config.yaml", str(tmp_path))).read_text()
    assert "name: grpo" in yaml_text
    assert not list((tmp_path / "buffer").glob("*"))  # nothing had to be buffered


def test_server_killed_mid_run_and_restarted_loses_no_step(server, tiny_cfg, tmp_path, monkeypatch, caplog):
    from stppo.train.job import run

    monkeypatch.setattr(TR, "RETRY_AFTER_S", 0.0)  # try the store at every step (default: every 30 s)
    real_log, seen = TR.Tracker.log, {}

    def log(self, step, metrics):  # the server dies before step 2 is logged, returns before step 4
        if K.STEP_TIME in metrics and step == 2:
            server.stop()
        if K.STEP_TIME in metrics and step == 4:
            server.start()
        t0 = time.monotonic()
        real_log(self, step, metrics)
        seen[step] = (time.monotonic() - t0, self._buffer_path.exists())

    monkeypatch.setattr(TR.Tracker, "log", log)
    with caplog.at_level(logging.WARNING, logger="stppo.tracker"):
        run(tiny_cfg("algo=ppo", "trainer.total_steps=5", f"tracking.uri={server.uri}",
                     "tracking.experiment=outage", f"tracking.buffer_dir={tmp_path}/buffer"))
    # a refused connection costs MLflow's bounded retries (HTTP_CLIENT_DEFAULTS: 2 retries, backoff
    # 1 s) and one of `call`'s, ≈ 6 s of sleeps; MLflow's own defaults (7 retries, backoff 2 s)
    # would sleep ≈ 4 min: 60 s tells the two apart with 10× room for a busy machine
    assert seen[2][0] < 60 and seen[3][0] < 60, f"a dead server stalled training: {seen}"
    assert seen[2][1] and seen[3][1], "steps 2-3 were not buffered while the server was down"
    assert not seen[4][1], "the buffer was not flushed when the server came back"
    assert any("unreachable" in m for m in caplog.messages)
    client = MlflowClient(server.uri)
    r = _only_run(client, "outage")
    assert r.info.status == "FINISHED"
    h = _history(client, r.info.run_id)
    assert len(h) > 20
    for key, steps in h.items():
        if K.parse_turn_key(key) is not None:  # a turn no trajectory reached at a step has no value
            assert set(steps) <= {1, 2, 3, 4, 5} and len(steps) == len(set(steps)), f"{key}: {steps}"
            continue
        # the validation and the live checks (every trainer.collapse.every = 5 steps) run at 0 and 5
        at_checks = key in (K.VAL_SUCCESS_RATE, K.VAL_LIVE_SUCCESS_RATE, K.LIVE_CHECK_TIME)
        assert sorted(steps) == ([0, 5] if at_checks else [1, 2, 3, 4, 5]), f"{key}: {steps}"


def test_run_ending_while_store_is_down_is_closed_later(tmp_path, monkeypatch):
    uri, buf = fresh_sqlite(tmp_path), tmp_path / "buffer"
    tr = TR.Tracker(uri, "ends-down", buffer_dir=buf)
    run_id = tr.start(tags={K.TAG_ALGO: "ppo"}, params={"a": "1"})
    tr.log(1, {K.PG_LOSS: 0.5})

    def unreachable(*args, **kwargs):
        raise ConnectionError("Connection refused")

    with monkeypatch.context() as m:  # the store goes away before the run ends
        for name in ("log_batch", "set_tag", "set_terminated"):
            m.setattr(tr.client, name, unreachable)
        tr.log(2, {K.PG_LOSS: 0.4})
        tr.finish("FAILED", error="ValueError: boom")  # must not raise
    assert json.loads((buf / f"{run_id}.status.json").read_text())["status"] == "FAILED"
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    assert TR.main(["flush", "--uri", uri, "--buffer-dir", str(buf)]) == 0  # the store is back
    r = client.get_run(run_id)
    assert r.info.status == "FAILED" and r.data.tags["error"] == "ValueError: boom"
    assert _history(client, run_id)[K.PG_LOSS] == [1, 2]
    assert not list(buf.glob(f"{run_id}*"))


def test_unreachable_store_at_start_is_one_clear_error(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"tracking store {uri} is unreachable") as e:
        TR.Tracker(uri, "x", buffer_dir=tmp_path).start(tags={}, params={})
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 60


def test_failed_flush_neither_loses_nor_duplicates(tmp_path, monkeypatch):
    uri = fresh_sqlite(tmp_path)
    tr = TR.Tracker(uri, "flush", buffer_dir=tmp_path / "buffer", retry_after_s=0.0)
    run_id = tr.start(tags={}, params={})
    real, state, sent = tr.client.log_batch, {"down": True, "refuse_step": None}, []

    def log_batch(run_id, metrics=(), **kw):  # the store is unreachable, or drops one batch
        steps = {m.step for m in metrics}
        if metrics and (state["down"] or state["refuse_step"] in steps):
            raise ConnectionError("Connection refused")
        sent.extend(steps)
        return real(run_id, metrics=metrics, **kw)

    monkeypatch.setattr(tr.client, "log_batch", log_batch)
    for step in (1, 2, 3):
        tr.log(step, {K.PG_LOSS: step / 10, K.GRAD_NORM: 1.0})
    state.update(down=False, refuse_step=2)  # back, but the flush fails at the second batch
    tr.log(4, {K.PG_LOSS: 0.4, K.GRAD_NORM: 1.0})
    lines = [json.loads(x) for x in tr._buffer_path.read_text().splitlines()]
    assert [row["rows"][0][3] for row in lines] == [2, 3, 4]  # step 1 left the buffer, no loss
    state.update(refuse_step=None)
    tr.finish()
    assert sent.count(1) == 1 and sorted(sent) == [1, 2, 3, 4]  # each batch accepted exactly once
    client = MlflowClient(uri)
    assert _history(client, run_id) == {K.PG_LOSS: [1, 2, 3, 4], K.GRAD_NORM: [1, 2, 3, 4]}
    assert client.get_run(run_id).info.status == "FINISHED" and not tr._buffer_path.exists()


def _first_use(uri: str, buffer_dir: str) -> None:
    t = TR.Tracker(uri, "exp", buffer_dir=buffer_dir)
    t.start(tags={}, params={"p": "1"})
    t.log(1, {K.PG_LOSS: 1.0})
    t.finish()


def test_parallel_first_use_of_a_fresh_sqlite_store(tmp_path):
    """Without the lock, MLflow's schema creation races ('table ... already exists')."""
    import multiprocessing

    uri = f"sqlite:///{tmp_path}/fresh.db"
    # spawn, not fork: a fork of this threaded process (pytest-xdist, torch) can inherit a held lock
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_first_use, args=(uri, str(tmp_path / f"b{i}"))) for i in range(3)]
    for p in procs:
        p.start()
    hung = []
    try:
        for i, p in enumerate(procs):
            p.join(timeout=300)  # a hang guard: each takes a few seconds
            if p.is_alive():
                hung.append(i)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert not hung, f"first-use processes {hung} hung past 300 s"
    assert [p.exitcode for p in procs] == [0, 0, 0]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}


def test_run_orphaned_by_a_killed_process_is_marked_killed(tmp_path):
    uri = fresh_sqlite(tmp_path)
    client = io.make_client(uri)
    exp_id = client.create_experiment("orphans")
    child = subprocess.Popen(["sleep", "60"])
    dead_token = io.process_token(child.pid)
    child.kill()
    child.wait()
    orphan = client.create_run(exp_id, tags={io.TAG_PROCESS: dead_token}).info.run_id
    alive = client.create_run(exp_id, tags={io.TAG_PROCESS: io.process_token()}).info.run_id
    tr = TR.Tracker(uri, "orphans", buffer_dir=tmp_path / "buffer")
    tr.start(tags={}, params={})
    r = client.get_run(orphan)
    assert r.info.status == "KILLED" and "ended without closing this run" in r.data.tags["error"]
    assert client.get_run(alive).info.status == "RUNNING"  # its process is this one: alive
    tr.finish()


def test_keys_import_cheaply_and_the_cli_runs_as_documented(tmp_path):
    """`stppo.metric_names` (the keys analysis and the dashboard import) and `stppo.tracker` load
    neither torch nor mlflow; `python -m stppo.tracker flush` (README) runs and exits 0."""
    code = ("import sys, stppo.metric_names, stppo.tracker\n"
            "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    uri = fresh_sqlite(tmp_path)
    cli = subprocess.run([sys.executable, "-m", "stppo.tracker", "flush", "--uri", uri,
                          "--buffer-dir", str(tmp_path / "buffer")], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("flushed 0 run(s)")
