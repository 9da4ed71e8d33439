"""Write runs to a real MLflow store the way the trainer does (tags, params, one `log_batch` per
step), with synthetic curves: for tests, `benchmarks/bench_analysis.py` and dashboard demos.

A collapsing run follows the paper's picture: success rises, then falls to ~0 from step `c`; over the
`growth_window` steps before `c` the clipping-bias norm grows as exp(growth · (s − c)); clip ratio
and KL rise; `collapse/detected` / `collapse/step` are logged by the sampled-success rule
(`stppo.diagnostics.SampledCollapseDetector`), as the trainer of studies v2 and v3 logged them:
these runs carry that rule's params (`trainer.collapse.ema`, …), so analysis reads them with it.

With `diagnostics=True` a run also logs the workbench's diagnostics (docs/design.md §4) with leading
signals of different quality: `env/zero_std_group_frac` rises from 8 steps before the collapse,
`actor/entropy` falls from 6 steps before, `rollout_corr/*` and the response length move only after
it; per-turn metrics for 3 turns (with the per-turn sampler/trainer KL `turn/k{k}/rollout_kl`); `alarm/<indicator>` flags from `stppo.alarms.AlarmSet` as the
trainer logs them; and `write_demo_study` writes sampled trajectories as table artifacts
(`samples/step_*.json`, see `synthetic_samples`). `write_signal_study` writes runs with one known
leading signal (the clip fraction jumps `lead` steps before the collapse) for the early-warning tests.
"""

from __future__ import annotations

import math
import zlib
import time
from typing import Mapping, Sequence

import numpy as np

from stppo import metric_names as T
from stppo.alarms import AlarmSet
from stppo.diagnostics import SampledCollapseDetector

from .figures import TURN_MISMATCH

Series = Mapping[str, Sequence[tuple[int, float]]]


def write_run(client, experiment_id: str, *, tags: Mapping[str, str], params: Mapping[str, object],
              series: Series, status: str = "FINISHED", per_step: bool = True) -> str:
    """Create one run with `series` {metric: [(step, value), ...]}; returns its run id.

    per_step=True logs one `log_batch` per step (the trainer's pattern); False packs up to 1000
    values per call (same stored rows, ~10x faster to write a large benchmark store)."""
    from mlflow.entities import Metric, Param

    run_id = client.create_run(experiment_id, tags=dict(tags)).info.run_id
    items = [Param(k, str(v)) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i:i + 100])
    t0 = int(time.time() * 1000)
    by_step: dict[int, list] = {}
    for key, points in series.items():
        for step, value in points:
            by_step.setdefault(int(step), []).append(Metric(key, float(value), t0 + int(step), int(step)))
    batch: list = []
    for step in sorted(by_step):
        batch += by_step[step]
        if per_step or len(batch) >= 1000 - 64:
            for i in range(0, len(batch), 1000):
                client.log_batch(run_id, metrics=batch[i:i + 1000])
            batch = []
    if batch:
        client.log_batch(run_id, metrics=batch)
    client.set_terminated(run_id, status=status)
    return run_id


