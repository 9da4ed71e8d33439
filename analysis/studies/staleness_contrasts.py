"""The pre-specified contrasts C1–C8 of study v3 (docs/results/staleness/README.md, "Pre-specified
contrasts"), as written before the main runs, evaluated on the per-run table of
`analysis.studies.staleness_runs.study_runs`.

A contrast draws on the runs of its `scope` and has one row per lag of `lags` (the README's "at")
and per pair of groups; a group is a label and a selection of runs (column -> allowed values). At
lag k a group takes the scope's runs at lag k, unless it names its own lag (C7's lag-0 group).
Per row: the pooled collapse counts k/n of both groups and Fisher's exact test (two-sided), the
groups' mean final success, their difference a − b with a percentile bootstrap interval (fixed
seed) and Welch's t-test; Holm's adjustment over the whole table, one family per test
(`fisher_p_holm`, `welch_p_holm`). Every count is of identical-run units (`analysis.identical`):
a unit once per group, and a unit in both groups in neither (`shared_units` says how many; a
row whose groups share every unit has nothing to compare). A row whose group lacks some of its
presets says which (`absent`); a point where a group has no run at all gives no row, and one
line of `missing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from ..group_tests import holm, two_group_tests
from ..identical import apart
from ..stats import bootstrap_diff_ci, finite_mean
from .staleness_runs import (CORRECTIONS, COUPLED, CPU, CRITIC_FREE, GAE_PRESETS, GPU, L1F, PART1_LAGS,
                             PART2_PRESETS, PART3_LAGS, PARTS, SIZE_GPU, SIZE_PRESETS)

Where = Mapping[str, tuple]


@dataclass(frozen=True)
class Group:
    """A group of runs: the scope's runs whose columns take the allowed values of `where`."""
    label: str  # `{lag}` is filled in with the row's lag
    where: Where


@dataclass(frozen=True)
class Contrast:
    """One row of the README's table: its words, and the groups of runs they name."""
    id: str
    wording: str  # the README's "contrast"
    at: str  # the README's "at"
    expectation: str  # the README's expectation, written before the runs
    scope: Where
    scope_text: str
    lags: tuple[int, ...]
    pairs: tuple[tuple[Group, Group], ...]
    matched: str | None = None  # pool only over the values of this column that both groups have
    conditional: bool = False  # computed only where its runs exist (no line when they do not)


def _algos(presets: Sequence[str], label: str | None = None) -> Group:
    return Group(label or ", ".join(presets), {"algo": tuple(presets)})


PART1 = {"part": ("1",), "lag_mode": ("fixed",)}
STALE_LAGS = tuple(k for k in PART1_LAGS if k >= 1)
SIZE_CPU = {"experiment": (L1F,), "machine": (CPU,), "lag_mode": ("fixed",)}
SIZE_GPU_SCOPE = {"experiment": (SIZE_GPU,), "machine": (GPU,), "lag_mode": ("fixed",)}


