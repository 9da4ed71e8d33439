"""Pre-specified contrasts of a study, evaluated on its per-run table: the engine that studies v3
(`analysis.studies.staleness_contrasts`) and v4 (`analysis.studies.study_v4`) fill with their own
table of contrasts, written before their runs.

A contrast draws on the runs of its `scope` and has one row per point of `points` (a value of the
column `point`: a lag in v3, an off-policy level in v4) and per pair of groups; a group is a label
and a selection of runs (column -> allowed values). At a point a group takes the scope's runs at
that point, unless it names its own (v3's C7 lag-0 group). Per row: the pooled collapse counts
k/n of both groups and Fisher's exact test (two-sided); the groups' mean final success, their
difference a − b with a percentile bootstrap interval (fixed seed) and Welch's t-test; and the same
for every further outcome named in `outcomes` (v4: the area under the validation curve). Holm's
adjustment over the whole table, one family per test (`fisher_p_holm`, `welch_p_holm`,
`<outcome>_p_holm`). Every count is of identical-run units (`analysis.identical`): a unit once per
group, and a unit in both groups in neither (`shared_units` says how many; a row whose groups share
every unit has nothing to compare). A row whose group lacks some of its presets says which
(`absent`); a point where a group has no run at all gives no row, and one line of `missing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from .group_tests import holm, two_group_tests
from .identical import apart
from .stats import bootstrap_diff_ci, finite_mean, welch_test

Where = Mapping[str, tuple]


@dataclass(frozen=True)
class Group:
    """A group of runs: the scope's runs whose columns take the allowed values of `where`."""
    label: str  # `{<point>}` (e.g. `{lag}`) is filled in with the row's point
    where: Where


@dataclass(frozen=True)
class Contrast:
    """One row of a study's table of contrasts: its words, and the groups of runs they name."""
    id: str
    wording: str  # the README's "contrast"
    at: str  # the README's "at"
    expectation: str  # the README's expectation, written before the runs
    scope: Where
    scope_text: str
    points: tuple  # the values of `point` it is evaluated at
    pairs: tuple[tuple[Group, Group], ...]
    matched: str | None = None  # pool only over the values of this column that both groups have
    conditional: bool = False  # computed only where its runs exist (no line when they do not)
    point: str = "lag"  # the column the points are values of


BASE_COLUMNS = ("contrast", "level", "machine", "a", "b", "collapsed_a", "collapsed_b", "fisher_p",
                "fisher_p_holm", "success_a", "success_b", "success_diff", "success_diff_low",
                "success_diff_high", "welch_t", "welch_p", "welch_p_holm", "shared_units", "absent")