def synthetic_series(steps: int, *, seed: int = 0, collapse_at: int | None = None, growth: float = 0.25,
                     growth_window: int = 20, val_every: int = 10, peak: float = 0.7,
                     extra_metrics: int = 0, diagnostics: bool = False) -> dict[str, list[tuple[int, float]]]:
    """Curves for one run of `steps` updates (see the module docstring); `extra_metrics` adds that
    many filler `perf/*`-style series so a benchmark run logs a realistic number of keys."""
    rng = np.random.default_rng(seed)
    s = np.arange(1, steps + 1, dtype=np.float64)  # (S,)
    c = collapse_at if collapse_at is not None else steps + 10**6
    rise = 0.3 + (peak - 0.3) * (1 - np.exp(-s / max(steps / 8, 1)))
    success = np.where(s < c, rise, 0.02) + rng.normal(0, 0.02, s.size)
    success = np.clip(success, 0, 1)
    pre = np.clip(s - c, -growth_window, 0)
    bias = np.where(s < c, 0.05 * np.exp(growth * pre), 0.05) * np.exp(rng.normal(0, 0.01, s.size))
    near = np.exp(-np.abs(s - c) / 5.0)  # (S,) 1 at the collapse, 0 far from it
    grad = 0.5 + 3.0 * near + rng.normal(0, 0.05, s.size).clip(-0.2, 0.2)
    out: dict[str, list[tuple[int, float]]] = {
        T.SUCCESS_RATE: _pts(s, success),
        T.VALID_ACTION_RATIO: _pts(s, np.where(s < c, 0.98, 0.55) + rng.normal(0, 0.005, s.size)),
        T.GRAD_NORM: _pts(s, grad),
        T.GRAD_NORM_MAX: _pts(s, 1.5 * grad),
        T.CLIP_BIAS_NORM: _pts(s, bias),
        T.PG_LOSS_NORM: _pts(s, 0.3 + 2 * bias + rng.normal(0, 0.01, s.size)),
        T.PG_CLIPFRAC: _pts(s, 0.04 + 0.2 * near + rng.normal(0, 0.003, s.size).clip(-0.01, 0.01)),
        T.PPO_KL: _pts(s, 0.002 + 0.02 * near),
        T.KL_REF: _pts(s, 0.001 * s / steps + 0.05 * (s >= c)),
        T.ADV_MEAN: _pts(s, rng.normal(0, 0.02, s.size)),
        T.ADV_STD: _pts(s, np.where(s < c, 1.0, 0.05)),
        T.ADV_MAX: _pts(s, np.where(s < c, 2.5, 0.1)),
        T.ADV_MIN: _pts(s, np.where(s < c, -2.5, -0.1)),
        T.SKIPPED_STEPS: _pts(s, np.zeros_like(s)),
    }
    for k in range(extra_metrics):
        out[f"perf/extra_{k}"] = _pts(s, rng.random(s.size))
    val_steps = sorted({0, *range(val_every, steps + 1, val_every), steps})
    val = [(v, float(np.clip((0.3 if v == 0 else success[v - 1]) + rng.normal(0, 0.01), 0, 1))) for v in val_steps]
    out[T.VAL_SUCCESS_RATE] = val
    out.update(_collapse_flags(s, success))
    if diagnostics:
        out.update(_diagnostics(s, c, near, rng))
        out.update(alarm_flags(out))
    return out


def _diagnostics(s: np.ndarray, c: float, near: np.ndarray, rng, turns: int = 3) -> dict[str, list]:
    """The workbench's diagnostics for one synthetic run (see the module docstring)."""
    before = lambda k: np.clip((s - (c - k)) / k, 0, 1)  # noqa: E731  0 until c-k, ramps to 1 at c
    after = (s >= c).astype(np.float64)
    zero = np.clip(0.1 + 0.7 * before(8) + rng.normal(0, 0.02, s.size), 0, 1)
    entropy = 1.2 * (1 - 0.6 * before(6)) * np.exp(rng.normal(0, 0.01, s.size))
    mismatch = 1e-3 * (1 + 20 * after) * np.exp(rng.normal(0, 0.05, s.size))
    out = {T.ZERO_STD_GROUP_FRAC: zero, T.ALL_ZERO_GROUP_FRAC: zero * 0.8, T.ALL_ONE_GROUP_FRAC: zero * 0.2,
           T.ENTROPY: entropy, T.ROLLOUT_CORR_ABS_DIFF_MEAN: mismatch, T.ROLLOUT_CORR_ABS_DIFF_MAX: 8 * mismatch,
           T.ROLLOUT_CORR_K3_KL: mismatch**2 / 2,
           T.RESPONSE_LENGTH_MEAN: 60 * (1 - 0.5 * after) + rng.normal(0, 1, s.size),
           T.NUM_SEARCHES_MEAN: 1.5 - after + rng.normal(0, 0.02, s.size)}
    for k in range(turns):
        clip = np.clip(0.04 + 0.25 * near * (k + 1) / turns + rng.normal(0, 0.003, s.size), 0, 1)
        out |= {T.turn_key(k, "pg_clipfrac"): clip,
                T.turn_key(k, "ratio_mean"): 1 + 0.1 * near * k + rng.normal(0, 0.005, s.size),
                T.turn_key(k, "ratio_max"): 1.2 + 2 * near * (k + 1),
                T.turn_key(k, "adv_mean"): rng.normal(0, 0.05, s.size) - 0.3 * after,
                T.turn_key(k, "ppo_kl"): (0.002 + 0.02 * near) * (1 + k),
                T.turn_key(k, "entropy"): entropy * (1 - 0.1 * k),
                T.turn_key(k, "tokens"): np.round(20 - 3 * k + 10 * after * k),
                # the per-turn sampler/trainer KL (`turn/k{k}/rollout_kl`), the last turn moving most
                turn_metric(k, TURN_MISMATCH): mismatch * (1 + 4 * after * k / turns)}
    return {key: _pts(s, v) for key, v in out.items()}


