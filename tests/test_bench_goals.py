"""docs/benchmarks.md's table of figures and goals is `make bench`'s (benchmarks/run_all.py, the one
list): the same benchmarks, figures and goals, row for row; and the runner reads a script's
figures and judges a goal as it says."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402

SYMBOLS = {"≤": "<=", "≥": ">=", "<": "<", ">": ">"}


def _doc_rows() -> list[tuple[str, str, str | None]]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    rows, bench = [], None
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        bench = cells[0].strip("`") or bench
        goal = cells[2].rstrip(" s")
        if goal in ("—", ""):
            goal = None
        else:
            op, bound = goal.split()
            goal = f"{SYMBOLS[op]} {bound}"
        rows.append((bench, cells[1].strip("`"), goal))
    return rows


def test_the_documented_goals_are_the_runners():
    runner = [(b.script.removesuffix(".py"), figure, goal)
              for b in run_all.BENCHMARKS for figure, goal in b.goals.items()]
    assert _doc_rows() == runner


def test_the_runner_reads_figures_and_judges_goals():
    out = "layout: N=64\nst_ppo_over_ppo: 0.842\nloop_over_vectorised: 33.7\ncached_load_s: 2.9\n"
    figures = {k: float(v) for k, v in run_all.FIGURE.findall(out)}
    assert figures == {"st_ppo_over_ppo": 0.842, "loop_over_vectorised": 33.7, "cached_load_s": 2.9}
    assert run_all.meets(0.842, "<= 1.1") and not run_all.meets(1.52, "<= 1.1")
    assert run_all.meets(33.7, ">= 20") and run_all.meets(2.9, "< 3") and not run_all.meets(3.0, "< 3")
