"""MLflow logging of stppo runs: the `Tracker` (one run per job, one batch per step, a disk
buffer while the store is away), the tracking URI, and `python -m stppo.tracker flush|reap`.
The keys it logs are the constants of `stppo.metric_names`; the store access below the Tracker is
`stppo.mlflow_store`. Torch-free; mlflow is imported lazily."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

from stppo.metric_names import STEP_TIME
from stppo.mlflow_store import (TAG_PROCESS, append_line, call, close_run, first_line, flush_file,
                               flush_pending, is_transient, make_client, process_token,
                               reap_dead_runs, send_rows, write_json)

log = logging.getLogger(__name__)
DEFAULT_URI = "sqlite:///mlflow.db"
PARAM_CHUNK = 100  # MLflow accepts at most 100 params per log_batch
RETRY_AFTER_S = 30.0  # while the store is unreachable, metrics go straight to disk; retry this often


def resolve_uri(uri: str | None = None) -> str:
    """The tracking URI: explicit, else $MLFLOW_TRACKING_URI, else ./mlflow.db (sqlite)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def absolute_uri(uri: str) -> str:
    """A sqlite URI with its path made absolute (for commands run from another directory, and for
    Ray's workers, which do not share the job's working directory); other URIs unchanged."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and uri != prefix + ":memory:":
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping → {'a.b.c': 'value'} (the run's params)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


class Tracker:
    """One MLflow run per job, logged in one batch per step.

    Robustness: sqlite lock contention between parallel jobs is retried; if the store becomes
    unreachable mid-run, training goes on and each step's metrics are appended to
    `<buffer_dir>/<run_id>.jsonl` (one warning), then flushed in order when the store answers again
    (tried at most every `retry_after_s`, and always at `finish`). A batch is removed from the buffer
    only after the store accepted it, and a re-sent batch is idempotent (same key, step, timestamp,
    value), so a failed or interrupted flush neither loses nor duplicates a line. If the run cannot
    be closed either, its final status waits in `<run_id>.status.json` and is sent by the next job
    on the same store, or by `python -m stppo.tracker flush`. Runs left RUNNING by a process that
    died without closing them (SIGKILL, OOM) are marked KILLED when the next job on this host starts.
    """

    def __init__(self, uri: str | None, experiment: str, *, buffer_dir: str | os.PathLike = ".stppo_buffer",
                 enabled: bool = True, retry_after_s: float | None = None) -> None:
        self.uri = resolve_uri(uri)
        self.experiment = experiment
        self.enabled = enabled
        self.run_id: str | None = None
        self.retry_after_s = RETRY_AFTER_S if retry_after_s is None else retry_after_s
        self._client = None
        self._buffer_dir = Path(buffer_dir)
        self._retry_at = 0.0  # monotonic time before which the store is not tried again
        self._warned = False

    @property
    def client(self):
        if self._client is None:
            self._client = call(make_client, self.uri)
        return self._client

    def start(self, *, tags: Mapping[str, Any], params: Mapping[str, str], run_name: str | None = None,
              run_id: str | None = None, artifacts: Mapping[str, str] | None = None) -> str | None:
        """Open a new run (or re-open `run_id` when resuming). Returns the run id.

        Raises ConnectionError (one line) when the store cannot be reached at all."""
        if not self.enabled:
            return None
        try:
            return self._start(tags, params, run_name, run_id, artifacts or {})
        except Exception as e:
            if not is_transient(e):
                raise
            raise ConnectionError(f"tracking store {self.uri} is unreachable ({first_line(e)}); start the "
                                  "server or set tracking.uri / MLFLOW_TRACKING_URI") from None

    def _start(self, tags, params, run_name, run_id, artifacts) -> str:
        client = self.client
        exp_id = self._experiment_id()
        proc = {TAG_PROCESS: process_token()}
        if run_id is not None:  # resuming: the same run continues, owned by this process now
            call(client.update_run, run_id, status="RUNNING")
            for k, v in proc.items():
                call(client.set_tag, run_id, k, v)
            with contextlib.suppress(Exception):  # the note a reaper or a failure left
                call(client.delete_tag, run_id, "error")
            self.run_id = run_id
        else:
            run = call(client.create_run, exp_id, run_name=run_name,
                       tags={**{k: str(v) for k, v in tags.items()}, **proc})
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), PARAM_CHUNK):
                call(client.log_batch, self.run_id, params=items[i:i + PARAM_CHUNK])
            for name, text in artifacts.items():
                call(client.log_text, self.run_id, text, name)
        self._housekeeping(exp_id)
        return self.run_id

    def _experiment_id(self) -> str:
        exp = call(self.client.get_experiment_by_name, self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return call(self.client.create_experiment, self.experiment)
        except Exception:  # another job created it between the two calls
            exp = call(self.client.get_experiment_by_name, self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def _housekeeping(self, exp_id: str) -> None:
        """Best effort: flush what dead jobs left in the buffer, close runs whose process died."""
        try:
            flush_pending(self.uri, self._buffer_dir, client=self.client)
            reap_dead_runs(self.client, exp_id, keep=self.run_id)
        except Exception as e:  # never fail a job for someone else's leftovers
            log.warning("stppo: tracking housekeeping skipped (%s)", first_line(e))

    def last_logged_step(self, key: str = STEP_TIME) -> int | None:
        """The last step with `key` logged (a step's metrics are written in one batch)."""
        if not self.enabled or self.run_id is None:
            return None
        self._flush_buffer()
        hist = call(self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in hist), default=None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step's metrics in one batch; never raises for an unreachable store."""
        if not self.enabled or self.run_id is None or not metrics:
            return
        ts = int(time.time() * 1000)
        rows = [[k, _finite_or_nan(v), ts, int(step)] for k, v in metrics.items()]
        if time.monotonic() < self._retry_at:
            self._buffer(rows)
            return
        try:
            self._flush_buffer()
            self._send(rows)
        except Exception as e:
            self._on_error(e, rows)

    def log_table(self, artifact_file: str, frame) -> None:
        """Log a table artifact (MLflow's `log_table` JSON, e.g. `samples_artifact(step)`). Best
        effort: a store that refuses or is away costs a warning, never the run."""
        if not self.enabled or self.run_id is None:
            return
        try:
            call(self.client.log_table, self.run_id, frame, artifact_file)
        except Exception as e:  # noqa: BLE001 - diagnostics must not stop training
            log.warning("stppo: could not log %s (%s)", artifact_file, first_line(e))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled and self.run_id is not None:
            for k, v in tags.items():
                call(self.client.set_tag, self.run_id, k, str(v)[:5000])

    def finish(self, status: str = "FINISHED", error: str | None = None) -> None:
        """Flush, record the error (if any) and close the run. Never raises: if the store is
        unreachable, the status waits on disk with the metrics (see the class docstring)."""
        if not self.enabled or self.run_id is None:
            return
        tags = {"error": error, "mlflow.note.content": f"Run ended with an error:\n{error}"} if error else {}
        try:
            self._flush_buffer()
            close_run(self.client, self.run_id, status, tags)
        except Exception as e:
            self._buffer_dir.mkdir(parents=True, exist_ok=True)
            end = int(time.time() * 1000)
            write_json(self._status_path(self.run_id), {"uri": self.uri, "status": status, "tags": tags,
                                                        "end_time": end})
            log.warning("stppo: could not close run %s on %s (%s); its metrics and final status %s are "
                        "kept in %s and sent by the next run on this store or by "
                        "`python -m stppo.tracker flush --uri %s`", self.run_id, self.uri,
                        first_line(e), status, self._buffer_dir, self.uri)

    # -- buffering --------------------------------------------------------------------------------
    @property
    def _buffer_path(self) -> Path:
        return self._buffer_dir / f"{self.run_id}.jsonl"

    def _status_path(self, run_id: str) -> Path:
        return self._buffer_dir / f"{run_id}.status.json"

    def _send(self, rows) -> None:
        send_rows(self.client, self.run_id, rows)

    def _on_error(self, err: Exception, rows) -> None:
        if not is_transient(err):  # the store rejected the batch itself: keep it aside, go on
            path = self._buffer_dir / f"{self.run_id}.rejected.jsonl"
            log.warning("stppo: %s rejected metrics (%s); kept in %s", self.uri, first_line(err), path)
            append_line(path, {"uri": self.uri, "rows": rows})
            return
        if not self._warned:
            log.warning("stppo: tracking store %s unreachable (%s); training goes on, metrics are buffered "
                        "in %s and sent when it answers again", self.uri, first_line(err), self._buffer_path)
            self._warned = True
        self._retry_at = time.monotonic() + self.retry_after_s
        self._buffer(rows)

    def _buffer(self, rows) -> None:
        append_line(self._buffer_path, {"uri": self.uri, "rows": rows})

    def _flush_buffer(self) -> None:
        if flush_file(self.client, self.run_id, self._buffer_path) and self._warned:
            log.warning("stppo: tracking store %s is back; buffered metrics flushed", self.uri)
            self._warned = False
        self._retry_at = 0.0


def _finite_or_nan(v: float) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")


def main(argv: list[str] | None = None) -> int:
    """`python -m stppo.tracker flush|reap [--uri URI] [--buffer-dir DIR]`.

    flush: send the buffered metrics and final statuses that jobs could not deliver (the store was
    unreachable when they ended). reap: mark KILLED the RUNNING runs, in every experiment, whose
    job process on this machine no longer exists (each job also does this for its own experiment)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m stppo.tracker")
    p.add_argument("command", choices=["flush", "reap"])
    p.add_argument("--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--buffer-dir", default=".stppo_buffer")
    a = p.parse_args(argv)
    uri = resolve_uri(a.uri)
    if a.command == "flush":
        print(f"flushed {flush_pending(uri, a.buffer_dir)} run(s) from {a.buffer_dir} to {uri}")
    else:
        client = make_client(uri)
        n = sum(len(reap_dead_runs(client, e.experiment_id)) for e in call(client.search_experiments))
        print(f"marked {n} orphaned run(s) KILLED in {uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
