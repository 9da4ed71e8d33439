"""Study v4 (docs/results/study_v4/README.md): its runs sorted into off-policy levels, its cells,
the pre-specified contrasts D1–D8 and the KL-matched control.

    python -m analysis.studies.study_v4 --data docs/results/study_v4/data --out docs/results/study_v4
    python -m analysis.studies.study_v4 --tracking-uri sqlite:///study_v4.db --out OUT   # from the store

Runs (the testbed's experiments: `testbed` — on-policy and the stale levels — and `testbed_reuse`;
the pilot's extra seed sits in `study_v4_pilot`, no part of any contrast) get the axis columns of
`analysis.axes`, the actor learning rate `lr`, a `machine` (all cpu here), the `host` it ran on (its
tag: the CPU kernels torch used, which can change a run's trajectory) and a
`level`:

    on     experiment `testbed`, lag 0;
    reuse  experiment `testbed_reuse`, lag 0 (`+regime=reuse`: 16 updates per batch);
    lag2   experiment `testbed`, lag 2, in the coupled form (`algo.rollout_correction=bypass_ppo_clip`);
    lag4   the same at lag 4.

Other runs belong to no level and are left out (listed by experiment). `algo` is the run's
preset in the coupled form (whose every run carries the correction: `ppo`, not
`ppo+bypass_ppo_clip`) and its preset label otherwise (`grpo+decoupled_token_is`). A cell is
(model, level, lr, algo); a seed of a cell run twice counts once (its first run).

The contrasts (`CONTRASTS`, the README's table, evaluated by `analysis.contrasts` with the area
under the validation curve as the second outcome) use the study's learning rate 2e-4; D4 — st_ppo
against ppo at a matched per-step KL — is the KL-matched control (`analysis.kl_control`) on the
reuse level's ladder of ppo learning rates, and joins the table's Holm families.

Predicting collapse (`hazard`, `analysis.hazard`): over the levels' runs of tiny, each identical
unit once, the hazard model against the best single indicator and the config-only model (config:
lag, updates per batch, learning rate, critic), cross-validated by base preset (also the inner
folds that choose the L2 strength), and trained on seeds 0–2, tested on 3–4.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from stppo.tracker import resolve_uri

from .. import contrasts as engine
from .. import hazard as hz
from ..axes import base_preset, with_axes
from ..contrasts import Contrast, Group
from ..export import load_exported, merge_stores
from ..identical import merged_units
from ..kl_control import kl_matched_table, with_lr
from ..load import Study
from ..store import AnalysisError
from ..tables import per_run_table, repeated_seeds
from .frontier import cell_table
from .study_v4_figures import write_figures

ON, REUSE, PILOT = "testbed", "testbed_reuse", "study_v4_pilot"
EXPERIMENTS = (ON, REUSE, PILOT)
LEVELS = ("on", "reuse", "lag2", "lag4")
STALE = ("reuse", "lag2", "lag4")
COUPLED = "bypass_ppo_clip"
LR = 2e-4  # the study's actor learning rate (the testbed's)
FACTORIAL = ("ppo", "turn_ppo", "s_ppo", "st_ppo")
CRITIC = FACTORIAL + ("so_ppo",)
CRITIC_FREE = ("grpo", "so_grpo", "dapo", "cispo")
DTI = "grpo+decoupled_token_is"
UNFINISHED = ("RUNNING", "SCHEDULED")
CELL = ("model", "level", "lr")
OUTCOMES = {"auc": "val_auc"}  # the second primary outcome, after collapse
UPDATES_PER_BATCH = {"on": 2, "reuse": 16, "lag2": 2, "lag4": 2}
TRAIN_SEEDS = (0, 1, 2)  # the seed split: these fit, the others are held out


def level_column(runs: pd.DataFrame) -> pd.Series:
    """The off-policy level of each run of a table with `experiment`, `lag`, `correction` (module
    docstring); None for a run of no level."""
    exp, lag, corr = runs["experiment"].astype(str), runs["lag"].astype(int), runs["correction"].astype(str)
    level = pd.Series(None, index=runs.index, dtype=object)
    level[exp.eq(ON) & lag.eq(0)] = "on"
    level[exp.eq(REUSE) & lag.eq(0)] = "reuse"
    for k in (2, 4):
        level[exp.eq(ON) & lag.eq(k) & corr.eq(COUPLED)] = f"lag{k}"
    return level


NOT_RECORDED = "cpu (not recorded)"


def host_column(study: Study, run_ids: pd.Series) -> np.ndarray:
    """Each run's `host` tag (`cpu:AVX512`, `cpu:AVX2`, …: the CPU kernels torch trained with), or
    `NOT_RECORDED` for a run made before the tag existed."""
    tags = study.runs.set_index(study.runs["run_id"].astype(str))
    host = tags["host"] if "host" in tags.columns else pd.Series(dtype=object)
    host = host.reindex(run_ids.astype(str)).astype(object)
    return host.where(host.notna() & host.astype(str).ne("") & host.astype(str).ne("nan"), NOT_RECORDED).to_numpy()


@dataclass
class V4Runs:
    runs: pd.DataFrame  # the per-run table of the levels' finished runs (module docstring)
    pilot: pd.DataFrame  # the pilot's own runs (experiment `study_v4_pilot`)
    unfinished: int  # runs of a level left out because they are still running
    other: int  # runs of the study's experiments that belong to no level (nor to the pilot)
    repeats: int = 0  # runs left out as repeats of a cell's seed


def v4_runs(study: Study) -> V4Runs:
    """The per-run table of the study (module docstring)."""
    every = with_lr(with_axes(per_run_table(study), study.params), study.params)
    every["machine"] = "cpu"
    every["host"] = host_column(study, every["run_id"])
    every["level"] = level_column(every).to_numpy()
    coupled = every["level"].isin(["lag2", "lag4"])
    every["algo"] = np.where(coupled, every["base_algo"].astype(str), every["algo"].astype(str))
    pilot = every[every["experiment"].astype(str).eq(PILOT)]
    mine = every[every["level"].notna()]
    other = int((every["level"].isna() & ~every.index.isin(pilot.index)).sum())
    running = mine["status"].astype(str).isin(UNFINISHED)
    done = mine[~running]
    repeat = repeated_seeds(done, study, [*CELL, "algo", "seed"])
    return V4Runs(done[~repeat].reset_index(drop=True), pilot.reset_index(drop=True), int(running.sum()),
                  other, int(repeat.sum()))


def _g(presets: Sequence[str], label: str | None = None, **where: tuple) -> Group:
    return Group(label or ", ".join(presets), {"algo": tuple(presets), **where})


def _c(id: str, wording: str, at: str, expectation: str, levels: Sequence[str], pairs, model: str | None = "tiny",
       **kw) -> Contrast:
    scope = {"lr": (LR,), **({"model": (model,)} if model else {})}
    text = f"{model or 'every model'} at lr {LR:g}"
    return Contrast(id, wording, at, expectation, scope, text, tuple(levels), tuple(pairs), point="level", **kw)


CONTRASTS: tuple[Contrast, ...] = (
    _c("D1", "clipping-bias normalisation on (s_ppo, st_ppo) vs off (ppo, turn_ppo)", "reuse, lag2, lag4",
       "the paper: fewer collapses, higher AUC; v2/v3 saw none at l2", STALE,
       [(_g(("s_ppo", "st_ppo")), _g(("ppo", "turn_ppo")))]),
    _c("D2", "turn-level ratios (turn_ppo, st_ppo) vs token-level (ppo, s_ppo)", "reuse, lag2, lag4",
       "the paper: fewer collapses; v2 saw more clipping and lower success at l2", STALE,
       [(_g(("turn_ppo", "st_ppo")), _g(("ppo", "s_ppo")))]),
    _c("D3", "st_ppo vs ppo", "every level", "the paper's headline: st_ppo keeps learning where ppo collapses",
       LEVELS, [(_g(("st_ppo",)), _g(("ppo",)))]),
    _c("D5", "on-policy: each factorial preset vs ppo", "on", "no difference (nothing to stabilise)", ("on",),
       [(_g((p,)), _g(("ppo",))) for p in ("turn_ppo", "s_ppo", "st_ppo")]),
    _c("D6", "grpo + decoupled_token_is vs grpo", "reuse", "open", ("reuse",), [(_g((DTI,)), _g(("grpo",)))]),
    _c("D7", "critic-free (grpo, so_grpo, dapo, cispo) vs critic (ppo, turn_ppo, s_ppo, st_ppo, so_ppo)",
       "reuse, lag4", "v2: the critic set the frontier; v3 (units once): no difference", ("reuse", "lag4"),
       [(_g(CRITIC_FREE, "critic-free"), _g(CRITIC, "critic"))]),
    _c("D8", "small vs tiny, ppo and st_ppo", "reuse", "open", ("reuse",),
       [(_g((p,), f"small {p}", model=("small",)), _g((p,), f"tiny {p}", model=("tiny",))) for p in ("ppo", "st_ppo")],
       model=None),
)
D4 = ("D4", "st_ppo vs ppo at the matched per-step KL (analysis.kl_control)", "reuse",
      "if D3 holds, it holds at matched KL too (\"more stable\", not \"moves less\")")
KL_STABILISERS = ("st_ppo", "s_ppo", "turn_ppo")


def kl_control(runs: pd.DataFrame) -> pd.DataFrame:
    """The KL-matched control on the reuse level of tiny: each of `KL_STABILISERS` at the study's lr
    paired with the rung of ppo's learning-rate ladder nearest its mean per-step KL."""
    reuse = runs[(runs["level"] == "reuse") & (runs["model"] == "tiny")]
    table = kl_matched_table(reuse, KL_STABILISERS, x=("level",))
    return table[np.isclose(table["lr"].astype(float), LR)].reset_index(drop=True)