def _size_pairs(a: str, b: str) -> tuple[tuple[Group, Group], ...]:
    return tuple((Group(f"{a} {p}", {"model": (a,), "algo": (p,)}), Group(f"{b} {p}", {"model": (b,), "algo": (p,)}))
                 for p in SIZE_PRESETS)


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("C1", "corrected GAE presets (s_ppo, st_ppo, so_ppo) vs uncorrected (ppo, turn_ppo)",
             "each lag ≥ 1, part 1", "no difference: at l1f their corrections see π_θ / π_old ≡ 1",
             PART1, PARTS["1"], STALE_LAGS, ((_algos(("s_ppo", "st_ppo", "so_ppo")), _algos(("ppo", "turn_ppo"))),)),
    Contrast("C2", "turn-level ratios (turn_ppo, st_ppo) vs token-level (ppo, s_ppo)",
             "each lag ≥ 1, part 1", "no difference (the same reason)",
             PART1, PARTS["1"], STALE_LAGS, ((_algos(("turn_ppo", "st_ppo")), _algos(("ppo", "s_ppo"))),)),
    Contrast("C3", "critic (the five GAE presets) vs critic-free (grpo, so_grpo, dapo, bapo, cispo, dppo_tv, sspo)",
             "each lag ≥ 1, part 1", "v2 found the critic set the frontier; open here",
             PART1, PARTS["1"], STALE_LAGS,
             ((_algos(GAE_PRESETS, "critic (GAE)"), _algos(CRITIC_FREE, "critic-free")),)),
    Contrast("C4", "grpo + each correction vs grpo", "each lag ≥ 1, part 1",
             "the corrections lower the collapse probability at large lags",
             PART1, PARTS["1"], STALE_LAGS, tuple((_algos((f"grpo+{c}",)), _algos(("grpo",))) for c in CORRECTIONS)),
    Contrast("C5", "bapo vs grpo; dppo_tv vs grpo", "each lag ≥ 1, part 1",
             "bapo: none at l1f (its bounds act on π_θ / π_old); dppo_tv: open",
             PART1, PARTS["1"], STALE_LAGS, ((_algos(("bapo",)), _algos(("grpo",))),
                                             (_algos(("dppo_tv",)), _algos(("grpo",))))),
    Contrast("C6", f"coupled ({COUPLED}) vs decoupled, per preset (ppo, st_ppo, grpo, so_grpo)", "lags 4, 16",
             "coupled collapses less",
             PART1, PARTS["1"], (4, 16), tuple((_algos((f"{p}+{COUPLED}",)), _algos((p,))) for p in SIZE_PRESETS)),
    Contrast("C7", "lag k vs lag 0, pooled over part 2's presets", "l2, k ∈ {2, 8}",
             "staleness adds to epochs: more collapse",
             {"part": ("2",), "lag_mode": ("fixed",), "algo": PART2_PRESETS}, PARTS["2"], (2, 8),
             ((Group("lag {lag}", {}), Group("lag 0", {"lag": (0,)})),), matched="algo"),
    Contrast("C8", "small vs tiny, per preset", "part 3's two lags", "open",
             SIZE_CPU, f"small runs of {L1F} on the CPU (part 3)", PART3_LAGS, _size_pairs("small", "tiny")),
    Contrast("C8-gpu", "base vs small and small vs tiny, per preset, within the GPU experiment", "part 3's lags",
             "open (added where GPU runs exist)", SIZE_GPU_SCOPE, f"GPU runs ({SIZE_GPU})", PART3_LAGS,
             _size_pairs("base", "small") + _size_pairs("small", "tiny"), conditional=True),
)
CONTRAST_COLUMNS = ("contrast", "level", "machine", "lag", "a", "b", "collapsed_a", "collapsed_b", "fisher_p",
                    "fisher_p_holm", "success_a", "success_b", "success_diff", "success_diff_low",
                    "success_diff_high", "welch_t", "welch_p", "welch_p_holm", "shared_units", "absent")


def select(runs: pd.DataFrame, where: Where) -> pd.DataFrame:
    """The runs whose every named column takes one of its allowed values."""
    keep = np.ones(len(runs), dtype=bool)
    for col, values in where.items():
        keep &= runs[col].isin(list(values)).to_numpy()
    return runs[keep]


@dataclass
class ContrastResult:
    table: pd.DataFrame  # CONTRAST_COLUMNS, one row per computed (contrast, pair, lag)
    missing: list[str] = field(default_factory=list)  # one line per contrast (pair) not computed, and why


