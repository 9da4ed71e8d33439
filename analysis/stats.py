"""Statistics across seeds: t-intervals, EMA smoothing, aggregation of curves, Welch's t-test with a
bootstrap CI of the difference, and the exponential-growth fit of the clipping-bias norm.

Conventions: a confidence interval is two-sided at `confidence` (default 0.95); with fewer than two
values its half-width is NaN (no interval, not a zero-width one). A band never leaves the range of
its quantity (`metric_kind`): rates in [0, 1] (success, clip fractions, ratios of counts) and
non-negative quantities (norms, entropy, lengths, times) get the percentile bootstrap interval of
the mean, which lies within the observed values and so within the range; unbounded quantities
(losses, advantages, k1 KL estimates) keep the Student-t interval.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

from stppo import metric_names as T

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
              confidence: float = 0.95, forward_fill: bool = False, kind: str = "auto", n_boot: int = 2000,
              seed: int = 0) -> pd.DataFrame:
    """Mean and confidence interval across runs (seeds) of one metric, per (*by, step).

    Each run's curve is EMA-smoothed first (`smoothing`); non-finite values are ignored. Runs that
    stopped early drop out of later steps (`n` says how many runs a step has) unless
    `forward_fill`, which carries a run's last value to the group's last step. `kind` ('auto' =
    `metric_kind(metric)`, or 'rate', 'nonneg', 'real') picks the interval: the percentile
    bootstrap of the mean (`n_boot` resamples, seeded) for bounded kinds, clipped to the bounds;
    the t-interval for 'real'. half_width = (ci_high − ci_low) / 2.
    Returns columns (*by, step, mean, half_width, ci_low, ci_high, n, interval)."""
    kind = metric_kind(metric) if kind == "auto" else kind
    if kind not in BOUNDS:
        raise ValueError(f"kind must be 'auto' or one of {', '.join(BOUNDS)}, got {kind!r}")
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
    keys = [*by, "step"]
    df = df.sort_values(keys, kind="stable")
    g = df.groupby(keys, sort=True)["value"]
    out = g.agg(mean="mean", std="std", n="count").reset_index()
    if kind == "real":
        t = sps.t.ppf((1 + confidence) / 2, np.maximum(out["n"] - 1, 1))
        half = np.where(out["n"] >= 2, t * out["std"] / np.sqrt(out["n"]), np.nan)
        out["ci_low"], out["ci_high"] = out["mean"] - half, out["mean"] + half
        out["interval"] = "t"
    else:
        gid = g.ngroup().to_numpy()  # (M,) group of each value, in the order of `out`
        low, high = _bootstrap_groups(df["value"].to_numpy(np.float64), gid, len(out), confidence, n_boot, seed)
        lo, hi = BOUNDS[kind]
        out["ci_low"], out["ci_high"] = np.clip(low, lo, hi), np.clip(high, lo, hi)
        out["interval"] = "bootstrap"
    out["half_width"] = (out["ci_high"] - out["ci_low"]) / 2
    return out[[*keys, "mean", "half_width", "ci_low", "ci_high", "n", "interval"]]


def _bootstrap_groups(values: np.ndarray, gid: np.ndarray, groups: int, confidence: float, n_boot: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap CI of the mean of every group at once; NaN for groups of < 2 values.

    Groups of equal size n share one (n_boot, n) index draw (seeded by (seed, n)), so a group's
    interval does not depend on which other groups are aggregated with it."""
    if groups == 0:
        return np.empty(0), np.empty(0)
    counts = np.bincount(gid, minlength=groups)  # (G,)
    pos = np.zeros_like(gid)
    order = np.argsort(gid, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos[order] = np.arange(gid.size) - np.repeat(starts, counts)
    wide = np.full((groups, max(int(counts.max(initial=0)), 1)), np.nan)  # (G, n_max)
    wide[gid, pos] = values
    low, high = np.full(groups, np.nan), np.full(groups, np.nan)
    alpha = (1 - confidence) / 2
    for n in np.unique(counts[counts >= 2]):
        rows = np.flatnonzero(counts == n)
        idx = np.random.default_rng([seed, int(n)]).integers(0, n, (n_boot, n))  # (B, n)
        chunk = max(1, 4_000_000 // (n_boot * int(n)))
        for i in range(0, rows.size, chunk):
            r = rows[i:i + chunk]
            means = wide[r, :n][:, idx].mean(axis=-1)  # (g, B)
            low[r], high[r] = np.quantile(means, [alpha, 1 - alpha], axis=1)
    return low, high


def bootstrap_mean_ci(values: Sequence[float], *, confidence: float = 0.95, n_boot: int = 2000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of one sample (the interval `aggregate` draws for bounded
    quantities): resample with replacement, take the (1 ± c)/2 quantiles of the resampled means.
    It lies within [min, max] of the values; NaNs for fewer than two finite values."""
    x = _finite(values)
    if x.size < 2:
        return float("nan"), float("nan")
    low, high = _bootstrap_groups(x, np.zeros(x.size, dtype=np.int64), 1, confidence, n_boot, seed)
    return float(low[0]), float(high[0])


BOUNDS: dict[str, tuple[float | None, float | None]] = {"rate": (0.0, 1.0), "nonneg": (0.0, None),
                                                        "real": (None, None)}
RATE_KEYS = frozenset({
    T.SUCCESS_RATE, T.VAL_SUCCESS_RATE, T.VALID_ACTION_RATIO, T.FINISH_RATIO, T.PG_CLIPFRAC, T.PG_CLIPFRAC_HIGH,
    T.PG_CLIPFRAC_LOW, T.VF_CLIPFRAC, T.RESPONSE_LENGTH_CLIP_RATIO, T.CLIP_BIAS_TRIGGERED, T.COLLAPSE_DETECTED,
    T.ZERO_STD_GROUP_FRAC, T.ALL_ZERO_GROUP_FRAC, T.ALL_ONE_GROUP_FRAC, T.ROLLOUT_IS_ESS})
NONNEG_KEYS = frozenset({
    T.GRAD_NORM, T.GRAD_NORM_MAX, T.CLIP_BIAS_NORM, T.CLIP_BIAS_NORM_MAX, T.CLIP_BIAS_GRAD_NORM, T.PG_LOSS_NORM,
    T.CRITIC_GRAD_NORM, T.ENTROPY, T.RATIO_MEAN, T.RATIO_MAX, T.LR, T.VF_LOSS, T.NUM_TURNS_MEAN,
    T.NUM_SEARCHES_MEAN, T.RESPONSE_LENGTH_MEAN, T.STEP_TIME, T.ROLLOUT_TIME, T.UPDATE_TIME, T.TOKENS_PER_S,
    T.SKIPPED_STEPS, T.COLLAPSE_ROLLBACKS, T.ROLLOUT_CORR_K3_KL, T.ROLLOUT_IS_MEAN,
    T.ROLLOUT_CORR_ABS_DIFF_MAX, T.ROLLOUT_CORR_ABS_DIFF_MEAN})
TURN_KINDS = {"pg_clipfrac": "rate", "ratio_mean": "nonneg", "ratio_max": "nonneg", "entropy": "nonneg",
              "tokens": "nonneg", "adv_mean": "real", "ppo_kl": "real"}


def metric_kind(key: str) -> str:
    """'rate' (in [0, 1]), 'nonneg' (>= 0) or 'real' (unbounded) for a metric key of docs/design.md §4;
    keys it does not know are 'real' (the t-interval, as before)."""
    turn = T.parse_turn_key(key)
    if turn is not None:
        return TURN_KINDS[turn[1]]
    return "rate" if key in RATE_KEYS else "nonneg" if key in NONNEG_KEYS else "real"


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
    Welch–Satterthwaite degrees of freedom.

    Seed-level results often tie exactly (every seed 0.0 after a collapse, or 0.5 of a small
    validation set). Two groups without spread: t = ±inf and p = 0 when their means differ, t and
    p NaN when they agree; df is then undefined (NaN). One constant group: scipy's answer (its
    variance 0 up to rounding), without scipy's warning about that rounding."""
    x, y = _finite(a), _finite(b)
    if x.size < 2 or y.size < 2:
        return {"t": float("nan"), "df": float("nan"), "p": float("nan")}
    if np.ptp(x) == 0 and np.ptp(y) == 0:
        diff = float(x[0] - y[0])
        t = float("nan") if diff == 0 else math.copysign(math.inf, diff)
        return {"t": t, "df": float("nan"), "p": float("nan") if diff == 0 else 0.0}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss occurred in moment calculation",
                                RuntimeWarning)
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


def finite_mean(values: Sequence[float]) -> float:
    """The mean of the finite values (NaN when there is none)."""
    x = _finite(values)
    return float(x.mean()) if x.size else float("nan")
