"""Sampled trajectories of a run: the MLflow table artifacts `samples/step_{step:06d}.json` the trainer
logs every `diagnostics.samples_every` steps and at the detected collapse (one row per segment of a
trajectory, columns `stppo.metric_names.SAMPLE_COLUMNS`), read through `mlflow.MlflowClient`, so any
artifact store MLflow reaches works (local folders, a tracking server's proxied artifacts, S3 ...).

Every store problem ends in one line (`AnalysisError`).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Sequence

import pandas as pd

from stppo import metric_names as T

from .store import AnalysisError, open_reader

STEP_FILE = re.compile(r"^step_(\d+)\.json$")
INT_COLUMNS = ("step", "sample", "segment", "turn", "collapse_step")
FLOAT_COLUMNS = ("reward", "ratio_mean", "ratio_max", "advantage_mean")


class SamplesError(AnalysisError, ValueError):
    pass


def _client(uri: str):
    open_reader(uri)  # one-line errors for a missing file or an unreachable server, before MLflow retries
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no tqdm bars in logs or pages
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def saved_steps(uri: str, run_id: str) -> list[int]:
    """The steps with a samples table in the run's artifacts, sorted (empty when none)."""
    client = _client(uri)
    try:
        files = client.list_artifacts(run_id, T.SAMPLES_DIR)
    except Exception as e:  # noqa: BLE001 - MLflow raises many kinds; the user needs the line
        raise SamplesError(f"cannot list the samples of run {run_id} on {uri}: {_first_line(e)}") from None
    steps = [int(m.group(1)) for f in files if (m := STEP_FILE.match(Path(f.path).name))]
    return sorted(set(steps))


def load_samples(uri: str, run_id: str, step: int) -> pd.DataFrame:
    """The samples table of `run_id` at `step`: columns SAMPLE_COLUMNS, rows sorted by (sample,
    segment); integers as int, floats with NaN where the table has null."""
    client = _client(uri)
    name = T.samples_artifact(step)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, name, tmp)
            table = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise SamplesError(f"{name} of run {run_id} is not JSON: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise SamplesError(f"cannot read {name} of run {run_id} on {uri}: {_first_line(e)}") from None
    return samples_frame(table, f"{name} of run {run_id}")


def samples_frame(table: dict, where: str = "samples table") -> pd.DataFrame:
    """A `log_table` JSON ({"columns": [...], "data": [[...], ...]}) as a typed frame."""
    if not isinstance(table, dict) or "columns" not in table or "data" not in table:
        raise SamplesError(f"{where} is not an MLflow table (needs 'columns' and 'data')")
    frame = pd.DataFrame(table["data"], columns=table["columns"])
    missing = [c for c in T.SAMPLE_COLUMNS if c not in frame.columns]
    if missing:
        raise SamplesError(f"{where} lacks the columns {', '.join(missing)}")
    frame = frame[list(T.SAMPLE_COLUMNS)].copy()
    for col in FLOAT_COLUMNS:
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("float64")
    for col in INT_COLUMNS:
        frame[col] = pd.to_numeric(frame[col], errors="coerce").fillna(-1).astype("int64")
    for col in ("question", "answers", "role", "text", "action"):
        frame[col] = frame[col].fillna("").astype(str)
    return frame.sort_values(["sample", "segment"], ignore_index=True)


def default_step(steps: Sequence[int], collapse_step: float | None) -> int | None:
    """The saved step to show first: the one nearest the collapse step (the later one on a tie, which
    shows the collapse), else the last; None when nothing was saved."""
    if not steps:
        return None
    if collapse_step is None or not math.isfinite(collapse_step):
        return max(steps)
    return min(steps, key=lambda s: (abs(s - collapse_step), -s))


def trajectories(frame: pd.DataFrame) -> list[dict]:
    """One dict per sample: question, answers, reward, and its segments (dicts) in order."""
    out = []
    for sample, grp in frame.groupby("sample", sort=True):
        first = grp.iloc[0]
        out.append({"sample": int(sample), "question": first["question"], "answers": first["answers"],
                    "reward": float(first["reward"]), "step": int(first["step"]),
                    "collapse_step": int(first["collapse_step"]),
                    "segments": grp.sort_values("segment").to_dict("records")})
    return out
