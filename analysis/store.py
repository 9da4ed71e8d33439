"""Read MLflow runs from a tracking store.

Two readers with one interface (`experiments`, `runs`, `params`, `metrics`):
* `SqliteReader` — `sqlite:///path.db` stores, read directly with SQL over a read-only connection
  (the MLflow tables `experiments`, `runs`, `tags`, `params`, `metrics`, `latest_metrics`), which is
  an order of magnitude faster than the REST/ORM path and never creates or migrates a database;
* `ClientReader` — any other URI (an `http(s)://` tracking server, a `file:` store, ...) through
  `mlflow.MlflowClient` (`search_runs`, `get_metric_history`); mlflow is imported lazily.

Every user error ends in one line (an `AnalysisError`, which is also a ValueError /
FileNotFoundError / ConnectionError as fits). MLflow stores ±inf as ±max float and NaN as 0 with
an `is_nan` flag; both readers return them as ±inf and NaN.
"""

from __future__ import annotations

import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from stppo import metric_names as T

MAX_FLOAT = 1.7976931348623157e308  # MLflow's stand-in for ±inf
# Tags copied into the per-run table; everything else stays in MLflow.
RUN_TAG_COLUMNS: tuple[str, ...] = (*T.RUN_TAGS, T.TAG_STUDY, T.TAG_TRIAL)
RUN_COLUMNS: tuple[str, ...] = (
    "run_id", "experiment", "run_name", "status", "start_time", "end_time", *RUN_TAG_COLUMNS,
    "fingerprint",
)


class AnalysisError(Exception):
    """A user-caused problem with a one-line message (bad URI, unknown or empty experiment)."""


class StoreNotFoundError(AnalysisError, FileNotFoundError):
    pass


class StoreUnreachableError(AnalysisError, ConnectionError):
    pass


class UnknownExperimentError(AnalysisError, ValueError):
    pass


class EmptyExperimentError(AnalysisError, ValueError):
    pass


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///rel.db` / `sqlite:////abs.db` URI, else None."""
    if not uri.startswith("sqlite:"):
        return None
    if not uri.startswith("sqlite:///") or len(uri) <= len("sqlite:///"):
        raise StoreNotFoundError(f"tracking URI {uri!r} names no file; use sqlite:///path/to/mlflow.db")
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


def open_reader(uri: str):
    """The reader for `uri`; raises one-line errors for a missing file or an unreachable server."""
    uri = uri.strip()
    if not uri:
        raise StoreNotFoundError("tracking URI is empty; pass e.g. sqlite:///mlflow.db or http://127.0.0.1:5000")
    path = sqlite_path(uri)
    if path is not None:
        return SqliteReader(uri, path)
    if uri.startswith(("http://", "https://")):
        _probe_server(uri)
    elif uri.startswith("file:") or "://" not in uri:
        local = Path(uri[len("file://"):] if uri.startswith("file://") else uri.removeprefix("file:"))
        if not local.exists():
            raise StoreNotFoundError(f"tracking store not found: {local} (from tracking URI {uri!r})")
    return ClientReader(uri)


