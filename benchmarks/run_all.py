"""Every benchmark's figures beside their goals (`make bench`): each script of `BENCHMARKS` runs in
a fresh process on one torch thread (OMP_NUM_THREADS=1), and the figures it prints (`name: value`
lines) are read back into one table:

    benchmark        figure                       value   goal     met
    bench_algos      st_ppo_over_ppo              0.842   <= 1.1   yes
    ...

`BENCHMARKS` is the one list of the figures and their goals; docs/benchmarks.md shows the same
goals (tests/test_bench_goals.py) and this machine's figures. A script whose interpreter is not
there (bench_vs_trl needs `make trl-env`) is listed as skipped. Exit 1 when a goal is missed or a
script fails (speed figures move with the machine's load: rerun before believing a miss).

Run: `.venv/bin/python benchmarks/run_all.py [--only bench_algos,bench_step] [--repeats N]`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]


class Bench(NamedTuple):
    script: str
    goals: dict[str, Optional[str]]  # figure → goal ('<= 1.1', '>= 20', '< 3'), None: reported only
    python: Optional[str] = None  # the interpreter, relative to the checkout (default: this one)
    timeout_s: int = 900


BENCHMARKS = (
    Bench("bench_algos.py", {"st_ppo_over_ppo": "<= 1.1", "loop_over_vectorised": ">= 20"}),
    Bench("bench_step.py", {"update_over_raw": "<= 1.3", "exact_clip_bias_fraction": None,
                            "logprob_agent_only_speedup": None}),
    Bench("bench_rollout.py", {"rollout_over_generate": ">= 0.8"}),
    Bench("bench_vs_trl.py", {"stppo_over_trl": ">= 1.5"}, python=".venv-trl/bin/python"),
    Bench("bench_logits_memory.py", {"logits_peak_ratio": None}),
    Bench("bench_analysis.py", {"cached_load_s": "< 3", "cold_over_cached": None}),
)
FIGURE = re.compile(r"^([a-z_0-9]+): ([-+0-9.eE]+|nan|inf)\b", re.M)


def meets(value: float, goal: str) -> bool:
    op, bound = goal.split()
    return {"<=": value <= float(bound), ">=": value >= float(bound), "<": value < float(bound),
            ">": value > float(bound)}[op]


def run(bench: Bench, repeats: Optional[int]) -> tuple[dict[str, float], str]:
    """(the figures a benchmark printed, '' or why it has none)."""
    python = str(ROOT / bench.python) if bench.python else sys.executable
    if not Path(python).exists():
        return {}, f"skipped: no {bench.python}"
    cmd = [python, str(ROOT / "benchmarks" / bench.script)]
    if repeats is not None and bench.script == "bench_algos.py":
        cmd += ["--repeats", str(repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        return {}, f"failed: over {bench.timeout_s} s"
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {}, f"failed (exit {out.returncode}): {tail}"
    return {k: float(v) for k, v in FIGURE.findall(out.stdout)}, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated script names (bench_algos,...)")
    ap.add_argument("--repeats", type=int, default=None, help="bench_algos's repeats")
    args = ap.parse_args()
    only = {n.removesuffix(".py") for n in args.only.split(",") if n}
    rows, failed = [], False
    for bench in BENCHMARKS:
        name = bench.script.removesuffix(".py")
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        figures, why = run(bench, args.repeats)
        print(f"{name}: {why or 'done'} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        failed |= why.startswith("failed")
        for figure, goal in bench.goals.items():
            value = figures.get(figure)
            if value is None:
                rows.append((name, figure, why or "not printed", goal or "—", "—"))
                failed |= not why
                continue
            ok = "—" if goal is None else "yes" if meets(value, goal) else "NO"
            failed |= ok == "NO"
            rows.append((name, figure, f"{value:g}", goal or "—", ok))
    header = ("benchmark", "figure", "value", "goal", "met")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
