"""Real MLflow sqlite stores with known curves, shared by the analysis and dashboard tests (their
pytest fixtures are imported by name: `from helpers.stores import KNOWN, known_uri`).

Experiment `known` (written with MlflowClient.log_batch per step, as the trainer does):
* ppo seed 0  — steps 1..20; success 0.8 then 0.0 from step 15 (collapse.ema=1, patience=3 ⇒
  collapse at 15); grad_norm = step; clip_bias/norm = 0.01·e^{0.2·step}; val 0.5, 0.8, 0.1.
* ppo seed 1  — steps 1..30; stable; grad_norm = 2·step; clip_bias/norm = 0.01·e^{0.01·step};
  actor/pg_loss NaN at 3, +inf at 4, −inf at 5; final val 0.7.
* ppo seed 2  — steps 1..30; stable success but actor/skipped_steps=1 at 20, 21, 22 ⇒ non-finite
  collapse at 20; grad_norm = 3·step; clip_bias/norm = 0.01·e^{0.05·step}; final val 0.75.
* st_ppo seeds 0..2 — stable; final val 0.8, 0.85, 0.9; clip_bias/norm = 0.01·e^{−0.01·step}.
* grpo seed 0 — steps 1..10, only env/success_rate (flat 0.5) and the trainer's collapse flags
  (collapse/step = 5 logged at step 9): collapsed at 5 by its logged step; no other metric.
Experiment `empty` has no runs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import free_port as closed_port  # noqa: F401  (re-exported to the analysis tests)

from stppo import metric_names as T

KNOWN, EMPTY = "known", "empty"
FINAL_VAL = {("ppo", 0): 0.1, ("ppo", 1): 0.7, ("ppo", 2): 0.75, ("st_ppo", 0): 0.8, ("st_ppo", 1): 0.85,
             ("st_ppo", 2): 0.9}
GROWTH = {("ppo", 0): 0.2, ("ppo", 1): 0.01, ("ppo", 2): 0.05, ("st_ppo", 0): -0.01, ("st_ppo", 1): -0.01,
          ("st_ppo", 2): -0.01}
CLIPFRAC = {"ppo": (0.1, 0.2, 0.3), "st_ppo": (0.05, 0.05, 0.05)}


def _series(algo: str, seed: int) -> tuple[dict, dict]:
    """({metric: [(step, value)]}, params) of one known run."""
    if algo == "grpo":
        steps = range(1, 11)
        return ({T.SUCCESS_RATE: [(s, 0.5) for s in steps],
                 T.COLLAPSE_DETECTED: [(s, float(s >= 9)) for s in steps],
                 T.COLLAPSE_STEP: [(9, 5.0)]}, {})
    last = 20 if (algo, seed) == ("ppo", 0) else 30
    steps = range(1, last + 1)
    success = [(s, 0.0 if (algo, seed) == ("ppo", 0) and s >= 15 else 0.8) for s in steps]
    mult = {"ppo": seed + 1, "st_ppo": 0}[algo]
    out = {
        T.SUCCESS_RATE: success,
        T.GRAD_NORM: [(s, float(mult * s) if mult else 1.0) for s in steps],
        T.CLIP_BIAS_NORM: [(s, 0.01 * math.exp(GROWTH[(algo, seed)] * s)) for s in steps],
        T.PG_LOSS_NORM: [(s, 0.3) for s in steps],
        T.PG_CLIPFRAC: [(s, CLIPFRAC[algo][seed]) for s in steps],
        T.PPO_KL: [(s, CLIPFRAC[algo][seed] / 10) for s in steps],
        T.VALID_ACTION_RATIO: [(s, 0.99) for s in steps],
        T.ADV_MEAN: [(s, 0.0) for s in steps], T.ADV_STD: [(s, 1.0) for s in steps],
        T.ADV_MAX: [(s, 2.0) for s in steps], T.ADV_MIN: [(s, -2.0) for s in steps],
        T.SKIPPED_STEPS: [(s, 1.0 if (algo, seed) == ("ppo", 2) and 20 <= s <= 22 else 0.0) for s in steps],
        T.VAL_SUCCESS_RATE: [(0, 0.5), (10, 0.8)] + ([(20, 0.8)] if last == 30 else [])
        + [(last, FINAL_VAL[(algo, seed)])],
    }
    if algo == "st_ppo":
        out[T.KL_REF] = [(s, 0.001) for s in steps]
    if (algo, seed) == ("ppo", 1):
        out[T.PG_LOSS] = [(s, {3: math.nan, 4: math.inf, 5: -math.inf}.get(s, 0.5)) for s in steps]
    params = {"trainer.seed": seed, "algo.name": algo}
    if (algo, seed) == ("ppo", 0):
        params |= {"trainer.collapse.ema": 1.0, "trainer.collapse.patience": 3}
    return out, params


RUNS = [("ppo", 0), ("ppo", 1), ("ppo", 2), ("st_ppo", 0), ("st_ppo", 1), ("st_ppo", 2), ("grpo", 0)]


def build_known_store(root: Path) -> str:
    """Write the store once per test session (idempotent: later callers reuse the file)."""
    import mlflow

    from fixtures.runs import write_run

    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    if (root / "done").exists():
        return uri
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(KNOWN)
    client.create_experiment(EMPTY)
    for algo, seed in RUNS:
        series, params = _series(algo, seed)
        tags = {T.TAG_ALGO: algo, T.TAG_MODEL: "tiny", T.TAG_TASK: "synthetic_multihop", T.TAG_SEED: str(seed),
                T.TAG_SWEEP: "", T.TAG_GIT_COMMIT: "abc123"}
        write_run(client, exp, tags=tags, params=params, series=series,
                  status="KILLED" if algo == "grpo" else "FINISHED")
    (root / "done").touch()
    return uri


@pytest.fixture(scope="session")
def known_uri(tmp_path_factory) -> str:
    return build_known_store(tmp_path_factory.getbasetemp() / "known_store")


@pytest.fixture
def cache_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run_ids(study) -> dict[tuple[str, int], str]:
    return {(r["algo"], int(r["seed"])): r["run_id"] for _, r in study.runs.iterrows()}


# A second store for the workbench's diagnostics (docs/design.md §4), written by fixtures.runs:
# * `demo` — ppo (collapses at 20 + 3·seed) and st_ppo, seeds 0, 1, 40 steps, with per-turn metrics,
#   group fractions, rollout_corr, alarm flags and sample tables every 10 steps and at the detected
#   collapse;
# * `signal` — one known leading signal (`signal_series`: actor/pg_clipfrac jumps `lead` steps
#   before the collapse; collapse settings ema=1, patience=3, so the onset is the drop step):
SIGNAL_RUNS = [(25, 6), (30, 10), (28, 3), (None, None), (None, None), (None, None), (27, None)]
DEMO, SIGNAL = "demo", "signal"
# * `stale_a` — the cells of `fixtures.stale_runs.STALE_CELLS` (preset × lag × lag mode × rollout
#   correction, 2 seeds each, a known number of collapses; ppo at lag 0 written as runs from before
#   trainer.offpolicy, without the params); `stale_b` — a second level: ppo at lags 0 and 2.
STALE, STALE_B = "stale_a", "stale_b"


def stale_b_cells():
    from fixtures.stale_runs import StaleCell

    return (StaleCell("ppo", 0, 2, 1), StaleCell("ppo", 2, 2, 2))


def write_stale_experiments(uri: str) -> None:
    """The two stale experiments, `stale_a` and `stale_b`."""
    from fixtures.stale_runs import write_stale_study

    write_stale_study(uri, STALE)
    write_stale_study(uri, STALE_B, stale_b_cells(), noise_seed=10_000)  # other runs than stale_a's


def build_workbench_store(root: Path) -> str:
    from fixtures.runs import write_demo_study, write_signal_study

    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    if not (root / "done").exists():
        write_demo_study(uri, DEMO, seeds=(0, 1), steps=40, per_step=False, diagnostics=True, samples_every=10)
        write_signal_study(uri, SIGNAL, SIGNAL_RUNS, steps=40)
        write_stale_experiments(uri)
        (root / "done").touch()
    return uri


@pytest.fixture(scope="session")
def workbench_uri(tmp_path_factory) -> str:
    return build_workbench_store(tmp_path_factory.getbasetemp() / "workbench_store")


def build_stale_store(root: Path) -> str:
    """A store of the two stale experiments only (the dashboard opens on `stale_a`)."""
    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    if not (root / "done").exists():
        write_stale_experiments(uri)
        (root / "done").touch()
    return uri


@pytest.fixture(scope="session")
def stale_uri(tmp_path_factory) -> str:
    return build_stale_store(tmp_path_factory.getbasetemp() / "stale_store")
