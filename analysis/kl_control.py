"""Stabilised, or only slowed? The KL-matched control (docs/design.md §4, "KL-matched control").

A stabiliser X that collapses less than the plain preset P at the same learning rate may only
move the policy less per step: P at a smaller learning rate might be as stable. So X is also
compared with P at a matched per-step KL. Per run, its step KL is the mean over its steps of
`actor/step_kl` (KL(π before ‖ π after) of each update); a group's step KL is the mean over its
units. In each cell of the other settings (`x`: experiment, lag, model, …), P's runs at several
learning rates form a ladder; X's group is paired with the rung whose step KL is nearest X's in
log space. A pair whose step KLs differ by more than `max_ratio` (default 2) either way is not
matched: the ladder does not reach X's step KL, and the row says so instead of extrapolating.

Per pair: both groups' collapse counts (units once, `identical.apart`) and Fisher's exact test,
mean final success and mean area under the validation curve with Welch's t-tests, and the same
against P at X's own learning rate where the ladder has it. Reading: fewer collapses than both
P rows — more stable; fewer than P at its own learning rate only — it moves less.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from stppo.config import param_names as P

from .group_tests import two_group_tests
from .identical import once
from .params import param_column
from .stats import finite_mean, welch_test

KL_MATCH_COLUMNS = (
    "stabiliser", "plain", "lr", "step_kl", "matched_lr", "matched_step_kl", "log_kl_ratio", "matched",
    "collapsed_x", "collapsed_matched", "fisher_p", "success_x", "success_matched", "success_p",
    "auc_x", "auc_matched", "auc_p", "collapsed_same_lr", "auc_same_lr",
)


def with_lr(runs: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """`runs` with `lr` (the actor learning rate of each run, from its params)."""
    return runs.assign(lr=pd.to_numeric(param_column(runs, params, P.ACTOR_LR)).to_numpy())


def group_step_kl(runs: pd.DataFrame) -> float:
    """The mean over units of the runs' mean step KL (`mean_step_kl`)."""
    return finite_mean(once(runs)["mean_step_kl"])


def kl_matched_table(runs: pd.DataFrame, stabilisers: Sequence[str], *, plain: str = "ppo",
                     x: Sequence[str] = ("experiment",), max_ratio: float = 2.0) -> pd.DataFrame:
    """One row per (x, stabiliser, its learning rate) of a per-run table with `algo`, `lr`,
    `unit`, `collapsed`, `final_success`, `val_auc`, `mean_step_kl` (module docstring)."""
    rows = []
    for key, cell in runs.groupby(list(x), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        ladder = {lr: g for lr, g in cell[cell["algo"] == plain].groupby("lr", sort=True)}
        rungs = {lr: group_step_kl(g) for lr, g in ladder.items()}
        rungs = {lr: k for lr, k in rungs.items() if np.isfinite(k) and k > 0}
        for algo in stabilisers:
            for lr, mine in cell[cell["algo"] == algo].groupby("lr", sort=True):
                kx = group_step_kl(mine)
                row = {**dict(zip(x, key)), "stabiliser": algo, "plain": plain, "lr": lr, "step_kl": kx}
                if rungs and np.isfinite(kx) and kx > 0:
                    best = min(rungs, key=lambda r: abs(math.log(rungs[r] / kx)))
                    ratio = math.log(rungs[best] / kx)
                    row |= {"matched_lr": best, "matched_step_kl": rungs[best], "log_kl_ratio": ratio,
                            "matched": abs(ratio) <= math.log(max_ratio)}
                    row |= _compare(mine, ladder[best])
                if lr in ladder:
                    same = two_group_tests(mine, ladder[lr])
                    row |= {"collapsed_same_lr": same["collapsed_b"], "auc_same_lr": finite_mean(once(ladder[lr])["val_auc"])}
                rows.append(row)
    out = pd.DataFrame(rows, columns=[*x, *KL_MATCH_COLUMNS])
    out["matched"] = out["matched"].fillna(False).astype(bool)
    return out


def _compare(mine: pd.DataFrame, control: pd.DataFrame) -> dict:
    t = two_group_tests(mine, control)
    a, b = once(mine), once(control)
    return {"collapsed_x": t["collapsed_a"], "collapsed_matched": t["collapsed_b"], "fisher_p": t["fisher_p"],
            "success_x": t["success_a"], "success_matched": t["success_b"], "success_p": t["welch_p"],
            "auc_x": finite_mean(a["val_auc"]), "auc_matched": finite_mean(b["val_auc"]),
            "auc_p": welch_test(a["val_auc"], b["val_auc"])["p"]}