def contrast_columns(point: str = "lag", outcomes: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The table's columns: the point after `machine` (a point named like a column, v4's `level`,
    takes that column's place), and per further outcome `name` its columns before `shared_units`."""
    extra = tuple(f"{name}_{s}" for name in (outcomes or {})
                  for s in ("a", "b", "diff", "diff_low", "diff_high", "p", "p_holm"))
    cut = BASE_COLUMNS.index("a")
    tail = BASE_COLUMNS.index("shared_units")
    head = BASE_COLUMNS[:cut] if point in BASE_COLUMNS else (*BASE_COLUMNS[:cut], point)
    return (*head, *BASE_COLUMNS[cut:tail], *extra, *BASE_COLUMNS[tail:])


def select(runs: pd.DataFrame, where: Where) -> pd.DataFrame:
    """The runs whose every named column takes one of its allowed values."""
    keep = np.ones(len(runs), dtype=bool)
    for col, values in where.items():
        keep &= runs[col].isin(list(values)).to_numpy()
    return runs[keep]


@dataclass
class ContrastResult:
    table: pd.DataFrame  # `contrast_columns`, one row per computed (contrast, pair, point)
    missing: list[str] = field(default_factory=list)  # one line per contrast (pair) not computed, and why


def _label(g: Group, c: Contrast, value) -> str:
    return g.label.format(**{c.point: value})


def _at(c: Contrast, a: Group, b: Group, value, scope: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The runs of both groups at the point `value`, and the presets a group names but lacks there."""
    ra, rb = (select(scope, {c.point: (value,), **g.where}) for g in (a, b))
    absent = [f"{_label(g, c, value)}: {', '.join(x)}" for g, r in ((a, ra), (b, rb))
              if (x := [p for p in g.where.get("algo", ()) if p not in set(r["algo"])]) and len(r)]
    if c.matched and len(ra) and len(rb):
        both = set(ra[c.matched]) & set(rb[c.matched])
        dropped = sorted((set(ra[c.matched]) | set(rb[c.matched])) - both)
        ra, rb = ra[ra[c.matched].isin(both)], rb[rb[c.matched].isin(both)]
        if dropped:
            absent.append(f"not in both groups: {', '.join(dropped)}")
    return ra, rb, "; ".join(absent)


def _difference(ua: pd.DataFrame, ub: pd.DataFrame, column: str, n_boot: int, seed: int) -> dict:
    low, high = bootstrap_diff_ci(ua[column], ub[column], n_boot=n_boot, seed=seed)
    return {"a": finite_mean(ua[column]), "b": finite_mean(ub[column]),
            "diff": finite_mean(ua[column]) - finite_mean(ub[column]), "diff_low": low, "diff_high": high}


def _row(c: Contrast, a: Group, b: Group, value, ra: pd.DataFrame, rb: pd.DataFrame, absent: str,
         outcomes: Mapping[str, str], n_boot: int, seed: int) -> dict:
    both = pd.concat([ra, rb])
    tests = two_group_tests(ra, rb)
    ua, ub, _ = apart(ra, rb)
    success = _difference(ua, ub, "final_success", n_boot, seed)
    row = {"contrast": c.id, "level": ", ".join(sorted(set(both["experiment"].astype(str)))),
           "machine": ", ".join(sorted(set(both["machine"].astype(str)))), c.point: value,
           "a": _label(a, c, value), "b": _label(b, c, value), **tests,
           "success_diff": success["diff"], "success_diff_low": success["diff_low"],
           "success_diff_high": success["diff_high"], "absent": absent}
    for name, column in outcomes.items():
        d = _difference(ua, ub, column, n_boot, seed)
        row |= {f"{name}_{k}": v for k, v in d.items()}
        row[f"{name}_p"] = welch_test(ua[column], ub[column])["p"]
    return row


def _points(c: Contrast, values: Sequence) -> str:
    return f"{c.point}{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}"


def _evaluate(c: Contrast, scope: pd.DataFrame, outcomes: Mapping[str, str], n_boot: int,
              seed: int) -> tuple[list[dict], list[str]]:
    """The rows of one contrast and its lines for what could not be computed: one per pair (the
    points it lacks, and which group has no runs at which point), or one for the whole contrast
    when it has no row at all."""
    rows, lines, empty = [], [], {}
    for a, b in c.pairs:
        failed, lacking = [], {}
        for value in c.points:
            ra, rb, absent = _at(c, a, b, value, scope)
            if ra.empty or rb.empty:
                failed.append(value)
                for g, r in ((a, ra), (b, rb)):
                    if r.empty:
                        lacking.setdefault(_label(g, c, "k"), []).append(value)
                continue
            rows.append(_row(c, a, b, value, ra, rb, absent, outcomes, n_boot, seed))
        if failed:
            why = "; ".join(f"{who} at {_points(c, values)}" for who, values in lacking.items())
            lines.append(f"{c.id} {_label(a, c, 'k')} vs {_label(b, c, 'k')}: not computed at "
                         f"{_points(c, failed)}: no runs of {why}")
        empty.update(dict.fromkeys(lacking))
    if not rows:
        lines = [f"{c.id} ({c.wording}; {c.at}): not computed: no runs of {', '.join(empty)} at "
                 f"{_points(c, c.points)}"]
    return rows, lines


def contrast_table(runs: pd.DataFrame, contrasts: Sequence[Contrast], *, outcomes: Mapping[str, str] | None = None,
                   n_boot: int = 10_000, seed: int = 0) -> ContrastResult:
    """Every contrast of `contrasts` (all of one `point` column) on the per-run table `runs`;
    `outcomes`: further outcomes, name -> column (module docstring)."""
    outcomes = dict(outcomes or {})
    points = {c.point for c in contrasts}
    if len(points) != 1:
        raise ValueError(f"contrasts of one table share their point column, not {sorted(points)}")
    columns = contrast_columns(points.pop(), outcomes)
    rows, missing = [], []
    for c in contrasts:
        scope = select(runs, c.scope)
        if scope.empty:
            if not c.conditional:
                missing.append(f"{c.id} ({c.wording}; {c.at}): not computed: no runs of {c.scope_text}")
            continue
        mine, lines = _evaluate(c, scope, outcomes, n_boot, seed)
        rows += mine
        missing += lines
    table = pd.DataFrame(rows, columns=[col for col in columns if not col.endswith("_holm")])
    for p in ("fisher_p", "welch_p", *(f"{name}_p" for name in outcomes)):
        table[f"{p}_holm"] = holm(table[p].to_numpy(float))
    return ContrastResult(table[list(columns)], missing)


def _p(p: float, holm: float) -> str:
    return "–" if not np.isfinite(p) else f"{p:.2g} ({holm:.2g})"


def interval_text(value: float, low: float, high: float, *, signed: bool = False) -> str:
    """`value [low, high]` to 2 decimals (with signs for a difference); a value without an interval
    (too few finite values to resample) alone, and "–" for no value."""
    if not np.isfinite(value):
        return "–"
    f = "+.2f" if signed else ".2f"
    if not (np.isfinite(low) and np.isfinite(high)):
        return f"{value:{f}}"
    return f"{value:{f}} [{low:{f}}, {high:{f}}]"


def _diff(d: float, low: float, high: float) -> str:
    return interval_text(d, low, high, signed=True)


def _pair(a: float, b: float) -> str:
    return "–" if not np.isfinite(a) or not np.isfinite(b) else f"{a:.2f} vs {b:.2f}"


def contrasts_markdown(table: pd.DataFrame, contrasts: Sequence[Contrast], *,
                       outcomes: Mapping[str, str] | None = None) -> str:
    """`table` (`contrast_columns`) as one Markdown table per contrast: collapse counts are of
    identical-run units (`shared units`: in both groups, left out); a further outcome gets its
    means, difference and Welch p after final success's."""
    out = []
    names = list(outcomes or {})
    for c in contrasts:
        rows = table[table["contrast"] == c.id]
        if rows.empty:
            continue
        extra_head = "".join(f" {n} | {n}: a − b [95% CI] | {n}: Welch p (Holm) |" for n in names)
        out += [f"### {c.id}: {c.wording} ({c.at})", "",
                f"| {c.point} | a vs b | collapsed (units) | Fisher p (Holm) | final success | a − b [95% CI] | "
                f"Welch p (Holm) |{extra_head} shared units |", "|---" * (8 + 3 * len(names)) + "|"]
        for r in rows.to_dict("records"):
            extra = "".join(
                f" {_pair(r[f'{n}_a'], r[f'{n}_b'])} | "
                f"{_diff(r[f'{n}_diff'], r[f'{n}_diff_low'], r[f'{n}_diff_high'])} | "
                f"{_p(r[f'{n}_p'], r[f'{n}_p_holm'])} |" for n in names)
            out.append(f"| {r[c.point]} | {r['a']} vs {r['b']} | {r['collapsed_a']} vs {r['collapsed_b']} | "
                       f"{_p(r['fisher_p'], r['fisher_p_holm'])} | {_pair(r['success_a'], r['success_b'])} | "
                       f"{_diff(r['success_diff'], r['success_diff_low'], r['success_diff_high'])} | "
                       f"{_p(r['welch_p'], r['welch_p_holm'])} |{extra} {r['shared_units']} |")
        out.append("")
    return "\n".join(out)
