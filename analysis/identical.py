"""Identical runs: runs that are one training run, logged more than once.

Two presets can be the same algorithm at a setting (at one update per batch ppo ≡ s_ppo: λ = 1
when nothing is clipped; turn_ppo ≡ st_ppo ≡ so_ppo), and then a seed of each trains the same
policy step for step. Counted as separate replicates, one collapse becomes two or three. A run's
*unit* is the set of runs with its model, task and seed whose outcome series are equal bit for
bit at every step; every count, interval, test, contrast and cross-validation fold of analysis
counts a unit once.

Outcome series (`TRAJECTORY_METRICS`): the rollouts' success, response length, turns, searches
and valid-action share at every step, the live checks and the validation — functions of the
sampled and greedy token ids. Two runs equal in all of them sampled the same tokens at every
step and scored the same on every validation: their weights differ at most by rounding, which
float diagnostics (entropy, gradient norm, KL) can show when two presets compute the same loss in
another order (grpo ≡ so_grpo ≡ sspo at one update per batch), and which changes no outcome. A
run that logs none of them is its own unit. A unit is named by its first run id in sorted order.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from stppo import metric_names as T

from .load import Study

TRAJECTORY_METRICS: tuple[str, ...] = (
    T.SUCCESS_RATE, T.RESPONSE_LENGTH_MEAN, T.NUM_TURNS_MEAN, T.NUM_SEARCHES_MEAN, T.VALID_ACTION_RATIO,
    T.VAL_SUCCESS_RATE, T.VAL_LIVE_SUCCESS_RATE,
)
KEY_COLUMNS = ("model", "task", "seed")


def fingerprints(study: Study) -> pd.Series:
    """run_id → a hash of its trajectory series (metric, step, value bits), or of its run id when
    it logs none."""
    m = study.metrics
    sub = m[m["metric"].isin(TRAJECTORY_METRICS)]
    out = {}
    for rid, grp in sub.groupby("run_id", observed=True, sort=False):
        g = grp.sort_values(["metric", "step"], kind="stable")
        h = hashlib.sha256()
        h.update("\x00".join(g["metric"].astype(str)).encode())
        h.update(g["step"].to_numpy(np.int64).tobytes())
        h.update(g["value"].to_numpy(np.float64).tobytes())
        out[str(rid)] = h.hexdigest()
    ids = study.runs["run_id"].astype(str)
    return pd.Series([out.get(r, "run:" + r) for r in ids], index=ids, name="fingerprint")


def unit_column(study: Study) -> pd.Series:
    """run_id → its unit (module docstring)."""
    runs = study.runs.assign(run_id=study.runs["run_id"].astype(str))
    key = runs[list(KEY_COLUMNS)].astype(str).agg("\x00".join, axis=1) + "\x00" + \
        runs["run_id"].map(fingerprints(study))
    first = runs.groupby(key.to_numpy())["run_id"].transform("min")
    return pd.Series(first.to_numpy(), index=runs["run_id"].to_numpy(), name="unit")


def one_per_unit(study: Study) -> Study:
    """The study with one run per unit (the unit's first run in sorted id order): what per-run
    analyses that pool runs (the early-warning tables, their cross-validation) read."""
    unit = unit_column(study)
    return study.only(sorted(set(unit)))


def merged_units(runs: pd.DataFrame) -> pd.DataFrame:
    """The units of more than one run in a per-run table with `unit`, `algo`, `seed` (and
    whatever else it has): one row per unit — its runs' presets, the number of runs, and the
    experiment(s) and seed."""
    cols = [c for c in ("experiment", "model", "seed", "lag", "lag_mode") if c in runs.columns]
    many = runs[runs.duplicated("unit", keep=False)]
    if many.empty:
        return pd.DataFrame(columns=["unit", *cols, "runs", "presets"])
    rows = []
    for unit, grp in many.groupby("unit", sort=True):
        first = grp.iloc[0]
        rows.append({"unit": unit, **{c: first[c] for c in cols}, "runs": len(grp),
                     "presets": " ≡ ".join(sorted(grp["algo"].astype(str)))})
    return pd.DataFrame(rows)


def once(runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` with each unit once (its first row); a table without `unit` is one unit per run."""
    return runs.drop_duplicates("unit", keep="first") if "unit" in runs.columns else runs


def apart(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Two groups of runs to compare, each unit once, less the units in both groups (the same
    training run on both sides says nothing about a difference, and would make the two samples
    dependent); and how many units were left out that way."""
    a, b = once(a), once(b)
    if "unit" not in a.columns or "unit" not in b.columns:
        return a, b, 0
    both = set(a["unit"]) & set(b["unit"])
    return a[~a["unit"].isin(both)], b[~b["unit"].isin(both)], len(both)
