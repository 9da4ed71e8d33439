"""An L2-penalised logistic regression with run-balanced weights, and an alarm threshold with a
stated false-alarm share: what the combined warning (`analysis.studies.combined_warning`) and the
hazard model (`analysis.hazard`) fit and threshold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import minimize

__all__ = ["Logistic", "false_alarm_threshold", "fit_logistic", "run_balanced_weights"]


def run_balanced_weights(runs: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each run's labelled rows share weight 1, then each class's total weight is half the sum."""
    _, inv, counts = np.unique(runs, return_inverse=True, return_counts=True)
    w = 1.0 / counts[inv]
    total = w.sum()
    for cls in (0.0, 1.0):
        sel = y == cls
        if sel.any():
            w[sel] *= 0.5 * total / w[sel].sum()
    return w


@dataclass(frozen=True)
class Logistic:
    """c(x) = b + w·(x − mu)/sd."""

    w: np.ndarray
    b: float
    mu: np.ndarray
    sd: np.ndarray

    def decision(self, x: np.ndarray) -> np.ndarray:
        return self.b + ((np.asarray(x, np.float64) - self.mu) / self.sd) @ self.w


def fit_logistic(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None, l2: float = 1.0) -> Logistic:
    """Weighted L2-penalised logistic regression (penalty ½·l2·|w|² over the total weight; no
    penalty on b), by L-BFGS on the exact gradient. x (n, d), y (n,) in {0, 1}."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"x must be (n, d) and y (n,), got {x.shape} and {y.shape}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    wts = np.ones_like(y) if weights is None else np.asarray(weights, np.float64)
    wts = wts / wts.sum()
    mu = (wts[:, None] * x).sum(0)
    sd = np.sqrt((wts[:, None] * (x - mu) ** 2).sum(0))
    sd = np.where(sd > 1e-12, sd, 1.0)
    z = (x - mu) / sd
    d = x.shape[1]

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:d], theta[d]
        c = b + z @ w
        # log(1 + e^c) − y·c, stably; its derivative σ(c) − y
        loss = (wts * (np.logaddexp(0.0, c) - y * c)).sum() + 0.5 * l2 * (w @ w)
        r = wts * (1.0 / (1.0 + np.exp(-c)) - y)
        return loss, np.concatenate([z.T @ r + l2 * w, [r.sum()]])

    res = minimize(objective, np.zeros(d + 1), jac=True, method="L-BFGS-B",
                   options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 2000})
    return Logistic(res.x[:d], float(res.x[d]), mu, sd)


def false_alarm_threshold(stable_scores: Sequence[float], max_rate: float) -> float:
    """The smallest θ with share(stable score ≥ θ) ≤ max_rate: just above the ⌊max_rate·n⌋-th
    highest stable score (+inf-free: scores of −inf never alarm). No stable runs: −inf."""
    s = np.sort(np.asarray(stable_scores, np.float64))[::-1]
    s = s[np.isfinite(s)]
    n = len(stable_scores)
    if n == 0:
        return -np.inf
    k = int(np.floor(max_rate * n))  # alarms allowed
    if k >= len(s):
        return -np.inf if len(s) == 0 else float(np.nextafter(-np.inf, 0))
    return float(np.nextafter(s[k], np.inf))
