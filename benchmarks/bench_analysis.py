"""Loading a study with `analysis.load_study`, cold vs from the parquet cache, measured in one run
(speed claims are ratios measured in one run, never timed asserts).

Store: a real MLflow sqlite store of R runs × S steps (default 50 × 500) with the trainer's
metric keys plus filler keys (the tests' synthetic runs, `tests/fixtures/runs.py`) (~33 keys per step, ~0.8M metric rows), written once through
MlflowClient.log_batch and kept under $STPPO_CACHE_DIR/bench_analysis/ for later runs. Each
measurement starts from an empty analysis cache. Prints, each on its own line:
    first_load_s: X        cold load: SQL read of every run + writing the per-run parquet cache
    cached_load_s: Y       the same study again, no run changed (goal < 3 s); median of repeats
    cold_over_cached: Z    X / Y
and, for context, the store size, the tidy frame's rows and the no-cache SQL load time.
Run: `OMP_NUM_THREADS=1 python benchmarks/bench_analysis.py [--runs R] [--steps S] [--repeats K]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stppo.cache import cache_dir, content_hash

TESTS = Path(__file__).resolve().parents[1] / "tests"  # the synthetic runs: tests/fixtures

EXPERIMENT = "bench"
PRESETS = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "grpo")


def build_store(runs: int, steps: int, extra: int) -> str:
    """The benchmark store (built once per spec, then reused)."""
    sys.path.insert(0, str(TESTS))
    from fixtures.runs import write_demo_study

    root = cache_dir("bench_analysis", content_hash("v1", runs, steps, extra))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    if (root / "done").exists():
        return uri
    (root / "mlflow.db").unlink(missing_ok=True)
    seeds = range(-(-runs // len(PRESETS)))
    t0 = time.perf_counter()
    ids = write_demo_study(uri, EXPERIMENT, presets=PRESETS, seeds=seeds, steps=steps, per_step=False,
                           extra_metrics=extra, collapsing=("ppo", "grpo"))
    print(f"built store: {len(ids)} runs x {steps} steps in {time.perf_counter() - t0:.1f} s ({root})")
    (root / "done").touch()
    return uri


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--extra-metrics", type=int, default=14, help="filler keys on top of the trainer's ~19")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    uri = build_store(args.runs, args.steps, args.extra_metrics)

    from analysis import load_study
    from analysis.store import open_reader

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["STPPO_CACHE_DIR"] = tmp  # an empty analysis cache for this run only
        first, study = timed(lambda: load_study(EXPERIMENT, uri))
        cached = statistics.median(timed(lambda: load_study(EXPERIMENT, uri))[0] for _ in range(args.repeats))
        nocache = timed(lambda: load_study(EXPERIMENT, uri, use_cache=False))[0]
        size_mb = Path(open_reader(uri).path).stat().st_size / 2**20
        print(f"store_mb: {size_mb:.1f}")
        print(f"runs: {len(study.runs)}  rows: {len(study.metrics)}  keys: {study.metrics['metric'].nunique()}")
        print(f"sql_nocache_load_s: {nocache:.3f}")
        print(f"first_load_s: {first:.3f}")
        print(f"cached_load_s: {cached:.3f}")
        print(f"cold_over_cached: {first / cached:.2f}")


if __name__ == "__main__":
    main()
