"""`python -m analysis.report --experiment NAME [--experiment NAME2] --out DIR [--tracking-uri URI]`
(or `--parquet DIR` [...]: a study exported by `python -m analysis.export`)

Writes to DIR: the figures (fig2_collapse_<preset>_<model>_<run>, fig3_token_vs_turn,
fig4_success_by_preset, fig5_clip_kl, fig6_early_warning; PNG and PDF), the tables (runs, presets,
significance, growth, growth_summary, warning, warning_runs; CSV) and summary.md. A bad
experiment, an empty one or an unreachable
store ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from stppo import metric_names as T
from stppo.alarms import AlarmConfig
from stppo.tracker import resolve_uri

from .collapse import collapse_table
from .figures import fig_clip_kl, fig_collapse_diagnosis, fig_success_by_preset, fig_token_vs_turn
from .load import Study, load_study
from .store import AnalysisError
from .summary import write_summary
from .tables import growth_summary, growth_table, per_run_table, preset_table, significance_table
from .warning import early_warning, fig_early_warning


def default_tracking_uri() -> str:
    return resolve_uri(None)  # $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db


def _save(fig, out: Path, stem: str) -> list[str]:
    names = []
    for ext in ("png", "pdf"):
        fig.savefig(out / f"{stem}.{ext}", dpi=120)
        names.append(f"{stem}.{ext}")
    return names


def diagnosis_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """One run per (preset, model) for Fig. 2: its earliest collapse, else its first run."""
    order = runs.assign(_c=runs["collapse_step"].fillna(float("inf"))).sort_values(["algo", "model", "_c", "seed"])
    return order.groupby(["algo", "model"], sort=True).head(1).drop(columns="_c")


def write_report(study: Study, out: Path, *, window: int = 20, smoothing: float = 0.0, log_scale: bool = False,
                 n_boot: int = 10_000, control: str = "last", alarm: AlarmConfig | None = None) -> dict[str, Path]:
    """Compute every table and figure of `study` into `out`; returns {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    collapse = collapse_table(study)
    runs = per_run_table(study, collapse)
    presets = preset_table(study, runs=runs)
    sig = significance_table(study, runs=runs, n_boot=n_boot)
    growth = growth_table(study, window=window, control=control, collapse=collapse)
    gsum = growth_summary(growth)
    alarm = alarm or AlarmConfig()
    warning, warning_runs = early_warning(study, alarm, collapse=collapse)
    tables = {"runs": runs, "presets": presets, "significance": sig, "growth": growth, "growth_summary": gsum,
              "warning": warning, "warning_runs": warning_runs}
    for name, frame in tables.items():
        frame.to_csv(out / f"{name}.csv", index=False)
    figures: list[str] = []
    notes = _missing_notes(study)
    for _, r in diagnosis_runs(runs).iterrows():
        fig = fig_collapse_diagnosis(study.metrics, r["run_id"], collapse_step=r["collapse_step"],
                                     title=f"{r['algo']} · {r['model']} · seed {r['seed']} — {r['run_id']}")
        figures += _save(fig, out, f"fig2_collapse_{r['algo']}_{r['model']}_{str(r['run_id'])[:8]}")
    kw = {"smoothing": smoothing}
    figures += _save(fig_token_vs_turn(study.metrics, log_scale=log_scale, **kw), out, "fig3_token_vs_turn")
    figures += _save(fig_success_by_preset(study.metrics, **kw), out, "fig4_success_by_preset")
    figures += _save(fig_clip_kl(study.metrics, log_scale=log_scale, **kw), out, "fig5_clip_kl")
    logged = warning[warning["collapsed_runs"] + warning["stable_runs"] > 0]  # indicators some run logged
    figures += _save(fig_early_warning(logged, warning_runs), out, "fig6_early_warning")
    text = write_summary(uri=study.uri, experiments=study.experiments, runs=runs, presets=presets,
                         significance=sig, growth_summary=gsum, window=window, figures=figures, skipped=notes,
                         warning=warning, alarm=alarm)
    (out / "summary.md").write_text(text)
    paths = {name: out / f"{name}.csv" for name in tables}
    paths |= {f: out / f for f in figures}
    paths["summary"] = out / "summary.md"
    return paths


def _missing_notes(study: Study) -> list[str]:
    logged = set(study.metric_names())
    wanted = (T.SUCCESS_RATE, T.VAL_SUCCESS_RATE, T.GRAD_NORM, T.PG_LOSS_NORM, T.CLIP_BIAS_NORM, T.PG_CLIPFRAC,
              T.PPO_KL, T.VALID_ACTION_RATIO, T.ADV_MEAN)
    return [f"`{k}` was not logged by any run: its panels show a note." for k in wanted if k not in logged]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", action="append", required=True, help="MLflow experiment name (repeatable)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--tracking-uri", default=default_tracking_uri(),
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    p.add_argument("--window", type=int, default=20, help="steps of the clip-bias growth fit (default 20)")
    p.add_argument("--control", choices=("last", "matched"), default="last",
                   help="growth-fit window of runs that did not collapse")
    p.add_argument("--smoothing", type=float, default=0.0, help="EMA smoothing of curves in [0, 1)")
    p.add_argument("--log-scale", action="store_true", help="log y axis for norms, clip ratio and KL")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    p.add_argument("--no-cache", action="store_true", help="read every run from the store")
    p.add_argument("--parquet", action="append", type=Path, default=None,
                   help="read the runs from folders written by `python -m analysis.export` instead of "
                        "the tracking store (repeatable: parts of one study)")
    p.add_argument("--alarm-threshold", type=float, default=AlarmConfig.threshold,
                   help=f"early-warning threshold h, robust z (default {AlarmConfig.threshold:g})")
    p.add_argument("--alarm-persist", type=int, default=AlarmConfig.persist,
                   help=f"consecutive values at or beyond h (default {AlarmConfig.persist})")
    p.add_argument("--alarm-baseline", type=int, default=AlarmConfig.baseline_steps,
                   help=f"first values that form each indicator's baseline (default {AlarmConfig.baseline_steps})")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not 0.0 <= args.smoothing < 1.0:
            raise AnalysisError(f"--smoothing must be in [0, 1), got {args.smoothing}")
        if args.window < 3:
            raise AnalysisError(f"--window must be >= 3 steps, got {args.window}")
        try:
            alarm = AlarmConfig(threshold=args.alarm_threshold, persist=args.alarm_persist,
                                baseline_steps=args.alarm_baseline)
        except ValueError as e:
            raise AnalysisError(str(e)) from None
        if args.parquet:
            from .export import load_exported

            study = load_exported(args.parquet, args.experiment)
        else:
            study = load_study(args.experiment, args.tracking_uri, use_cache=not args.no_cache)
        paths = write_report(study, args.out, window=args.window, smoothing=args.smoothing,
                             log_scale=args.log_scale, n_boot=args.bootstrap, control=args.control, alarm=alarm)
    except AnalysisError as e:
        print(f"analysis.report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} files to {args.out} (summary: {paths['summary']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
