"""The GPU check's figures from its MLflow store (scripts/gpu_run.py): per run of an experiment,
the steps applied, the median step, rollout and update times over the steps after the first (the
first captures CUDA graphs and warms the allocator), the rollout's agent tokens per second, the
peak GPU memory, and the greedy validation and live-check curves; with `--compare A B`, A's figures against B's (run names).

    python scripts/gpu_figures.py STORE.db EXPERIMENT [--steps N] [--compare A B]

Every line starts with `gpu_figures:`; exits non-zero when a run did not finish or applied fewer
than N steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mlflow.tracking import MlflowClient

from stppo import metric_names as K


def run_figures(client: MlflowClient, run) -> dict:
    def hist(key: str) -> list[float]:
        rows = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(rows, key=lambda m: m.step)]

    p = run.data.params
    rows = int(p.get("trainer.questions_per_step", 0)) * int(p.get("trainer.group_size", 1))
    step, roll, upd = hist(K.STEP_TIME), hist(K.ROLLOUT_TIME), hist(K.UPDATE_TIME)
    later = slice(1, None) if len(step) > 1 else slice(None)
    agent = [n * rows / t for n, t in zip(hist(K.RESPONSE_LENGTH_MEAN), roll) if t > 0]
    peak = hist(K.GPU_PEAK_MEM)
    return {"name": run.info.run_name, "status": run.info.status, "steps": len(step),
            "skipped": sum(hist(K.SKIPPED_STEPS)), "step": _median(step[later]),
            "first": step[0] if step else float("nan"), "rollout": _median(roll[later]),
            "update": _median(upd[later]), "agent_tps": _median(agent[later]),
            "peak_gib": max(peak) if peak else float("nan"), "val": hist(K.VAL_SUCCESS_RATE),
            "live": hist(K.VAL_LIVE_SUCCESS_RATE),
            "engine": p.get("trainer.rollout.engine", "?"), "rows": rows,
            "model": run.data.tags.get(K.TAG_MODEL, "?")}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("experiment")
    ap.add_argument("--steps", type=int, default=1, help="steps each run must have applied")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    client = MlflowClient(f"sqlite:///{args.store}")
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        print(f"gpu_figures: no experiment {args.experiment!r} in {args.store}")
        return 1
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    latest = {r.info.run_name: r for r in runs}  # a name run twice: its newest run
    figs = {name: run_figures(client, r) for name, r in latest.items()}
    bad = 0
    for f in figs.values():
        ok = f["status"] == "FINISHED" and f["steps"] >= args.steps and f["skipped"] == 0
        bad += not ok
        print(f"gpu_figures: {f['name']} ({f['model']}, engine {f['engine']}, {f['rows']} rows): "
              f"{f['status']}, {f['steps']} steps ({f['skipped']:.0f} skipped); step {f['step']:.2f} s "
              f"(first {f['first']:.2f} s), rollout {f['rollout']:.2f} s, update {f['update']:.2f} s, "
              f"agent tokens/s {f['agent_tps']:.0f}, peak GPU memory {f['peak_gib']:.2f} GiB, "
              f"val/success_rate {[round(v, 3) for v in f['val']]}, live {[round(v, 3) for v in f['live']]}")
    if args.compare:
        a, b = (figs.get(n) for n in args.compare)
        if a is None or b is None:
            print(f"gpu_figures: no runs named {args.compare[0]!r} and {args.compare[1]!r} to compare")
            return 1
        print(f"gpu_figures: {a['name']} vs {b['name']}: rollout {b['rollout'] / a['rollout']:.1f}x faster, "
              f"step {b['step'] / a['step']:.1f}x faster, agent tokens/s {a['agent_tps'] / b['agent_tps']:.1f}x, "
              f"peak GPU memory {a['peak_gib']:.2f} vs {b['peak_gib']:.2f} GiB")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
