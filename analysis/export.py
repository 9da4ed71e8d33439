"""A study's runs as parquet files, and back: so a study split over machines or sessions can be
finished and analysed together without the MLflow store it was run in.

    python -m analysis.export --experiment frontier_l1 [--experiment …] --out DIR [--tracking-uri URI …]
        [--finished-only] [--with-exported DIR …]

writes DIR/runs.parquet (one row per run: tags, status, collapse settings), DIR/metrics.parquet
(the tidy frame of `load_study`: run_id, experiment, algo, model, task, seed, status, step, metric,
value) and DIR/params.parquet (run_id, key, value). `load_exported(DIR, …)` reads one or more such
folders into a `Study` (runs of the same id are taken once), which `analysis.report --parquet DIR`
and every table and figure function accept like a study loaded from MLflow. Several
`--tracking-uri`s (the per-run stores of a study run elsewhere, scripts/staleness_gpu.sh) are
merged into one folder; `--finished-only` leaves out runs that did not finish (killed at a
deadline). `--with-exported DIR` adds the runs of folders exported before (a study continued on
another machine, whose earlier store is gone); DIR may be `--out` itself, which is read before it is
written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from stppo.tracker import resolve_uri

from .load import Study, list_experiments, load_study, with_collapse_settings
from .store import AnalysisError

FILES = ("runs", "metrics", "params")
PARQUET_URI = "parquet:"


def export_study(study: Study, out: str | Path) -> dict[str, Path]:
    """Write the study's runs, metrics and params to `out` (zstd parquet); returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in FILES:
        frame = getattr(study, name)
        paths[name] = out / f"{name}.parquet"
        frame.to_parquet(paths[name], index=False, compression="zstd")
    return paths


def load_exported(folders: str | Path | Sequence[str | Path],
                  experiments: Sequence[str] | None = None) -> Study:
    """A Study from exported folders (optionally only some experiments). A missing folder or file
    is one `AnalysisError` line."""
    folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
    return _merge(_read_folders(folders), PARQUET_URI + ",".join(map(str, folders)), experiments)


def _read_folders(folders: Sequence[str | Path]) -> dict[str, list[pd.DataFrame]]:
    """The runs, metrics and params frames of exported folders, as `_merge`'s parts."""
    parts = {name: [] for name in FILES}
    for folder in map(Path, folders):
        for name in FILES:
            path = folder / f"{name}.parquet"
            if not path.is_file():
                raise AnalysisError(f"{path} does not exist: export a study there with "
                                    "`python -m analysis.export --experiment NAME --out DIR`")
            parts[name].append(pd.read_parquet(path))
    return parts


def _merge(parts: dict[str, list[pd.DataFrame]], uri: str, experiments: Sequence[str] | None = None) -> Study:
    """One Study from the runs, metrics and params frames of several parts (a run in several is
    taken once, from the last), optionally only some experiments; no run is one `AnalysisError`."""
    runs = pd.concat(parts["runs"], ignore_index=True).drop_duplicates("run_id", keep="last")
    if experiments:
        runs = runs[runs["experiment"].astype(str).isin(list(experiments))]
    if runs.empty:
        raise AnalysisError(f"no runs of {', '.join(experiments or ['any experiment'])} in {uri}")
    keep = set(runs["run_id"].astype(str))
    metrics = pd.concat([m.astype({c: str for c in m.columns if isinstance(m[c].dtype, pd.CategoricalDtype)})
                         for m in parts["metrics"]], ignore_index=True)
    metrics = metrics[metrics["run_id"].isin(keep)].drop_duplicates(["run_id", "metric", "step"], keep="last")
    params = pd.concat(parts["params"], ignore_index=True)
    params = params[params["run_id"].isin(keep)].drop_duplicates(["run_id", "key"], keep="last")
    names = tuple(dict.fromkeys(runs["experiment"].astype(str)))
    # each run's collapse rule from its params (folders exported before the live rule carry the
    # sampled rule's settings only)
    runs = with_collapse_settings(runs.drop(columns=[c for c in runs.columns if c.startswith("collapse_")]), params)
    for col in ("run_id", "experiment", "algo", "model", "task", "seed", "status", "metric"):
        metrics[col] = metrics[col].astype("category")
    metrics = metrics.sort_values(["run_id", "metric", "step"], ignore_index=True)
    return Study(uri, names, runs.reset_index(drop=True), metrics, params.reset_index(drop=True))


def merge_stores(experiments: Sequence[str], uris: Sequence[str], *, finished_only: bool = False,
                 exported: Sequence[str | Path] = ()) -> Study:
    """One Study of `experiments` from several MLflow stores, each store giving those of them it
    holds (a store holding none is skipped; none holding any is one `AnalysisError` line; a store
    that does not exist is an error), and from folders exported before (`exported`: their runs of
    `experiments`; a run also in a store is taken from the store); `finished_only` keeps the
    FINISHED runs."""
    parts = _read_folders(exported)
    for uri in uris:
        held = [e for e in dict.fromkeys(experiments) if e in list_experiments(uri)]
        if not held:
            continue
        study = load_study(held, uri)
        if finished_only:
            study = study.only(study.runs.loc[study.runs["status"].astype(str) == "FINISHED", "run_id"])
        if study.runs.empty:
            continue
        for name in FILES:
            parts[name].append(getattr(study, name))
    if not parts["runs"]:
        raise AnalysisError(f"no {'finished ' if finished_only else ''}runs of "
                            f"{', '.join(experiments)} in {len(uris)} store(s)")
    sources = list(uris) + [PARQUET_URI + str(f) for f in exported]
    return _merge(parts, ",".join(sources), experiments)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.export", description=__doc__.splitlines()[0])
    p.add_argument("--experiment", action="append", required=True, help="MLflow experiment (repeatable)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--tracking-uri", action="append", default=None,
                   help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db; repeat to merge stores")
    p.add_argument("--finished-only", action="store_true", help="leave out runs that did not finish")
    p.add_argument("--with-exported", action="append", default=[], metavar="DIR",
                   help="a folder exported before whose runs join the store's (repeatable; may be --out)")
    a = p.parse_args(argv)
    try:
        uris = [resolve_uri(u) for u in (a.tracking_uri or [None])]
        if a.with_exported:
            study = merge_stores(a.experiment, uris, finished_only=a.finished_only, exported=a.with_exported)
        elif len(uris) == 1 and not a.finished_only:
            study = load_study(a.experiment, uris[0])
        else:
            study = merge_stores(a.experiment, uris, finished_only=a.finished_only)
        paths = export_study(study, a.out)
    except AnalysisError as e:
        print(f"python -m analysis.export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {len(study.runs)} runs ({len(study.metrics)} values) to {Path(a.out)}: "
          f"{', '.join(p.name for p in paths.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