def _probe_server(uri: str, timeout: float = 5.0) -> None:
    """Fail fast (one line) instead of MLflow's minutes of retries when nothing listens at `uri`."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # something answers; MLflow will report its own errors
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StoreUnreachableError(
            f"tracking server {uri} is unreachable ({reason}); "
            "start it (mlflow server) or pass another --tracking-uri"
        ) from None


def _check_experiments(uri: str, wanted: Sequence[str], available: dict[str, str]) -> list[str]:
    """Experiment ids of `wanted` names, or an UnknownExperimentError listing the available ones."""
    if not wanted:
        names = ", ".join(sorted(available)) or "none"
        raise UnknownExperimentError(f"no experiment given; available in {uri}: {names}")
    missing = [n for n in wanted if n not in available]
    if missing:
        raise UnknownExperimentError(
            f"experiment {missing[0]!r} not found in {uri}; available: {', '.join(sorted(available)) or 'none'}"
        )
    return [available[n] for n in wanted]


def _check_not_empty(uri: str, names: Sequence[str], runs: pd.DataFrame) -> None:
    present = set(runs["experiment"]) if len(runs) else set()
    for name in names:
        if name not in present:
            raise EmptyExperimentError(f"experiment {name!r} in {uri} has no runs")


def _runs_frame(rows: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=list(RUN_COLUMNS))
    for col in RUN_TAG_COLUMNS:
        frame[col] = frame[col].fillna("").astype(str)
    for col in ("start_time", "end_time"):
        frame[col] = pd.to_datetime(frame[col], unit="ms", utc=True)
    order = ["experiment", "algo", "model", "task", "seed", "run_id"]
    natural = lambda col: pd.to_numeric(col, errors="coerce") if col.name == "seed" else col  # noqa: E731
    return frame.sort_values(order, key=natural, ignore_index=True)


def _finite(values: np.ndarray, is_nan: np.ndarray) -> np.ndarray:
    values = np.where(is_nan, np.nan, values)  # (M,)
    values[values >= MAX_FLOAT] = np.inf
    values[values <= -MAX_FLOAT] = -np.inf
    return values


def _metrics_frame(run_id, step, key, value, timestamp) -> pd.DataFrame:
    """Tidy (run_id, step, metric, value); a (run, metric, step) logged twice keeps its latest value."""
    df = pd.DataFrame({"run_id": run_id, "step": step, "metric": key, "value": value, "ts": timestamp})
    dup = df.duplicated(["run_id", "metric", "step"], keep=False)
    if dup.any():
        df = df.sort_values("ts", kind="stable").drop_duplicates(["run_id", "metric", "step"], keep="last")
    df = df.drop(columns="ts").astype({"step": "int64", "value": "float64"})
    return df.sort_values(["run_id", "metric", "step"], ignore_index=True)


class SqliteReader:
    """MLflow's sqlite schema read with plain SQL over a read-only connection."""

    def __init__(self, uri: str, path: Path) -> None:
        if not path.is_file():
            raise StoreNotFoundError(f"tracking store not found: {path} (from tracking URI {uri!r})")
        self.uri, self.path = uri, path
        self.con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        tables = {r[0] for r in self.con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"experiments", "runs", "tags", "params", "metrics", "latest_metrics"} <= tables:
            raise StoreNotFoundError(f"{path} is not an MLflow tracking database (no 'runs'/'metrics' tables)")

    def experiments(self) -> dict[str, str]:
        """Active experiment name -> id."""
        rows = self.con.execute("SELECT name, experiment_id FROM experiments WHERE lifecycle_stage='active'")
        return {name: str(eid) for name, eid in rows}

    def run_counts(self) -> dict[str, int]:
        """Active experiment name -> number of active runs."""
        rows = self.con.execute(
            "SELECT e.name, COUNT(r.run_uuid) FROM experiments e LEFT JOIN runs r ON r.experiment_id = "
            "e.experiment_id AND r.lifecycle_stage='active' WHERE e.lifecycle_stage='active' GROUP BY e.name")
        return dict(rows.fetchall())

    def runs(self, names: Sequence[str]) -> pd.DataFrame:
        ids = _check_experiments(self.uri, names, self.experiments())
        q = ",".join("?" * len(ids))
        rows = self.con.execute(
            f"SELECT r.run_uuid, e.name, r.name, r.status, r.start_time, r.end_time FROM runs r "
            f"JOIN experiments e ON e.experiment_id = r.experiment_id "
            f"WHERE r.lifecycle_stage='active' AND r.experiment_id IN ({q})", [int(i) for i in ids]
        ).fetchall()
        run_ids = [r[0] for r in rows]
        tags = self._by_run("SELECT run_uuid, key, value FROM tags WHERE run_uuid IN ({}) AND key IN ({})",
                            run_ids, RUN_TAG_COLUMNS)
        latest = {rid: (n, s, t) for rid, n, s, t in self._chunked(
            "SELECT run_uuid, COUNT(*), MAX(step), MAX(timestamp) FROM latest_metrics WHERE run_uuid IN ({}) "
            "GROUP BY run_uuid", run_ids)}
        out = []
        for rid, exp, name, status, start, end in rows:
            t = tags.get(rid, {})
            fp = f"{status}|{end}|{latest.get(rid)}"
            out.append({"run_id": rid, "experiment": exp, "run_name": name or "", "status": status,
                        "start_time": start, "end_time": end, **{c: t.get(c, "") for c in RUN_TAG_COLUMNS},
                        "fingerprint": fp})
        frame = _runs_frame(out)
        _check_not_empty(self.uri, names, frame)
        return frame

    def params(self, run_ids: Sequence[str]) -> pd.DataFrame:
        rows = self._chunked("SELECT run_uuid, key, value FROM params WHERE run_uuid IN ({})", run_ids)
        return pd.DataFrame(rows, columns=["run_id", "key", "value"])

    def metrics(self, run_ids: Sequence[str]) -> pd.DataFrame:
        rows = self._chunked(
            "SELECT run_uuid, step, key, value, is_nan, timestamp FROM metrics WHERE run_uuid IN ({})", run_ids)
        if not rows:
            return _metrics_frame([], [], [], [], [])
        rid, step, key, value, is_nan, ts = zip(*rows)
        values = _finite(np.asarray(value, dtype=np.float64), np.asarray(is_nan, dtype=bool))
        return _metrics_frame(rid, step, key, values, ts)

    def _chunked(self, sql: str, run_ids: Sequence[str], size: int = 500) -> list[tuple]:
        out: list[tuple] = []
        for i in range(0, len(run_ids), size):
            chunk = list(run_ids[i:i + size])
            out += self.con.execute(sql.format(",".join("?" * len(chunk))), chunk).fetchall()
        return out

    def _by_run(self, sql: str, run_ids: Sequence[str], keys: Sequence[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for i in range(0, len(run_ids), 500):
            chunk = list(run_ids[i:i + 500])
            q = sql.format(",".join("?" * len(chunk)), ",".join("?" * len(keys)))
            for rid, k, v in self.con.execute(q, chunk + list(keys)):
                out.setdefault(rid, {})[k] = v
        return out


class ClientReader:
    """Any MLflow tracking URI through `MlflowClient` (REST server, file store, databricks, ...)."""

    def __init__(self, uri: str) -> None:
        import mlflow  # lazy: the sqlite path never needs it

        self.uri = uri
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self._latest: dict[str, list[str]] = {}

    def experiments(self) -> dict[str, str]:
        return {e.name: e.experiment_id for e in self.client.search_experiments()}

    def run_counts(self, cap: int = 1000) -> dict[str, int]:
        """Active experiment name -> number of active runs (counted up to `cap`)."""
        return {name: len(self.client.search_runs([eid], max_results=cap))
                for name, eid in self.experiments().items()}

    def runs(self, names: Sequence[str]) -> pd.DataFrame:
        ids = _check_experiments(self.uri, names, self.experiments())
        id_to_name = dict(zip(ids, names))
        out, token = [], None
        while True:
            page = self.client.search_runs(ids, max_results=1000, page_token=token)
            for run in page:
                info, data = run.info, run.data
                self._latest[info.run_id] = sorted(data.metrics)
                fp = f"{info.status}|{info.end_time}|{sorted(data.metrics.items())}"
                out.append({"run_id": info.run_id, "experiment": id_to_name[info.experiment_id],
                            "run_name": info.run_name or "", "status": info.status,
                            "start_time": info.start_time, "end_time": info.end_time,
                            **{c: data.tags.get(c, "") for c in RUN_TAG_COLUMNS}, "fingerprint": fp})
            token = page.token
            if not token:
                break
        frame = _runs_frame(out)
        _check_not_empty(self.uri, names, frame)
        return frame

    def params(self, run_ids: Sequence[str]) -> pd.DataFrame:
        rows = [(rid, k, v) for rid in run_ids for k, v in self.client.get_run(rid).data.params.items()]
        return pd.DataFrame(rows, columns=["run_id", "key", "value"])

    def metrics(self, run_ids: Sequence[str]) -> pd.DataFrame:
        cols: dict[str, list] = {"run_id": [], "step": [], "key": [], "value": [], "ts": []}
        for rid in run_ids:
            keys = self._latest.get(rid)
            if keys is None:
                keys = sorted(self.client.get_run(rid).data.metrics)
            for key in keys:
                for m in self.client.get_metric_history(rid, key):
                    for col, v in zip(cols, (rid, m.step, key, m.value, m.timestamp)):
                        cols[col].append(v)
        values = np.asarray(cols["value"], dtype=np.float64)
        values = _finite(values, np.isnan(values))
        return _metrics_frame(cols["run_id"], cols["step"], cols["key"], values, cols["ts"])