def d4_contrast(kl: pd.DataFrame) -> Contrast | None:
    """D4 as a contrast of the engine (its counts, intervals and tests as every other row's): tiny's
    st_ppo at the study's lr against ppo at the rung of the control's st_ppo row; None where that row
    is not matched (the ladder does not reach st_ppo's KL)."""
    row = kl[(kl["stabiliser"] == "st_ppo") & kl["matched"]]
    if row.empty:
        return None
    r = row.iloc[0]
    rung = float(r["matched_lr"])
    b = _g(("ppo",), f"ppo at lr {rung:g} (step KL {r['matched_step_kl']:.2g} vs {r['step_kl']:.2g})", lr=(rung,))
    return Contrast(D4[0], D4[1], D4[2], D4[3], {"model": ("tiny",)}, "tiny at the matched learning rates",
                    ("reuse",), ((_g(("st_ppo",), lr=(LR,)), b),), point="level")


def v4_contrasts(runs: pd.DataFrame, *, n_boot: int = 10_000, seed: int = 0) -> engine.ContrastResult:
    """D1–D8 (module docstring), Holm over the whole table (D4 included)."""
    d4 = d4_contrast(kl_control(runs))
    table = tuple(sorted(CONTRASTS + ((d4,) if d4 else ()), key=lambda c: c.id))  # the README's order
    res = engine.contrast_table(runs, table, outcomes=OUTCOMES, n_boot=n_boot, seed=seed)
    if d4 is None:
        res.missing.append(f"{D4[0]} ({D4[1]}; {D4[2]}): not computed: no ppo rung within a factor 2 of "
                           "st_ppo's step KL (or no runs)")
    return res


