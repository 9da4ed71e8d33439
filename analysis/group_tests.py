"""Two groups of runs compared: collapse counts by Fisher's exact test, mean final success by
Welch's t-test, each identical unit once (`analysis.identical`); Holm's adjustment of a family."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import scipy.stats as sps

from .identical import apart
from .stats import finite_mean, welch_test


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaNs stay NaN and do not count in the family)."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    if ok.size == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    m = order.size
    adjusted = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out[order] = np.maximum.accumulate(adjusted)
    return out


def two_group_tests(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """Two groups of runs, each identical unit once and without the units in both
    (`identical.apart`; `shared_units` counts those): collapse counts and Fisher's exact test,
    mean final success and Welch's t-test (the row of `pairwise_table` and of `contrast_table`,
    before Holm). Nothing left on a side: counts 0/0 and NaN tests."""
    a, b, shared = apart(a, b)
    ka, kb = int(a["collapsed"].sum()), int(b["collapsed"].sum())
    w = welch_test(a["final_success"], b["final_success"])
    fisher = float(sps.fisher_exact([[ka, len(a) - ka], [kb, len(b) - kb]])[1]) if len(a) and len(b) else np.nan
    return {"collapsed_a": f"{ka}/{len(a)}", "collapsed_b": f"{kb}/{len(b)}", "fisher_p": fisher,
            "success_a": finite_mean(a["final_success"]), "success_b": finite_mean(b["final_success"]),
            "welch_t": w["t"], "welch_p": w["p"], "shared_units": shared}
