"""MLflow runs -> one tidy frame, with a parquet cache of unchanged runs.

`load_study(experiments, tracking_uri)` returns a `Study`:
* `metrics` — tidy, one row per logged value:
  (run_id, experiment, algo, model, task, seed, status, step, metric, value), categorical strings;
* `runs` — one row per run: tags, status, start/end, its collapse rule (`collapse_rule`: `live`,
  or `sampled` for runs from before the live checks, whose params name the sampled-success rule)
  and that rule's settings (`collapse_*` columns);
* `params` — long (run_id, key, value) of every logged parameter.
The run list, tags and params are always read fresh (cheap). Each run's metrics are cached as
`<cache>/analysis/<hash of URI>/<run_id>-<hash of fingerprint>.parquet`, where the fingerprint is the
run's status, end time and latest-metric summary (count, max step, max timestamp on sqlite; the
latest values otherwise): a run that logs anything new or changes status is re-read, others never.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stppo.config import param_names as P
from stppo.cache import cache_dir, content_hash
from stppo.diagnostics import CollapseConfig, SampledCollapseConfig

from .store import open_reader

CACHE_VERSION = "1"
ID_COLUMNS: tuple[str, ...] = ("run_id", "experiment", "algo", "model", "task", "seed", "status")
TIDY_COLUMNS: tuple[str, ...] = (*ID_COLUMNS, "step", "metric", "value")
# A run's collapse rule from its params (`trainer.collapse.*`, docs/design.md §4): `rule` and the
# live rule's fields, the sampled rule's under `trainer.collapse.sampled.`; runs from before the
# live checks (studies v2, v3) have no `rule` and the sampled rule's fields directly under
# `trainer.collapse.` (their `ema` tells them apart).
COLLAPSE_PREFIX = P.COLLAPSE
LIVE_FIELDS: tuple[str, ...] = ("every", "questions", "drop", "min_peak", "patience", "nonfinite_patience")
SAMPLED_FIELDS: tuple[str, ...] = tuple(SampledCollapseConfig.__dataclass_fields__)
INT_FIELDS = ("every", "questions", "patience", "nonfinite_patience")

@dataclass
class Study:
    uri: str
    experiments: tuple[str, ...]
    runs: pd.DataFrame
    metrics: pd.DataFrame
    params: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["run_id", "key", "value"]))

    def metric_names(self) -> list[str]:
        return sorted(self.metrics["metric"].astype(str).unique())

    def only(self, run_ids) -> "Study":
        """The study restricted to the runs `run_ids` (their metrics and params; experiments as
        the kept runs name them, in order)."""
        ids = {str(i) for i in run_ids}

        def mine(frame: pd.DataFrame) -> pd.DataFrame:
            return frame[frame["run_id"].astype(str).isin(ids)]

        runs = mine(self.runs)
        return Study(self.uri, tuple(dict.fromkeys(runs["experiment"].astype(str))), runs, mine(self.metrics),
                     mine(self.params))

    def run(self, run_id: str) -> pd.Series:
        rows = self.runs[self.runs["run_id"] == run_id]
        if rows.empty:
            raise ValueError(f"run_id {run_id!r} is not in experiments {', '.join(self.experiments)}")
        return rows.iloc[0]


def list_experiments(tracking_uri: str) -> dict[str, int]:
    """Active experiments of a store, name -> number of runs, sorted by name (e.g. for a picker)."""
    return dict(sorted(open_reader(tracking_uri).run_counts().items()))


def load_study(experiments: str | Sequence[str], tracking_uri: str, *, use_cache: bool = True) -> Study:
    """Load every run of `experiments` (names) from `tracking_uri` (see the module docstring)."""
    names = (experiments,) if isinstance(experiments, str) else tuple(dict.fromkeys(experiments))
    reader = open_reader(tracking_uri)
    runs = reader.runs(names)
    params = reader.params(list(runs["run_id"]))
    runs = with_collapse_settings(runs, params)
    if use_cache:
        per_run = _cached_metrics(reader, runs, cache_dir("analysis", content_hash(tracking_uri.strip())))
    else:
        per_run = reader.metrics(list(runs["run_id"]))
    return Study(tracking_uri, names, runs, _tidy(per_run, runs), params)


def with_collapse_settings(runs: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """Columns `collapse_rule`, `collapse_<field>` (the live rule's fields and the non-finite
    patience) and `sampled_<field>` (the sampled rule's) per run, from its params, else the
    defaults (comment above)."""
    runs = runs.copy()
    mine = params[params["key"].str.startswith(COLLAPSE_PREFIX)]
    table = mine.drop_duplicates(["run_id", "key"], keep="last").pivot(index="run_id", columns="key",
                                                                      values="value")
    ids = runs["run_id"].astype(str)
    table.index = table.index.astype(str)
    table = table.reindex(ids)

    def column(key: str) -> pd.Series:
        return table[key] if key in table.columns else pd.Series(None, index=table.index, dtype=object)

    legacy = column(COLLAPSE_PREFIX + "rule").isna() & column(COLLAPSE_PREFIX + "ema").notna()
    rule = column(COLLAPSE_PREFIX + "rule").fillna("live").where(~legacy, "sampled")
    runs["collapse_rule"] = rule.to_numpy()
    live, sampled = CollapseConfig(), SampledCollapseConfig()
    for name in LIVE_FIELDS:
        values = pd.to_numeric(column(COLLAPSE_PREFIX + name), errors="coerce")
        if name != "nonfinite_patience":  # (legacy runs' drop, min_peak, patience are the sampled rule's)
            values = values.where(~legacy)
        runs[f"collapse_{name}"] = values.fillna(float(getattr(live, name))).to_numpy()
    for name in SAMPLED_FIELDS:
        values = pd.to_numeric(column(COLLAPSE_PREFIX + "sampled." + name), errors="coerce")
        values = values.where(~legacy, pd.to_numeric(column(COLLAPSE_PREFIX + name), errors="coerce"))
        runs[f"sampled_{name}"] = values.fillna(float(getattr(sampled, name))).to_numpy()
    return runs


def collapse_config(run: pd.Series) -> CollapseConfig:
    """The run's collapse rule with its settings, from the columns `with_collapse_settings` adds."""
    def num(col: str, name: str):
        v = float(run[col])
        return int(v) if name in INT_FIELDS else v

    sampled = SampledCollapseConfig(**{n: num(f"sampled_{n}", n) for n in SAMPLED_FIELDS})
    return CollapseConfig(rule=str(run.get("collapse_rule", "live")), sampled=sampled,
                          **{n: num(f"collapse_{n}", n) for n in LIVE_FIELDS})


def _cache_file(root: Path, run_id: str, fingerprint: str) -> Path:
    return root / f"{run_id}-{content_hash(CACHE_VERSION, fingerprint)}.parquet"


def _cached_metrics(reader, runs: pd.DataFrame, root: Path) -> pd.DataFrame:
    """Per-run metrics: cached files for unchanged runs, one store read for the rest."""
    files = {rid: _cache_file(root, rid, fp) for rid, fp in zip(runs["run_id"], runs["fingerprint"])}
    stale = [rid for rid, f in files.items() if not f.is_file()]
    parts: list[pd.DataFrame] = []
    if stale:
        fresh = reader.metrics(stale)
        for rid, frame in fresh.groupby("run_id", sort=False, observed=True):
            _write(files[rid], frame.drop(columns="run_id"))
        for rid in set(stale) - set(fresh["run_id"]):
            _write(files[rid], fresh.iloc[:0].drop(columns="run_id"))  # a run without metrics
        parts.append(fresh)
    cached = [rid for rid in files if rid not in set(stale)]
    parts += [_read(files[rid], rid) for rid in cached]
    return pd.concat(parts, ignore_index=True) if parts else reader.metrics([])


def _write(path: Path, frame: pd.DataFrame) -> None:
    for old in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.parquet"):
        old.unlink(missing_ok=True)  # an older fingerprint of the same run
    table = pa.table({"step": frame["step"].to_numpy("int64"),
                      "metric": pa.array(frame["metric"].astype(str)).dictionary_encode(),
                      "value": frame["value"].to_numpy("float64")})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    pq.write_table(table, tmp)
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file


def _read(path: Path, run_id: str) -> pd.DataFrame:
    frame = pq.read_table(path).to_pandas()
    frame.insert(0, "run_id", run_id)
    return frame


def _tidy(per_run: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Attach run attributes; strings become categoricals (a 50×500×40 study is 1M rows)."""
    run_codes = pd.Categorical(per_run["run_id"], categories=list(runs["run_id"])).codes  # (M,)
    out = pd.DataFrame({"run_id": pd.Categorical.from_codes(run_codes, categories=list(runs["run_id"]))})
    for col in ID_COLUMNS[1:]:
        cats = _categories(runs[col].astype(str))
        per_run_code = pd.Categorical(runs[col].astype(str), categories=cats).codes  # (R,)
        out[col] = pd.Categorical.from_codes(per_run_code[run_codes], categories=cats)
    out["step"] = per_run["step"].to_numpy()
    out["metric"] = per_run["metric"].astype("category").values
    out["value"] = per_run["value"].to_numpy()
    out = out[list(TIDY_COLUMNS)].astype({"step": "int64", "value": "float64"})
    return out.sort_values(["run_id", "metric", "step"], ignore_index=True)


def _categories(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))