ALL_CONTRASTS = tuple(sorted(CONTRASTS + (Contrast(*D4, {}, "", ("reuse",), (), point="level"),),
                            key=lambda c: c.id))  # the order of the README's table, for the Markdown


def hazard_evaluation(study: Study, runs: pd.DataFrame, settings: hz.HazardSettings = hz.HazardSettings(), *,
                      n_boot: int = 1000) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The hazard model's summary (one row per validation and model) and its comparisons with the
    two baselines (td AUC differences with bootstrap intervals), on tiny's runs, units once."""
    tiny = runs[runs["model"] == "tiny"].drop_duplicates("unit")
    config = pd.DataFrame({"lag": tiny["lag"].astype(float).to_numpy(),
                           "updates": tiny["level"].map(UPDATES_PER_BATCH).astype(float).to_numpy(),
                           "log_lr": np.log10(tiny["lr"].astype(float)).to_numpy(),
                           "critic": tiny["algo"].map(base_preset).isin(CRITIC).astype(float).to_numpy()},
                          index=tiny["run_id"].astype(str))
    onsets = dict(zip(tiny["run_id"].astype(str), tiny["collapse_step"].where(tiny["collapsed"]).astype(float)))
    feats = hz.step_features(study, list(config.index))
    rows = hz.hazard_rows(feats, onsets, config, settings.horizon)
    preset = pd.Series(tiny["algo"].map(base_preset).to_numpy(), index=config.index)
    seed = pd.Series(np.where(tiny["seed"].astype(int).isin(TRAIN_SEEDS), "train", "test"), index=config.index)
    summaries, comparisons = [], []
    for name, fold, train in (("by preset", preset, None), ("seeds 0–2 → 3–4", seed, ["train"])):
        try:
            held = hz.held_out(rows, fold, preset, settings, train=train)
        except ValueError as e:
            summaries.append(pd.DataFrame([{"validation": name, "model": f"not computed: {e}"}]))
            continue
        summaries.append(hz.summarise(held, settings, name))
        for other in (hz.BEST_SINGLE, hz.CONFIG_ONLY):
            comparisons.append({"validation": name, **hz.compare(held, hz.HAZARD, other, n_boot=n_boot)})
    summary = pd.concat(summaries, ignore_index=True).reindex(columns=list(hz.SUMMARY_COLUMNS))
    counts = ["runs", "collapsed_runs", "rows"]  # counts, blank on a row not computed (not floats)
    summary[counts] = summary[counts].astype("Int64")
    return summary, pd.DataFrame(comparisons)


