"""Synthetic runs of a staleness study (stale rollouts, `trainer.offpolicy`; a rollout correction,
`algo.rollout_correction`), written to a real MLflow store as the trainer writes them: for the
lag frontier's tests and dashboard demos (`analysis.synthetic` writes the level studies).

A cell is (preset, lag, lag mode, correction) with a known number of runs and of collapses: the
first `collapsed` seeds of a cell collapse at step c = 20 − 2·lag + seed (success 0.8, then 0.02;
collapse settings ema=1, patience=3, so the onset is c exactly). Every run logs the sampler vs
trainer metrics (`rollout_corr/*`) at a level that grows with the lag, and a run with lag > 0 the
staleness metrics (`offpolicy/lag_mean`, `lag_max`, `kl_to_current`). In a collapsing run the
χ², the KLs and the per-turn `turn/k{k}/rollout_kl` jump ×20 four steps before the onset (a
leading signal: the `rollout_chi2`, `offpolicy_kl` and `rollout_mismatch` alarms warn 3 steps
ahead), the IS weights' effective sample size falls from the onset on (a late one); the others
are flat with noise. `alarm/<indicator>` flags come from `stppo.alarms.AlarmSet`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from stppo import metric_names as T

from .axes import CORRECTION_PARAM, LAG_MODE_PARAM, LAG_PARAM, NO_CORRECTION
from .figures import TURN_MISMATCH
from .synthetic import alarm_flags, experiment_id, turn_metric, write_run

LEAD = 4  # the mismatch jumps this many steps before the onset


class StaleCell(NamedTuple):
    algo: str
    lag: int
    runs: int
    collapsed: int  # the first `collapsed` seeds collapse
    lag_mode: str = "fixed"
    correction: str = NO_CORRECTION
    old: bool = False  # written as a run from before trainer.offpolicy: no lag or correction params
    model: str = "tiny"  # the run's model tag


# ppo collapses one more seed per lag step, grpo from lag 2, grpo with a correction one less
STALE_CELLS: tuple[StaleCell, ...] = (
    StaleCell("ppo", 0, 2, 0, old=True), StaleCell("ppo", 1, 2, 1), StaleCell("ppo", 2, 2, 2),
    StaleCell("ppo", 4, 2, 2), StaleCell("grpo", 0, 2, 0), StaleCell("grpo", 1, 2, 0),
    StaleCell("grpo", 2, 2, 1), StaleCell("grpo", 4, 2, 2),
    StaleCell("grpo", 2, 2, 0, correction="decoupled_geo_rs"), StaleCell("grpo", 4, 2, 1, correction="decoupled_geo_rs"),
    StaleCell("ppo", 4, 2, 1, lag_mode="uniform"),
)


def stale_series(steps: int, *, lag: int, collapse_at: int | None, lag_mode: str = "fixed", seed: int = 0,
                 turns: int = 3) -> dict[str, list[tuple[int, float]]]:
    """One run's curves (module docstring)."""
    rng = np.random.default_rng(seed)
    s = np.arange(1, steps + 1, dtype=np.float64)  # (S,)
    c = collapse_at if collapse_at is not None else steps + 10**6
    after = (s >= c).astype(np.float64)
    jump = np.where(s >= c - LEAD, 20.0, 1.0)  # the leading mismatch
    noise = lambda: np.exp(rng.normal(0, 0.05, s.size))  # noqa: E731  multiplicative, 5%
    kl = 2e-4 * (1 + lag) * jump * noise()
    chi2 = 2e-3 * (1 + lag) * jump * noise()
    ppl = 1.6 * noise()
    out = {T.SUCCESS_RATE: np.where(s < c, 0.8, 0.02) + rng.normal(0, 0.01, s.size),
           T.PG_CLIPFRAC: 0.05 + 0.01 * lag + rng.normal(0, 0.002, s.size),
           T.PPO_KL: (0.002 + 0.001 * lag) * noise(), T.GRAD_NORM: (1 + 0.2 * lag) * noise(),
           T.VALID_ACTION_RATIO: 0.98 + rng.normal(0, 0.002, s.size), T.SKIPPED_STEPS: np.zeros_like(s),
           T.ROLLOUT_CORR_KL: kl, T.ROLLOUT_CORR_K3_KL: kl / 2, T.ROLLOUT_CORR_LOG_PPL_DIFF: kl,
           T.ROLLOUT_CORR_LOG_PPL_ABS_DIFF: 1.2 * kl, T.ROLLOUT_CORR_CHI2_TOKEN: chi2,
           T.ROLLOUT_CORR_CHI2_SEQ: 5 * chi2, T.ROLLOUT_CORR_TRAINING_PPL: ppl,
           T.ROLLOUT_CORR_ROLLOUT_PPL: ppl * np.exp(-kl), T.ROLLOUT_CORR_PPL_RATIO: np.exp(kl),
           T.ROLLOUT_IS_MEAN: 1 + kl, T.ROLLOUT_IS_MAX: 1.5 + 10 * kl,
           T.ROLLOUT_IS_ESS: 0.97 - 0.01 * lag - 0.4 * after + rng.normal(0, 0.003, s.size)}
    if lag > 0:
        out |= {T.OFFPOLICY_LAG_MEAN: np.full_like(s, lag if lag_mode == "fixed" else lag / 2),
                T.OFFPOLICY_LAG_MAX: np.full_like(s, lag),
                T.OFFPOLICY_KL_TO_CURRENT: 1e-3 * lag * jump * noise()}
    for k in range(turns):
        out[turn_metric(k, TURN_MISMATCH)] = kl * (1 + k) * noise()
    series = {key: [(int(a), float(b)) for a, b in zip(s, v)] for key, v in out.items()}
    val_steps = sorted({0, *range(10, steps + 1, 10), steps})
    series[T.VAL_SUCCESS_RATE] = [(v, 0.8 if v < c else 0.05) for v in val_steps]
    return series | alarm_flags(series)


def write_stale_study(tracking_uri: str, name: str, cells: Sequence[StaleCell] = STALE_CELLS, *,
                      steps: int = 30, noise_seed: int = 0) -> list[str]:
    """Experiment `name` with the runs of `cells` (seeds 0 … runs − 1 each; their curves' noise
    drawn from `noise_seed` + 100 · cell + seed: experiments written with the same noise seed
    repeat each other's runs). Returns the run ids."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp_id = experiment_id(client, tracking_uri, name)
    ids = []
    for i, cell in enumerate(cells):
        for seed in range(cell.runs):
            c = 20 - 2 * cell.lag + seed if seed < cell.collapsed else None
            tags = {T.TAG_ALGO: cell.algo, T.TAG_MODEL: cell.model, T.TAG_TASK: "synthetic_multihop",
                    T.TAG_SEED: str(seed), T.TAG_SWEEP: "", T.TAG_GIT_COMMIT: "synthetic"}
            params = {"algo.name": cell.algo, "trainer.seed": seed, "trainer.collapse.ema": 1.0,
                      "trainer.collapse.patience": 3}
            if not cell.old:
                params |= {LAG_PARAM: cell.lag, LAG_MODE_PARAM: cell.lag_mode, CORRECTION_PARAM: cell.correction}
            series = stale_series(steps, lag=cell.lag, collapse_at=c, lag_mode=cell.lag_mode,
                                  seed=noise_seed + 100 * i + seed)
            ids.append(write_run(client, exp_id, tags=tags, params=params, series=series, per_step=False))
    return ids
