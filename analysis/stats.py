"""Statistics across seeds: t-intervals, EMA smoothing, aggregation of curves, Welch's t-test with a
bootstrap CI of the difference, and the exponential-growth fit of the clipping-bias norm.

Conventions: a confidence interval is two-sided at `confidence` (default 0.95); with fewer than two
values its half-width is NaN (no interval, not a zero-width one).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

GROUP: tuple[str, ...] = ("algo", "model", "task")
WELCH_TEST = "Welch's two-sided t-test (unequal variances, scipy.stats.ttest_ind equal_var=False)"


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, int]:
    """(mean, half-width, n) of the Student-t interval: x̄ ± t_{(1+c)/2, n−1} · s / √n, s with ddof=1.

    Non-finite values are dropped."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]  # (n,)
    n = int(x.size)
    if n == 0:
        return float("nan"), float("nan"), 0
    if n < 2:
        return float(x.mean()), float("nan"), 1
    half = sps.t.ppf((1 + confidence) / 2, n - 1) * x.std(ddof=1) / np.sqrt(n)
    return float(x.mean()), float(half), n


def ema(values: Sequence[float], smoothing: float) -> np.ndarray:
    """y_0 = x_0, y_t = smoothing · y_{t−1} + (1 − smoothing) · x_t; smoothing in [0, 1), 0 = off."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    x = pd.Series(np.asarray(values, dtype=np.float64))
    if smoothing == 0.0:
        return x.to_numpy()
    return x.ewm(alpha=1.0 - smoothing, adjust=False, ignore_na=True).mean().to_numpy()


def aggregate(metrics: pd.DataFrame, metric: str, *, by: Sequence[str] = GROUP, smoothing: float = 0.0,
              confidence: float = 0.95, forward_fill: bool = False) -> pd.DataFrame:
    """Mean and t-interval across runs (seeds) of one metric, per (*by, step).

    Each run's curve is EMA-smoothed first (`smoothing`); non-finite values are ignored. Runs that
    stopped early drop out of later steps (`n` says how many runs a step has) unless
    `forward_fill`, which carries a run's last value to the group's last step.
    Returns columns (*by, step, mean, half_width, ci_low, ci_high, n)."""
    by = list(by)
    cols = ["run_id", *by, "step", "value"]
    df = metrics.loc[metrics["metric"] == metric, cols].copy()
    for col in ("run_id", *by):
        df[col] = df[col].astype(str)
    df = df[np.isfinite(df["value"])].sort_values(["run_id", "step"])
    if smoothing:
        df["value"] = df.groupby("run_id", sort=False)["value"].transform(lambda v: ema(v.to_numpy(), smoothing))
    if forward_fill and not df.empty:
        df = _forward_fill(df, by)
    g = df.groupby([*by, "step"], sort=True)["value"]
    out = g.agg(mean="mean", std="std", n="count").reset_index()
    t = sps.t.ppf((1 + confidence) / 2, np.maximum(out["n"] - 1, 1))
    half = np.where(out["n"] >= 2, t * out["std"] / np.sqrt(out["n"]), np.nan)
    out["half_width"] = half
    out["ci_low"], out["ci_high"] = out["mean"] - half, out["mean"] + half
    return out[[*by, "step", "mean", "half_width", "ci_low", "ci_high", "n"]]


def _forward_fill(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    parts = []
    for _, grp in df.groupby(by, sort=False):
        steps = np.sort(grp["step"].unique())
        wide = grp.pivot_table(index="step", columns="run_id", values="value", aggfunc="last").reindex(steps)
        long = wide.ffill().melt(ignore_index=False, value_name="value").dropna().reset_index()
        for col in by:
            long[col] = grp[col].iloc[0]
        parts.append(long)
    return pd.concat(parts, ignore_index=True)


def welch_test(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Welch's t-test of mean(a) ≠ mean(b): t = (ā − b̄) / √(s_a²/n_a + s_b²/n_b), with the
    Welch–Satterthwaite degrees of freedom."""
    x, y = _finite(a), _finite(b)
    if x.size < 2 or y.size < 2:
        return {"t": float("nan"), "df": float("nan"), "p": float("nan")}
    res = sps.ttest_ind(x, y, equal_var=False)
    return {"t": float(res.statistic), "df": float(res.df), "p": float(res.pvalue)}


def bootstrap_diff_ci(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                      n_boot: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(a) − mean(b): resample each group with replacement."""
    x, y = _finite(a), _finite(b)
    if x.size == 0 or y.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    mx = x[rng.integers(0, x.size, (n_boot, x.size))].mean(axis=1)  # (B,)
    my = y[rng.integers(0, y.size, (n_boot, y.size))].mean(axis=1)  # (B,)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(mx - my, [alpha, 1 - alpha])
    return float(low), float(high)


def fit_exponential(steps: Sequence[float], values: Sequence[float]) -> dict[str, float]:
    """OLS fit of log(value) = a + b · step over the positive finite values.

    b is the growth rate per step (value × e^b each step), R² that of the log-linear fit;
    doubling = ln 2 / b steps. Needs ≥ 3 points, else NaNs."""
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(s) & np.isfinite(v) & (v > 0)
    s, y = s[keep], np.log(v[keep])  # (n,)
    nan = float("nan")
    if s.size < 3 or np.ptp(s) == 0:
        return {"a": nan, "b": nan, "r2": nan, "n": int(s.size), "doubling_steps": nan}
    res = sps.linregress(s, y)
    r2 = float(res.rvalue**2) if np.ptp(y) > 0 else nan  # a flat series explains nothing
    b = float(res.slope)
    return {"a": float(res.intercept), "b": b, "r2": r2, "n": int(s.size),
            "doubling_steps": float(np.log(2) / b) if b > 0 else nan}


def _finite(values: Sequence[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    return x[np.isfinite(x)]
