"""Predicting collapse: a discrete-time hazard model, evaluated out of sample against the best
single indicator and a config-only model (docs/results/study_v4/README.md, "Predicting collapse").

Rows. One row per (run, training step t) while the run is alive: t < c for a run whose live
policy collapsed at step c (the onset of the live rule, `analysis.collapse`), every step of a run
without collapse. Label y = 1 when the run collapses within the horizon, t < c ≤ t + H; 0
otherwise (a *stable* step).

Features (`step_features`). For each indicator of `INDICATORS` — a logged metric, or the per-turn
ratio spread (the standard deviation over turns of `turn/k{k}/ratio_mean`) — its level, its slope
over the last `SLOPE` steps and its cumulative sum up to t, each through g(x) = sign(x)·log(1 + |x|)
(KL, χ² and gradient norms are heavy-tailed); a metric a run never logged is 0 at every step, one
not logged at a step keeps its last value. Config features (given per run: lag, updates per batch,
learning rate, critic) and the step t join them.

Models. `hazard`: logistic regression on every feature (indicators, config and t), L2 strength
chosen from `l2_grid` inside each training fold by an inner cross-validation over the fold's
groups (the largest strength within the best pooled AUC); `config only`: the same on the config
features and t; `best single`: the one indicator feature, signed, with the highest training AUC.
Each fits on rows weighted so that each run counts once and both labels weigh the same
(`analysis.logistic.run_balanced_weights`).

Validation. Folds are groups of runs (v4: the base preset, after identical runs are kept once); a
model is fitted on the other folds and scores the held-out fold. Its alarm threshold θ is fixed on
its training rows: the smallest θ with at most `max_false_alarms` alarms per 100 stable steps
there. Held-out rows are ranked by their margin score − θ of their fold. Reported per model:
- `td_auc`: the time-dependent AUC — at each step t the AUC of the alive rows' margins, cases
  (y = 1) against controls (y = 0), averaged over steps weighted by their cases;
- `pooled_auc`: the AUC over all held-out rows;
- `recall_lead{L}`: the share of collapsed runs with an alarm (margin ≥ 0) at a step t with
  c − H ≤ t ≤ c − L (a warning at least L steps ahead, within the horizon);
- `false_alarms_per_100`: alarms at stable steps per 100 stable steps.
`compare` gives a percentile bootstrap interval (runs resampled) of the td_auc difference of two
models on the same held-out rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from stppo import metric_names as T

from .load import Study
from .logistic import false_alarm_threshold, fit_logistic, run_balanced_weights
from .warning import roc_auc

INDICATORS: dict[str, str] = {
    "kl_to_sampler": T.OFFPOLICY_KL_TO_CURRENT, "chi2_token": T.ROLLOUT_CORR_CHI2_TOKEN,
    "clipfrac": T.PG_CLIPFRAC, "clipfrac_lower": T.PG_CLIPFRAC_LOWER, "clip_bias": T.CLIP_BIAS_NORM,
    "grad_norm": T.GRAD_NORM, "entropy": T.ENTROPY, "ppo_kl": T.PPO_KL, "step_kl": T.STEP_KL,
}
TURN_SPREAD = "turn_ratio_spread"
SLOPE = 5
KINDS = ("level", "slope", "cum")
HAZARD, CONFIG_ONLY, BEST_SINGLE = "hazard", "config only", "best single"
MODELS = (HAZARD, BEST_SINGLE, CONFIG_ONLY)
LEADS = (2, 5)  # steps of warning asked for
SUMMARY_COLUMNS = ("validation", "model", "runs", "collapsed_runs", "rows", "td_auc", "pooled_auc",
                   "recall_lead2", "recall_lead5", "false_alarms_per_100", "indicator")


@dataclass(frozen=True)
class HazardSettings:
    horizon: int = 10  # H: a collapse within this many steps is the event
    l2_grid: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0, 100.0)
    max_false_alarms: float = 5.0  # per 100 stable training steps, fixes θ


def signed_log(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.sign(x) * np.log1p(np.abs(x))


def _turn_spread(m: pd.DataFrame) -> pd.Series:
    turn = m[m["metric"].astype(str).str.match(rf"^{T.TURN_PREFIX}\d+/ratio_mean$")]
    if turn.empty:
        return pd.Series(dtype=np.float64)
    wide = turn.pivot_table(index="step", columns="metric", values="value", aggfunc="last")
    return wide.std(axis=1, ddof=0)


def step_features(study: Study, run_ids: Sequence[str] | None = None) -> pd.DataFrame:
    """Indicator features per (run_id, step) (module docstring): columns `{indicator}:{kind}`."""
    m = study.metrics
    keys = set(INDICATORS.values())
    ids = [str(r) for r in (run_ids if run_ids is not None else study.runs["run_id"])]
    per_run = {str(r): g for r, g in m.groupby("run_id", observed=True, sort=False)}
    frames = []
    for rid in ids:
        mine = per_run.get(rid, m.iloc[:0])
        sub = mine[mine["metric"].isin(keys)]
        wide = sub.pivot_table(index="step", columns="metric", values="value", aggfunc="last")
        spread = _turn_spread(mine)
        steps = np.union1d(wide.index.to_numpy(np.int64), spread.index.to_numpy(np.int64))
        steps = steps[steps >= 1]
        if steps.size == 0:
            continue
        full = np.arange(steps.min(), steps.max() + 1)
        raw = {name: (wide[key] if key in wide.columns else pd.Series(dtype=np.float64)) for name, key in INDICATORS.items()}
        raw[TURN_SPREAD] = spread
        cols = {}
        for name, s in raw.items():
            v = s.reindex(full).ffill().fillna(0.0).to_numpy(np.float64)
            level = signed_log(v)
            back = np.concatenate([np.full(SLOPE, level[0]), level])[: len(level)]
            cols[f"{name}:level"] = level
            cols[f"{name}:slope"] = (level - back) / SLOPE
            cols[f"{name}:cum"] = signed_log(np.cumsum(v))
        idx = pd.MultiIndex.from_arrays([np.full(len(full), rid), full], names=["run_id", "step"])
        frames.append(pd.DataFrame(cols, index=idx))
    if not frames:
        return pd.DataFrame(columns=[f"{n}:{k}" for n in [*INDICATORS, TURN_SPREAD] for k in KINDS])
    return pd.concat(frames)


def hazard_rows(features: pd.DataFrame, onsets: Mapping[str, float], config: pd.DataFrame,
                horizon: int) -> pd.DataFrame:
    """The alive rows with their label `y`, onset `c` (NaN: no collapse), the config columns of
    their run (`config` indexed by run_id) and `step` as a feature column `t`."""
    rid = features.index.get_level_values(0).astype(str).to_numpy()
    step = features.index.get_level_values(1).to_numpy(np.float64)
    c = np.array([float(onsets.get(r, np.nan)) for r in rid])
    alive = ~(step >= c)  # NaN onset: always alive
    y = ((c > step) & (c <= step + horizon)).astype(np.float64)
    cfg = config.reindex(rid).reset_index(drop=True).add_prefix("config:")
    out = pd.concat([pd.DataFrame({"run_id": rid, "step": step, "c": c, "y": y}), features.reset_index(drop=True),
                     cfg, pd.DataFrame({"config:t": step})], axis=1)
    return out[alive].reset_index(drop=True)


# --- scoring functions: fit on training rows, score any rows ---------------------------------------
Scorer = Callable[[pd.DataFrame], np.ndarray]


def _inner_auc(x: np.ndarray, y: np.ndarray, runs: np.ndarray, groups: np.ndarray, l2: float) -> float:
    scores, labels = [], []
    for g in np.unique(groups):
        test = groups == g
        yt = y[~test]
        if test.all() or not ((yt == 1).any() and (yt == 0).any()):
            continue
        model = fit_logistic(x[~test], yt, run_balanced_weights(runs[~test], yt), l2)
        scores.append(model.decision(x[test]))
        labels.append(y[test])
    if not scores:
        return float("nan")
    s, lab = np.concatenate(scores), np.concatenate(labels)
    return roc_auc(s[lab == 1], s[lab == 0])


def fit_logistic_scorer(rows: pd.DataFrame, columns: Sequence[str], groups: np.ndarray,
                        l2_grid: Sequence[float]) -> tuple[Scorer, dict]:
    """The logistic model on `columns`, its L2 strength chosen by an inner cross-validation over
    `groups` (the largest strength within 0.005 of the best inner AUC; the middle of the grid
    when fewer than two groups can be held out)."""
    x, y, runs = rows[list(columns)].to_numpy(np.float64), rows["y"].to_numpy(np.float64), rows["run_id"].to_numpy()
    aucs = {l2: _inner_auc(x, y, runs, groups, l2) for l2 in l2_grid} if len(np.unique(groups)) > 1 else {}
    finite = {k: v for k, v in aucs.items() if np.isfinite(v)}
    if finite:
        best = max(finite.values())
        l2 = max(k for k, v in finite.items() if v >= best - 0.005)
    else:
        l2 = sorted(l2_grid)[len(l2_grid) // 2]
    model = fit_logistic(x, y, run_balanced_weights(runs, y), l2)
    return (lambda r: model.decision(r[list(columns)].to_numpy(np.float64))), {"l2": l2}


def fit_best_single(rows: pd.DataFrame, columns: Sequence[str]) -> tuple[Scorer, dict]:
    """The single indicator feature (signed) with the highest AUC on the training rows."""
    y = rows["y"].to_numpy()
    best, best_auc, sign = None, -np.inf, 1.0
    for col in columns:
        v = rows[col].to_numpy(np.float64)
        auc = roc_auc(v[y == 1], v[y == 0])
        if not np.isfinite(auc):
            continue
        s = 1.0 if auc >= 0.5 else -1.0
        if max(auc, 1 - auc) > best_auc:
            best, best_auc, sign = col, max(auc, 1 - auc), s
    if best is None:
        raise ValueError("no indicator feature separates the training rows (both labels needed)")
    return (lambda r: sign * r[best].to_numpy(np.float64)), {"indicator": ("" if sign > 0 else "−") + best}


def indicator_columns(rows: pd.DataFrame) -> list[str]:
    return [c for c in rows.columns if ":" in c and not c.startswith("config:")]


def config_columns(rows: pd.DataFrame) -> list[str]:
    return [c for c in rows.columns if c.startswith("config:")]


def _fitters(settings: HazardSettings) -> dict[str, Callable[[pd.DataFrame, np.ndarray], tuple[Scorer, dict]]]:
    return {
        HAZARD: lambda r, g: fit_logistic_scorer(r, indicator_columns(r) + config_columns(r), g, settings.l2_grid),
        BEST_SINGLE: lambda r, g: fit_best_single(r, indicator_columns(r)),
        CONFIG_ONLY: lambda r, g: fit_logistic_scorer(r, config_columns(r), g, settings.l2_grid),
    }


def held_out(rows: pd.DataFrame, fold: pd.Series, inner: pd.Series, settings: HazardSettings = HazardSettings(),
             *, train: Sequence | None = None) -> pd.DataFrame:
    """Held-out margins of every model: one row per (held-out row, model) with `fold`, `margin`
    (score − θ of its fold), `threshold`, and what was fitted (`l2`, `indicator`).

    `fold` (run_id → fold): each fold is held out in turn, the others fit — or, with `train` (the
    folds that fit), one split: the other folds are held out together. `inner` (run_id → group):
    the groups of the inner cross-validation that chooses the L2 strength."""
    f = rows["run_id"].map(fold).astype(str).to_numpy()
    g = rows["run_id"].map(inner).astype(str).to_numpy()
    splits = ([(set(map(str, train)), None)] if train is not None
              else [(set(np.unique(f)) - {k}, k) for k in np.unique(f)])
    out = []
    for fit_folds, name in splits:
        tr = np.isin(f, list(fit_folds))
        te = ~tr
        ytr = rows["y"].to_numpy()[tr]
        if not te.any() or not ((ytr == 1).any() and (ytr == 0).any()):
            continue
        for model, fit in _fitters(settings).items():
            scorer, info = fit(rows[tr], g[tr])
            s_tr = scorer(rows[tr])
            theta = false_alarm_threshold(s_tr[ytr == 0], settings.max_false_alarms / 100)
            held = rows.loc[te, ["run_id", "step", "c", "y"]].copy()
            held["score"] = scorer(rows[te])
            held["threshold"] = theta
            held["margin"] = held["score"] - theta
            held["model"], held["fold"] = model, name if name is not None else "held out"
            held["l2"], held["indicator"] = info.get("l2", np.nan), info.get("indicator", "")
            out.append(held)
    if not out:
        raise ValueError("no split has training rows of both labels and held-out rows")
    return pd.concat(out, ignore_index=True)


def td_auc(held: pd.DataFrame, weights: Mapping[str, float] | None = None) -> float:
    """Time-dependent AUC of one model's held-out rows (module docstring); `weights`: run_id →
    multiplicity (a bootstrap resample), 1 each by default."""
    w_all = held["run_id"].map(weights).fillna(0.0).to_numpy() if weights is not None else np.ones(len(held))
    num = den = 0.0
    for _, idx in held.groupby("step", sort=False).indices.items():
        y, s, w = held["y"].to_numpy()[idx], held["margin"].to_numpy()[idx], w_all[idx]
        pos, neg = (y == 1) & (w > 0), (y == 0) & (w > 0)
        if not pos.any() or not neg.any():
            continue
        sp, sn, wp, wn = s[pos][:, None], s[neg][None, :], w[pos][:, None], w[neg][None, :]
        agree = (sp > sn) + 0.5 * (sp == sn)  # (P, N)
        auc = float((agree * wp * wn).sum() / (wp.sum() * wn.sum()))
        num += wp.sum() * auc
        den += wp.sum()
    return num / den if den else float("nan")


def summarise(held: pd.DataFrame, settings: HazardSettings = HazardSettings(), validation: str = "") -> pd.DataFrame:
    """One row per model (SUMMARY_COLUMNS) of `held_out`'s rows."""
    rows = []
    for model, h in held.groupby("model", sort=False):
        y, margin = h["y"].to_numpy(), h["margin"].to_numpy()
        stable = y == 0
        runs = h.groupby("run_id")["c"].first()
        collapsed = runs[runs.notna()]
        rec = {}
        for lead in LEADS:
            win = h[(h["c"].notna()) & (h["step"] >= h["c"] - settings.horizon) & (h["step"] <= h["c"] - lead)]
            warned = win[win["margin"] >= 0]["run_id"].nunique()
            eligible = int((collapsed > lead).sum())
            rec[f"recall_lead{lead}"] = warned / eligible if eligible else np.nan
        rows.append({"validation": validation, "model": model, "runs": len(runs), "collapsed_runs": len(collapsed),
                     "rows": len(h), "td_auc": td_auc(h), "pooled_auc": roc_auc(margin[y == 1], margin[y == 0]),
                     **rec, "false_alarms_per_100": 100 * float((margin[stable] >= 0).mean()) if stable.any() else np.nan,
                     "indicator": ", ".join(sorted(set(h["indicator"]) - {""}))})
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def compare(held: pd.DataFrame, a: str = HAZARD, b: str = BEST_SINGLE, *, n_boot: int = 1000, seed: int = 0,
            confidence: float = 0.95) -> dict:
    """td_auc(a) − td_auc(b) on the same held-out rows, with a percentile bootstrap interval over
    runs (each resample draws runs with replacement; a run's rows count as often as it is drawn)."""
    ha, hb = held[held["model"] == a], held[held["model"] == b]
    runs = np.array(sorted(set(ha["run_id"])))
    diff = td_auc(ha) - td_auc(hb)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        ids, counts = np.unique(rng.choice(runs, size=len(runs), replace=True), return_counts=True)
        w = dict(zip(ids, counts.astype(np.float64)))
        boots.append(td_auc(ha, w) - td_auc(hb, w))
    boots = np.asarray(boots)
    boots = boots[np.isfinite(boots)]
    alpha = (1 - confidence) / 2
    low, high = (np.quantile(boots, [alpha, 1 - alpha]) if boots.size else (np.nan, np.nan))
    return {"a": a, "b": b, "td_auc_diff": diff, "low": float(low), "high": float(high), "resamples": int(boots.size)}


def goal_met(summary_row: Mapping, settings: HazardSettings = HazardSettings()) -> bool:
    """The study's goal: td AUC ≥ 0.85 and recall ≥ 50% at lead ≥ 2 with ≤ 5 false alarms per 100
    stable steps."""
    return bool(summary_row["td_auc"] >= 0.85 and summary_row["recall_lead2"] >= 0.5
                and summary_row["false_alarms_per_100"] <= settings.max_false_alarms)