def cells_markdown(cells: pd.DataFrame) -> str:
    """The page's cell tables from `cells.csv`: one per model and level (in `LEVELS` order), a row per
    preset and learning rate: runs, collapsed k/n with the Wilson interval, median onset, and the
    final validation and `val_auc` means with their bootstrap intervals, and the mean step KL."""
    out = []
    rank = {lv: i for i, lv in enumerate(LEVELS)}
    keys = sorted(set(zip(cells["model"], cells["level"])),
                  key=lambda k: (k[0] != "tiny", k[0], rank.get(k[1], len(LEVELS))))
    for model, level in keys:
        c = cells[(cells["model"] == model) & (cells["level"] == level)]
        c = c.sort_values(["lr", "algo"], ascending=[False, True])
        out += [f"#### {model}, {level}", "",
                "| preset | lr | runs | collapsed [95% CI] | median onset | final validation [95% CI] "
                "| val_auc [95% CI] | mean step KL |",
                "|---|---|---|---|---|---|---|---|"]
        for _, r in c.iterrows():
            onset = "–" if not np.isfinite(r["median_onset"]) else f"{r['median_onset']:g}"
            final, auc = (engine.interval_text(r[k], r[f"{k}_low"], r[f"{k}_high"])
                          for k in ("final_success", "val_auc"))
            out.append(f"| {r['algo']} | {r['lr']:g} | {int(r['runs'])} | {int(r['collapsed'])}/{int(r['runs'])} "
                       f"[{r['collapse_p_low']:.2f}, {r['collapse_p_high']:.2f}] | {onset} | "
                       f"{final} | {auc} | {r['mean_step_kl']:.2g} |")
        out.append("")
    return "\n".join(out)