def turn_metric(k: int, name: str) -> str:
    """`turn/k{k}/{name}`, spelled as `stppo.metric_names.turn_key` spells it (which accepts only
    the names of TURN_METRICS; `rollout_kl` joins them with the stale-rollout metrics)."""
    return T.turn_key(k, name) if name in T.TURN_METRICS else f"{T.TURN_PREFIX}{int(k)}/{name}"


def alarm_flags(series: Series) -> dict[str, list[tuple[int, float]]]:
    """`alarm/<indicator>` = 1.0 at the step `stppo.alarms.AlarmSet` fires, as the trainer logs it."""
    by_step: dict[int, dict[str, float]] = {}
    for key, points in series.items():
        for step, value in points:
            by_step.setdefault(int(step), {})[key] = float(value)
    alarms, out = AlarmSet(), {}
    for step in sorted(by_step):
        for name in alarms.update(step, by_step[step]):
            out[T.alarm_key(name)] = [(step, 1.0)]
    return out


def _pts(steps: np.ndarray, values: np.ndarray) -> list[tuple[int, float]]:
    return [(int(a), float(b)) for a, b in zip(steps, values)]


def _collapse_flags(steps: np.ndarray, success: np.ndarray) -> dict[str, list[tuple[int, float]]]:
    """`collapse/detected` per step and `collapse/step` once, as the sampled-success rule logged."""
    det, flags, at = SampledCollapseDetector(), [], []
    for step, x in zip(steps, success):
        was = det.detected
        flags.append((int(step), float(det.update(int(step), float(x)))))
        if det.detected and not was:
            at.append((int(step), float(det.collapse_step)))
    return {T.COLLAPSE_DETECTED: flags, T.COLLAPSE_STEP: at}


