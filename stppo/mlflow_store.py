"""Low-level MLflow store access for `stppo.tracker.Tracker`: client creation (a fresh sqlite
store is created under an inter-process lock), retries of transient errors, the on-disk metric
buffer and its flush, and closing runs whose job process died. Torch-free; mlflow is imported
lazily."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable, Mapping

log = logging.getLogger("stppo.tracker")  # one logger with the Tracker's
# A remote store that does not answer must not stall training: bounded client retries/timeouts
# (MLflow's own defaults retry for minutes). Set only when the user has not set them.
HTTP_CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
TRANSIENT = ("database is locked", "is locked", "max retries exceeded", "connection refused",
             "connectionerror", "connection aborted", "timed out", "temporarily unavailable",
             "status code 502", "status code 503", "status code 504", "remotedisconnected")
TAG_PROCESS = "stppo.process"  # "host:pid:start-time" of the job that holds the run open


def is_transient(err: BaseException) -> bool:
    """A store error worth retrying (sqlite lock contention, an unreachable or overloaded server)."""
    text = f"{type(err).__name__} {err}".lower()
    return isinstance(err, (ConnectionError, TimeoutError)) or any(t in text for t in TRANSIENT)


def make_client(uri: str):
    """An MlflowClient for `uri`. A new sqlite file is created under an inter-process lock: two
    jobs initialising the same fresh store at once otherwise race in MLflow's schema migration."""
    from mlflow.tracking import MlflowClient

    if uri.startswith(("http://", "https://")):
        for k, v in HTTP_CLIENT_DEFAULTS.items():
            os.environ.setdefault(k, v)
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if path is None or path == ":memory:":
        return MlflowClient(tracking_uri=uri)
    import fcntl

    folder = Path(path).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)  # lock the folder: no lock file left next to the store
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return MlflowClient(tracking_uri=uri)  # creates and migrates the schema if needed
    finally:
        os.close(fd)  # releases the lock


def call(fn: Callable, *args, attempts: int = 8, **kwargs):
    """`fn(*args, **kwargs)`, retried on transient errors: sqlite lock contention up to `attempts`
    times (backoff 0.05 s … 6.4 s), an unreachable server once (MLflow's client already retried)."""
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            locked = "locked" in str(e).lower()
            if not is_transient(e) or i == (attempts - 1 if locked else 1):
                raise
            time.sleep(0.05 * 2**i)


def send_rows(client, run_id: str, rows) -> None:
    from mlflow.entities import Metric

    call(client.log_batch, run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in rows])


def flush_file(client, run_id: str, path: Path) -> int:
    """Send a run's buffered batches in order; returns how many were sent. After a failure the
    file is rewritten (atomically) without the batches the store accepted, so nothing is lost and
    nothing is sent twice — except a batch in flight when the process died, which MLflow
    de-duplicates (same key, step, timestamp and value). A batch the store rejects as invalid
    (not a connection problem) moves to `<run_id>.rejected.jsonl` instead of blocking the rest."""
    if not path.exists():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    done = 0
    try:
        for line in lines:
            try:
                send_rows(client, run_id, json.loads(line)["rows"])
            except Exception as e:
                if is_transient(e):
                    raise
                log.warning("stppo: the store rejected buffered metrics of run %s (%s)", run_id,
                            first_line(e))
                with open(path.with_name(f"{run_id}.rejected.jsonl"), "a") as f:
                    f.write(line + "\n")
            done += 1
    finally:
        if done == len(lines):
            path.unlink(missing_ok=True)
        elif done:
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in lines[done:]))
            os.replace(tmp, path)
    return done


def close_run(client, run_id: str, status: str, tags: Mapping[str, str], end_time: int | None = None) -> None:
    for k, v in tags.items():
        call(client.set_tag, run_id, k, str(v)[:5000])
    call(client.set_terminated, run_id, status=status, end_time=end_time)


def flush_pending(uri: str, buffer_dir: str | os.PathLike, *, client=None) -> int:
    """Send what jobs that have ended left in `buffer_dir` for store `uri` (resolved): buffered
    metrics and final statuses. Buffers of a job still alive on this host are left to it.
    Returns the number of runs flushed."""
    d = Path(buffer_dir)
    if not d.is_dir():
        return 0
    n = 0
    for path in sorted(d.glob("*.jsonl")):
        run_id = path.name.split(".")[0]
        if path.name.endswith(".rejected.jsonl") or not _buffer_for(path, uri):
            continue
        client = client or make_client(uri)
        if _owner_alive(client, run_id):
            continue
        flush_file(client, run_id, path)
        n += 1
    for path in sorted(d.glob("*.status.json")):
        st = json.loads(path.read_text())
        if st.get("uri") != uri:
            continue
        run_id = path.name.split(".")[0]
        client = client or make_client(uri)
        flush_file(client, run_id, d / f"{run_id}.jsonl")
        close_run(client, run_id, st["status"], st.get("tags") or {}, st.get("end_time"))
        path.unlink()
        n += 1
    return n


def reap_dead_runs(client, exp_id: str, *, keep: str | None = None) -> list[str]:
    """Mark KILLED the experiment's RUNNING runs whose job process (on this host) no longer
    exists — a SIGKILL, the OOM killer or a launcher timeout leaves no chance to close them."""
    host = socket.gethostname()
    runs = call(client.search_runs, [exp_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
    reaped = []
    for r in runs:
        token = r.data.tags.get(TAG_PROCESS, "")
        if r.info.run_id == keep or not token.startswith(host + ":") or process_alive(token):
            continue
        msg = (f"the job's process ({token}) ended without closing this run (SIGKILL, out of memory or a "
               "launcher timeout); marked KILLED by a later job. trainer.resume=true continues it.")
        close_run(client, r.info.run_id, "KILLED", {"error": msg, "mlflow.note.content": msg})
        reaped.append(r.info.run_id)
    if reaped:
        log.warning("stppo: marked %d orphaned RUNNING run(s) KILLED: %s", len(reaped), ", ".join(reaped))
    return reaped


def process_token(pid: int | None = None) -> str:
    """'host:pid:start-time' — identifies a process even after its pid is reused."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def process_alive(token: str) -> bool:
    _, pid, started = token.rsplit(":", 2)
    now = _start_time(int(pid))
    return now is not None and (started in ("None", "") or now == started)


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
            return ""
        except (OSError, ProcessLookupError):
            return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _owner_alive(client, run_id: str) -> bool:
    try:
        token = call(client.get_run, run_id).data.tags.get(TAG_PROCESS, "")
    except Exception:
        return False
    return token.startswith(socket.gethostname() + ":") and process_alive(token)


def _buffer_for(path: Path, uri: str) -> bool:
    with open(path) as f:
        first = f.readline()
    try:
        return json.loads(first).get("uri") == uri
    except (ValueError, AttributeError):
        return False


def append_line(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]