def write_study(study: Study, out: Path, *, n_boot: int = 10_000) -> tuple[V4Runs, engine.ContrastResult]:
    """The study's tables, written to `out`: runs.csv (one row per run), cells.csv and cells.md,
    merged_units.csv (the identical-run units of more than one run, each counted once),
    kl_control.csv, contrasts.csv and .md (D1–D8), not_computed.txt, hazard.csv and
    hazard_compare.csv, and the figures of `analysis.studies.study_v4_figures` that have runs."""
    vr = v4_runs(study)
    if vr.runs.empty:
        raise AnalysisError(f"no run of study v4's levels in {study.uri} (experiments there: "
                            f"{', '.join(map(str, study.experiments))}); its levels are {ON} at lag 0, 2 or 4 "
                            f"(the lags in the coupled form, {COUPLED}) and {REUSE}")
    out.mkdir(parents=True, exist_ok=True)
    keep = ["run_id", "experiment", "host", "level", "model", "lr", "algo", "seed", "unit", "collapsed", "collapse_step",
            "final_success", "val_auc", "mean_step_kl", "mean_clipfrac", "clip_bias_triggered", "peak_grad_norm",
            "last_step"]
    vr.runs[keep].sort_values(["model", "level", "lr", "algo", "seed"]).to_csv(out / "runs.csv", index=False)
    cells = cell_table(vr.runs, x=CELL, means=("val_auc", "mean_step_kl"), intervals=("val_auc",))
    cells.to_csv(out / "cells.csv", index=False)
    (out / "cells.md").write_text(cells_markdown(cells))
    merged_units(vr.runs).to_csv(out / "merged_units.csv", index=False)
    kl_control(vr.runs).to_csv(out / "kl_control.csv", index=False)
    res = v4_contrasts(vr.runs, n_boot=n_boot)
    res.table.to_csv(out / "contrasts.csv", index=False)
    (out / "contrasts.md").write_text(engine.contrasts_markdown(res.table, ALL_CONTRASTS, outcomes=OUTCOMES))
    (out / "not_computed.txt").write_text("".join(f"{line}\n" for line in res.missing))
    summary, comparisons = hazard_evaluation(study, vr.runs)
    summary.to_csv(out / "hazard.csv", index=False)
    comparisons.to_csv(out / "hazard_compare.csv", index=False)
    write_figures(study, vr.runs, cells, out, levels=LEVELS, lr=LR, stabilisers=KL_STABILISERS)
    return vr, res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.studies.study_v4", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", nargs="+", type=Path, help="folders written by `python -m analysis.export`")
    src.add_argument("--tracking-uri", action="append", help="the study's store; repeat to merge stores")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples of the differences")
    a = p.parse_args(argv)
    try:
        study = (load_exported(a.data) if a.data else
                 merge_stores(list(EXPERIMENTS), [resolve_uri(u) for u in a.tracking_uri], finished_only=True))
        vr, res = write_study(study, a.out, n_boot=a.n_boot)
    except AnalysisError as e:
        print(f"python -m analysis.studies.study_v4: error: {e}", file=sys.stderr)
        return 2
    levels = vr.runs.groupby(["model", "level"]).size()
    print("runs: " + "; ".join(f"{m} {lv}: {n}" for (m, lv), n in levels.items())
          + f" (pilot {len(vr.pilot)}; left out: {vr.unfinished} unfinished, {vr.repeats} repeats"
          + f", {vr.other} of no level)")
    print(f"wrote runs.csv, cells.csv, cells.md, merged_units.csv, kl_control.csv, "
          f"contrasts.csv ({len(res.table)} rows), "
          f"contrasts.md, not_computed.txt, hazard.csv, hazard_compare.csv and the figures to {a.out}")
    for line in res.missing:
        print(f"  not computed: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
