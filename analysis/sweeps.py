"""Optuna sweeps (clip ranges, correction τ): trials as a table and parameters against the objective.

`python -m analysis.sweeps --study NAME [--study NAME2] --out DIR [--storage URL]` writes, per
study, `<study>_trials.csv`, `<study>_optimum.json` (`sweep_optimum`) and `<study>.png/pdf`.

A pruned trial has no final value; its objective here is its last reported intermediate value,
and it is marked (`pruned` column, grey crosses in the figure). Optuna is imported lazily.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .store import AnalysisError, StoreNotFoundError, sqlite_path

DEFAULT_STORAGE = "sqlite:///optuna.db"


def _storage(url: str):
    import optuna

    url = url.strip()
    path = sqlite_path(url) if url.startswith("sqlite:") else None
    if path is not None and not path.is_file():
        raise StoreNotFoundError(
            f"Optuna storage not found: {path} (from {url!r}); run a sweep first or fix the URL")
    try:
        return optuna.storages.RDBStorage(url, skip_table_creation=True)
    except Exception as e:  # noqa: BLE001 - any driver error becomes one line
        raise AnalysisError(f"cannot open Optuna storage {url!r}: {str(e).splitlines()[0]}") from None


def list_sweeps(storage_url: str = DEFAULT_STORAGE) -> list[str]:
    """Names of the studies in an Optuna storage, sorted."""
    import optuna

    try:
        return sorted(optuna.get_all_study_names(_storage(storage_url)))
    except AnalysisError:
        raise
    except Exception as e:  # noqa: BLE001
        raise AnalysisError(f"cannot read Optuna storage {storage_url!r}: {str(e).splitlines()[0]}") from None


def trials_frame(storage_url: str, study_name: str) -> pd.DataFrame:
    """One row per trial: number, state, objective, pruned, params (`param:<name>` columns),
    mlflow_run_id (user attr, when set), direction."""
    import optuna

    names = list_sweeps(storage_url)
    if study_name not in names:
        raise AnalysisError(f"Optuna study {study_name!r} not found in {storage_url}; "
                            f"available: {', '.join(names) or 'none'}")
    study = optuna.load_study(study_name=study_name, storage=_storage(storage_url))
    direction = study.directions[0].name.lower()
    rows = []
    for t in study.trials:
        objective = t.values[0] if t.values else _last_intermediate(t.intermediate_values)
        rows.append({"number": t.number, "state": t.state.name, "objective": objective,
                     "pruned": t.state == optuna.trial.TrialState.PRUNED,
                     "mlflow_run_id": t.user_attrs.get("mlflow_run_id", ""), "direction": direction,
                     **{f"param:{k}": v for k, v in t.params.items()}})
    return pd.DataFrame(rows)


def sweep_optimum(trials: pd.DataFrame, *, tolerance: float = 0.02) -> dict:
    """The best completed trial and how flat the optimum is: its objective and parameters, the
    number of completed trials within `tolerance` of it (and the range of each parameter over
    them: a wide range is a flat optimum), the spread of the top five, and the pruned count."""
    done = trials[(trials["state"] == "COMPLETE") & np.isfinite(trials["objective"].astype(float))]
    if done.empty:
        return {"completed": 0, "pruned": int(trials["pruned"].sum()), "trials": len(trials)}
    sign = -1.0 if (done["direction"].iloc[0] == "minimize") else 1.0
    order = done.assign(_o=sign * done["objective"].astype(float)).sort_values("_o", ascending=False)
    best = order.iloc[0]
    near = order[(sign * (order["objective"] - best["objective"])) >= -tolerance]
    out = {"trials": len(trials), "completed": len(done), "pruned": int(trials["pruned"].sum()),
           "best_trial": int(best["number"]), "best_objective": float(best["objective"]),
           "top5_spread": float(order["objective"].head(5).max() - order["objective"].head(5).min()),
           f"within_{tolerance:g}": len(near)}
    for col in param_columns(trials):
        name = col.split(":", 1)[1]
        out[f"best {name}"] = best[col]
        vals = near[col].astype(float)
        out[f"{name} range within {tolerance:g}"] = f"[{vals.min():.3g}, {vals.max():.3g}]"
    return out


def _last_intermediate(values: dict[int, float]) -> float:
    return float(values[max(values)]) if values else math.nan


def param_columns(trials: pd.DataFrame) -> list[str]:
    return [c for c in trials.columns if c.startswith("param:")]


def fig_sweep(trials: pd.DataFrame, *, params: Sequence[str] | None = None, objective: str = "objective",
              title: str = "") -> Figure:
    """One panel per parameter: objective against the parameter's value; completed trials as dots,
    pruned ones as grey crosses, the best completed trial as a star."""
    cols = list(params) if params else param_columns(trials)
    n = max(1, len(cols))
    ncols = min(3, n)
    fig = Figure(figsize=(4.6 * ncols, 3.4 * -(-n // ncols)), layout="constrained")
    if not cols:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no trial parameters", ha="center", va="center", transform=ax.transAxes)
        return fig
    done = trials[~trials["pruned"] & trials["state"].eq("COMPLETE")]
    best = None
    if len(done):
        maximize = str(trials["direction"].iloc[0]) == "maximize"
        best = done.loc[done[objective].idxmax() if maximize else done[objective].idxmin()]
    for i, col in enumerate(cols):
        ax = fig.add_subplot(-(-n // ncols), ncols, i + 1)
        x_all, is_num = _axis_values(trials[col])
        pr = trials["pruned"].to_numpy()
        ok = trials["state"].eq("COMPLETE").to_numpy()
        ax.scatter(x_all[ok], trials.loc[ok, objective], s=22, color="tab:blue", label="complete")
        ax.scatter(x_all[pr], trials.loc[pr, objective], s=26, marker="x", color="0.55",
                   label="pruned (last report)")
        if best is not None:
            ax.scatter(x_all[trials.index.get_loc(best.name)], best[objective], s=120, marker="*",
                       color="tab:red", label=f"best (trial {int(best['number'])})", zorder=3)
        if not is_num:
            cats = list(dict.fromkeys(trials[col].astype(str)))
            ax.set_xticks(range(len(cats)), cats, rotation=30, fontsize=7)
        ax.set_xlabel(col.removeprefix("param:"))
        ax.set_ylabel(objective)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "trials: parameter vs objective", fontsize=11)
    return fig


def _axis_values(col: pd.Series) -> tuple[np.ndarray, bool]:
    num = pd.to_numeric(col, errors="coerce")
    if (num.notna() | col.isna()).all():  # a conditional parameter may be unset in some trials
        return num.to_numpy(dtype=float), True
    cats = list(dict.fromkeys(col.astype(str)))
    return col.astype(str).map({c: i for i, c in enumerate(cats)}).to_numpy(dtype=float), False


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.sweeps",
                                description="Trials, optimum and figure of Optuna sweeps.")
    p.add_argument("--study", action="append", required=True, help="Optuna study name (repeatable)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--storage", default=DEFAULT_STORAGE, help=f"Optuna storage URL (default {DEFAULT_STORAGE})")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="objective distance from the best that counts as near-optimal (default 0.02)")
    a = p.parse_args(argv)
    try:
        frames = {name: trials_frame(a.storage, name) for name in a.study}
    except AnalysisError as e:
        print(f"analysis.sweeps: error: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for name, trials in frames.items():
        trials.to_csv(a.out / f"{name}_trials.csv", index=False)
        best = sweep_optimum(trials, tolerance=a.tolerance)
        (a.out / f"{name}_optimum.json").write_text(json.dumps(best, indent=2, default=str) + "\n")
        fig = fig_sweep(trials, title=name)
        for ext in ("png", "pdf"):
            fig.savefig(a.out / f"{name}.{ext}", dpi=110)
        print(f"{name}: {best.get('completed', 0)}/{len(trials)} trials completed, best objective "
              f"{best.get('best_objective', float('nan')):.3f} (trial {best.get('best_trial', '-')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