def experiment_id(client, tracking_uri: str, name: str) -> str:
    """The id of experiment `name`, created if needed; on a sqlite store its artifacts (the sample
    tables) go to `artifacts/` next to the database file instead of the working directory."""
    exp = client.get_experiment_by_name(name)
    if exp:
        return exp.experiment_id
    location = None
    if tracking_uri.startswith("sqlite:///"):
        from pathlib import Path

        location = (Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent / "artifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def write_demo_study(tracking_uri: str, name: str, *, presets: Sequence[str] = ("ppo", "st_ppo"),
                     models: Sequence[str] = ("tiny",), seeds: Sequence[int] = (0, 1, 2), steps: int = 60,
                     collapsing: Sequence[str] = ("ppo", "grpo"), per_step: bool = True,
                     extra_metrics: int = 0, task: str = "synthetic_multihop", diagnostics: bool = False,
                     samples_every: int = 10, samples_count: int = 3) -> list[str]:
    """An experiment `name` of presets × models × seeds synthetic runs; collapsing presets collapse
    at a seed-dependent step in the second half. With `diagnostics`, the workbench's diagnostics
    and `samples_count` sampled trajectories every `samples_every` steps and at the detected
    collapse. Returns the run ids."""
    import mlflow

    from .synthetic_samples import write_samples

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp_id = experiment_id(client, tracking_uri, name)
    ids = []
    for algo in presets:
        for model in models:
            for seed in seeds:
                c = int(math.floor(steps * 0.5)) + 3 * seed if algo in collapsing else None
                tags = {T.TAG_ALGO: algo, T.TAG_MODEL: model, T.TAG_TASK: task, T.TAG_SEED: str(seed),
                        T.TAG_SWEEP: "", T.TAG_GIT_COMMIT: "synthetic"}
                params = {"algo.name": algo, "model.name": model, "trainer.seed": seed, "trainer.steps": steps,
                          "trainer.collapse.patience": 5, "trainer.collapse.ema": 0.3}
                series = synthetic_series(steps, seed=1000 * seed + zlib.crc32(algo.encode()) % 997, collapse_at=c,
                                          extra_metrics=extra_metrics, diagnostics=diagnostics)
                run_id = write_run(client, exp_id, tags=tags, params=params, series=series, per_step=per_step)
                if diagnostics and samples_every > 0:
                    write_samples(client, run_id, series, every=samples_every, count=samples_count, seed=seed)
                ids.append(run_id)
    return ids


def signal_series(steps: int, *, collapse_at: int | None, lead: int | None, seed: int = 0) -> Series:
    """A run with one known leading signal: success 0.8 (noise 0.01), 0.02 from `collapse_at`;
    `actor/pg_clipfrac` 0.05 (noise 0.002), 0.30 from step `collapse_at − lead` (no jump when either
    is None); grad norm and valid-action ratio flat with noise (no signal). With the run's collapse
    settings ema=1, patience=3 (`write_signal_study`) the onset is `collapse_at` exactly."""
    rng = np.random.default_rng(seed)
    s = np.arange(1, steps + 1, dtype=np.float64)  # (S,)
    c = collapse_at if collapse_at is not None else steps + 10**6
    jump = c - lead if (lead is not None and collapse_at is not None) else steps + 10**6
    success = np.where(s < c, 0.8, 0.02) + rng.normal(0, 0.01, s.size)
    out = {T.SUCCESS_RATE: _pts(s, success),
           T.PG_CLIPFRAC: _pts(s, np.where(s < jump, 0.05, 0.30) + rng.normal(0, 0.002, s.size)),
           T.GRAD_NORM: _pts(s, np.exp(rng.normal(0, 0.02, s.size))),
           T.VALID_ACTION_RATIO: _pts(s, 0.98 + rng.normal(0, 0.002, s.size)),
           T.SKIPPED_STEPS: _pts(s, np.zeros_like(s))}
    return out | alarm_flags(out)


def write_signal_study(tracking_uri: str, name: str, runs: Sequence[tuple[int | None, int | None]], *,
                       steps: int = 40, algo: str = "ppo") -> list[str]:
    """Experiment `name` with one run per (collapse_at, lead) of `runs` (`signal_series`; seed =
    position), collapse settings ema=1, patience=3. Returns the run ids."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp_id = experiment_id(client, tracking_uri, name)
    ids = []
    for i, (collapse_at, lead) in enumerate(runs):
        tags = {T.TAG_ALGO: algo, T.TAG_MODEL: "tiny", T.TAG_TASK: "synthetic_multihop", T.TAG_SEED: str(i),
                T.TAG_SWEEP: "", T.TAG_GIT_COMMIT: "synthetic"}
        params = {"algo.name": algo, "trainer.seed": i, "trainer.collapse.ema": 1.0, "trainer.collapse.patience": 3}
        series = signal_series(steps, collapse_at=collapse_at, lead=lead, seed=i)
        ids.append(write_run(client, exp_id, tags=tags, params=params, series=series, per_step=False))
    return ids
