"""The critic warm-start comparison of a frontier study (docs/results/frontier/README.md): per cell
(level, GAE preset), or (x, preset) of any axis of `analysis.axes.AXES`, the runs with
`trainer.critic_warmstart` against the same cell's runs without it: collapse counts (Fisher's
exact test), the warm start's held-out explained variance before and after its fit, the mean over
training steps of `critic/vf_explained_var`, and final success.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import scipy.stats as sps

from stppo import metric_names as T

from ..axes import as_tuple, axis_names
from ..stats import finite_mean
from ..tables import per_run_value


def _with_explained_variance(study, runs: pd.DataFrame) -> pd.DataFrame:
    ev = {col: per_run_value(study, key, how) for col, key, how in (
        ("ev_before", T.CRITIC_WS_EV_BEFORE, "last"), ("ev_after", T.CRITIC_WS_EV_AFTER, "last"),
        ("ev_train", T.VF_EXPLAINED_VAR, "mean"))}
    return runs.assign(**{col: runs["run_id"].map(v) for col, v in ev.items()})


def _warm_vs_cold(w: pd.DataFrame, base: pd.DataFrame) -> dict:
    """The critic.csv columns of warm-started runs `w` against the runs `base` without it."""
    kw, nw, kb, nb = int(w["collapsed"].sum()), len(w), int(base["collapsed"].sum()), len(base)
    p = float(sps.fisher_exact([[kw, nw - kw], [kb, nb - kb]])[1]) if nb else float("nan")
    return {"collapsed_warm": f"{kw}/{nw}", "collapsed_cold": f"{kb}/{nb}", "fisher_p": p,
            "ws_ev_before": finite_mean(w["ev_before"]), "ws_ev_after": finite_mean(w["ev_after"]),
            "train_ev_warm": finite_mean(w["ev_train"]), "train_ev_cold": finite_mean(base["ev_train"]),
            "final_success_warm": finite_mean(w["final_success"]),
            "final_success_cold": finite_mean(base["final_success"])}


def critic_table(study, runs: pd.DataFrame, *, prefix: str = "frontier_",
                 warm_prefix: str = "critic_ws_") -> pd.DataFrame:
    """One row per (level, algo) that has warm-started runs: with vs without the critic warm start
    (module docstring). `runs` is `per_run_table(study)` over both kinds of experiments."""
    runs = _with_explained_variance(study, runs)
    rows = []
    warm = runs[runs["experiment"].str.startswith(warm_prefix)]
    for (exp, algo), w in warm.groupby(["experiment", "algo"], sort=True):
        level = exp[len(warm_prefix):]
        base = runs[(runs["experiment"] == prefix + level) & (runs["algo"] == algo)]
        rows.append({"level": prefix + level, "algo": algo, **_warm_vs_cold(w, base)})
    return pd.DataFrame(rows)


def critic_table_by(study, runs: pd.DataFrame, *, x: Sequence[str], prefix: str = "frontier_",
                    warm_prefix: str = "critic_ws_") -> pd.DataFrame:
    """`critic_table` over the cells (x, algo) of any axis: the runs with `critic_warmstart`
    (`analysis.axes.with_axes`: the param, or an experiment `critic_ws_<level>`, which counts
    as level `prefix + <level>`) against the other runs of the same cell."""
    runs = _with_explained_variance(study, runs)
    exp = runs["experiment"].astype(str)
    warm_exp = exp.str.startswith(warm_prefix)
    runs = runs.assign(experiment=exp.where(~warm_exp, prefix + exp.str[len(warm_prefix):]))
    cold, keys, rows = runs[~runs["critic_warmstart"]], [*x, "algo"], []
    for key, w in runs[runs["critic_warmstart"]].groupby(keys, sort=True):
        values = as_tuple(key)
        same = np.logical_and.reduce([(cold[c] == v).to_numpy() for c, v in zip(keys, values)])
        rows.append({**dict(zip(axis_names(keys), values)), **_warm_vs_cold(w, cold[same])})
    return pd.DataFrame(rows)
