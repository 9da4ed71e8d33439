"""Study v3's tables and figures (docs/results/staleness/README.md) from exported parquet folders.

    python -m analysis.studies.staleness --data DIR [DIR ...] --out OUT [--n-boot N] [--seed S]

reads the folders written by `python -m analysis.export` (one per part, or any split), sorts the
runs into the study's parts (`analysis.studies.staleness_runs`; runs of other experiments, and runs still
running, are left out and counted) and writes

    OUT/cells.csv          one row per (part, machine, model, level, lag, lag mode, preset label)
    OUT/contrasts.csv      the pre-specified contrasts C1–C8 (`analysis.studies.staleness_contrasts`)
    OUT/not_computed.txt   one line per contrast (or pair) that could not be computed, and why
    OUT/fig_*.png, .pdf    `analysis.studies.staleness_figures` (those whose cells are there)

and prints a short summary: the runs per part, the contrast rows with a Holm-adjusted p < 0.05 and
the lines of not_computed.txt. Any part may be missing or partial. A missing folder, or data
without a run of any part, is one error line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


from ..export import load_exported
from ..identical import merged_units
from .staleness_contrasts import ContrastResult, contrast_table, contrasts_markdown
from .staleness_figures import FIGURES
from .staleness_runs import L1F, L2, PARTS, SIZE_GPU, StudyRuns, study_cells, study_runs
from ..store import AnalysisError

ALPHA = 0.05


def part_summary(sr: StudyRuns) -> list[str]:
    """One line per part: runs, collapsed, models, machines and lags; then what was left out."""
    lines = []
    for part, text in PARTS.items():
        r = sr.runs[sr.runs["part"] == part]
        if r.empty:
            lines.append(f"{text}: no runs")
            continue
        lags = ", ".join(map(str, sorted(r["lag"].unique())))
        models, machines = (", ".join(sorted(r[c].astype(str).unique())) for c in ("model", "machine"))
        lines.append(f"{text}: {len(r)} runs, {int(r['collapsed'].sum())} collapsed; models {models} on {machines}; "
                     f"{r['algo'].nunique()} preset labels; lags {lags}")
    if sr.unfinished:
        lines.append(f"left out: {sr.unfinished} runs still running")
    if sr.repeats:
        lines.append(f"left out: {sr.repeats} repeated runs of a cell's seed (the first run of each kept)")
    if sr.other:
        lines.append(f"left out: the runs of {', '.join(sr.other)} (no part of the study)")
    return lines


def significant(result: ContrastResult, alpha: float = ALPHA) -> list[str]:
    """The contrast rows with a Holm-adjusted p < alpha, one line each."""
    t = result.table
    lines = []
    for test, what in (("fisher", "collapse"), ("welch", "success")):
        for _, r in t[t[f"{test}_p_holm"] < alpha].iterrows():
            detail = (f"{r['collapsed_a']} vs {r['collapsed_b']}" if test == "fisher"
                      else f"{r['success_a']:.3f} vs {r['success_b']:.3f}")
            lines.append(f"{r['contrast']} lag {r['lag']}: {r['a']} vs {r['b']}: {what} {detail}, "
                         f"Holm p = {r[f'{test}_p_holm']:.3g}")
    return lines


def write_study(study, out: Path, *, n_boot: int = 10_000,
                seed: int = 0) -> tuple[StudyRuns, ContrastResult, list[str]]:
    """Write the tables and figures of `study` to `out` (`contrasts.md`: the contrast table in the
    results page's layout; `merged_units.csv`: the identical-run units of more than one run, each
    counted once); returns (runs, contrasts, figure names)."""
    sr = study_runs(study)
    if sr.runs.empty:
        raise AnalysisError(f"no run of the study's parts in {study.uri} (experiments there: "
                            f"{', '.join(map(str, study.experiments))}); the parts are {L1F} (part 1 tiny, part 3 "
                            f"other models), {L2} runs with the lag param (part 2) and {SIZE_GPU} (part 3, GPU)")
    out.mkdir(parents=True, exist_ok=True)
    cells = study_cells(sr.runs)
    cells.to_csv(out / "cells.csv", index=False)
    result = contrast_table(sr.runs, n_boot=n_boot, seed=seed)
    result.table.to_csv(out / "contrasts.csv", index=False)
    (out / "contrasts.md").write_text(contrasts_markdown(result.table))
    merged_units(sr.runs).to_csv(out / "merged_units.csv", index=False)
    (out / "not_computed.txt").write_text("".join(f"{line}\n" for line in result.missing))
    drawn = []
    for name, make in FIGURES.items():
        fig = make(cells)
        if fig is None:
            continue
        for ext in ("png", "pdf"):
            fig.savefig(out / f"{name}.{ext}", dpi=120)
        drawn.append(name)
    return sr, result, drawn


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.studies.staleness", description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, type=Path,
                   help="folders written by `python -m analysis.export` (one per part, or any split)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples of the success differences")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    a = p.parse_args(argv)
    try:
        sr, result, drawn = write_study(load_exported(a.data), a.out, n_boot=a.n_boot, seed=a.seed)
    except AnalysisError as e:
        print(f"python -m analysis.studies.staleness: error: {e}", file=sys.stderr)
        return 2
    lines = part_summary(sr)
    lines.append(f"wrote cells.csv, contrasts.csv ({len(result.table)} rows), contrasts.md, merged_units.csv, "
                 f"not_computed.txt"
                 f"{', ' if drawn else ''}{', '.join(f'{d}.png/pdf' for d in drawn)} to {a.out}")
    sig = significant(result)
    lines += [f"Holm-adjusted p < {ALPHA}: {len(sig) or 'none'}"] + [f"  {s}" for s in sig]
    if result.missing:
        lines += ["not computed:"] + [f"  {m}" for m in result.missing]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