def _point(scope: pd.DataFrame, c: Contrast, a: Group, b: Group, lag: int) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The runs of both groups at `lag`, and the presets a group names but lacks there."""
    ra, rb = (select(scope, {"lag": (lag,), **g.where}) for g in (a, b))
    absent = [f"{g.label.format(lag=lag)}: {', '.join(x)}" for g, r in ((a, ra), (b, rb))
              if (x := [p for p in g.where.get("algo", ()) if p not in set(r["algo"])]) and len(r)]
    if c.matched and len(ra) and len(rb):
        both = set(ra[c.matched]) & set(rb[c.matched])
        dropped = sorted((set(ra[c.matched]) | set(rb[c.matched])) - both)
        ra, rb = ra[ra[c.matched].isin(both)], rb[rb[c.matched].isin(both)]
        if dropped:
            absent.append(f"not in both groups: {', '.join(dropped)}")
    return ra, rb, "; ".join(absent)


def _row(c: Contrast, a: Group, b: Group, lag: int, ra: pd.DataFrame, rb: pd.DataFrame, absent: str,
         n_boot: int, seed: int) -> dict:
    both = pd.concat([ra, rb])
    tests = two_group_tests(ra, rb)
    ua, ub, _ = apart(ra, rb)
    low, high = bootstrap_diff_ci(ua["final_success"], ub["final_success"], n_boot=n_boot, seed=seed)
    return {"contrast": c.id, "level": ", ".join(sorted(set(both["experiment"].astype(str)))),
            "machine": ", ".join(sorted(set(both["machine"].astype(str)))), "lag": lag,
            "a": a.label.format(lag=lag), "b": b.label.format(lag=lag), **tests,
            "success_diff": finite_mean(ua["final_success"]) - finite_mean(ub["final_success"]),
            "success_diff_low": low, "success_diff_high": high, "absent": absent}


def _lags(lags: Sequence[int]) -> str:
    return f"lag{'s' if len(lags) > 1 else ''} {', '.join(map(str, lags))}"


def _evaluate(c: Contrast, scope: pd.DataFrame, n_boot: int, seed: int) -> tuple[list[dict], list[str]]:
    """The rows of one contrast and its lines for what could not be computed: one per pair (the
    lags it lacks, and which group has no runs at which lag), or one for the whole contrast when it
    has no row at all."""
    rows, lines, empty = [], [], {}
    for a, b in c.pairs:
        failed, lacking = [], {}
        for lag in c.lags:
            ra, rb, absent = _point(scope, c, a, b, lag)
            if ra.empty or rb.empty:
                failed.append(lag)
                for g, r in ((a, ra), (b, rb)):
                    if r.empty:
                        lacking.setdefault(g.label.format(lag="k"), []).append(lag)
                continue
            rows.append(_row(c, a, b, lag, ra, rb, absent, n_boot, seed))
        if failed:
            why = "; ".join(f"{who} at {_lags(lags)}" for who, lags in lacking.items())
            lines.append(f"{c.id} {a.label.format(lag='k')} vs {b.label.format(lag='k')}: not computed at "
                         f"{_lags(failed)}: no runs of {why}")
        empty.update(dict.fromkeys(lacking))
    if not rows:
        lines = [f"{c.id} ({c.wording}; {c.at}): not computed: no runs of {', '.join(empty)} at {_lags(c.lags)}"]
    return rows, lines


def contrast_table(runs: pd.DataFrame, contrasts: Sequence[Contrast] = CONTRASTS, *, n_boot: int = 10_000,
                   seed: int = 0) -> ContrastResult:
    """Every contrast of `contrasts` on the per-run table `runs` (module docstring)."""
    rows, missing = [], []
    for c in contrasts:
        scope = select(runs, c.scope)
        if scope.empty:
            if not c.conditional:
                missing.append(f"{c.id} ({c.wording}; {c.at}): not computed: no runs of {c.scope_text}")
            continue
        mine, lines = _evaluate(c, scope, n_boot, seed)
        rows += mine
        missing += lines
    table = pd.DataFrame(rows, columns=[col for col in CONTRAST_COLUMNS if not col.endswith("_holm")])
    table["fisher_p_holm"] = holm(table["fisher_p"].to_numpy(float))
    table["welch_p_holm"] = holm(table["welch_p"].to_numpy(float))
    return ContrastResult(table[list(CONTRAST_COLUMNS)], missing)


def _p(p: float, holm: float) -> str:
    return "–" if not np.isfinite(p) else f"{p:.2g} ({holm:.2g})"


def contrasts_markdown(table: pd.DataFrame, contrasts: Sequence[Contrast] = CONTRASTS) -> str:
    """`table` (CONTRAST_COLUMNS) as one Markdown table per contrast, in the README's layout:
    collapse counts are of identical-run units (`shared units`: in both groups, left out)."""
    out = []
    for c in contrasts:
        rows = table[table["contrast"] == c.id]
        if rows.empty:
            continue
        out += [f"### {c.id}: {c.wording} ({c.at})", "",
                "| lag | a vs b | collapsed (units) | Fisher p (Holm) | final success | a − b [95% CI] | "
                "Welch p (Holm) | shared units |", "|---|---|---|---|---|---|---|---|"]
        for r in rows.itertuples():
            diff = ("–" if not np.isfinite(r.success_diff) else
                    f"{r.success_diff:+.2f} [{r.success_diff_low:+.2f}, {r.success_diff_high:+.2f}]")
            success = "–" if not np.isfinite(r.success_a) or not np.isfinite(r.success_b) else \
                f"{r.success_a:.2f} vs {r.success_b:.2f}"
            out.append(f"| {r.lag} | {r.a} vs {r.b} | {r.collapsed_a} vs {r.collapsed_b} | "
                       f"{_p(r.fisher_p, r.fisher_p_holm)} | {success} | {diff} | "
                       f"{_p(r.welch_p, r.welch_p_holm)} | {r.shared_units} |")
        out.append("")
    return "\n".join(out)
