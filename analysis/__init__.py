"""MLflow runs -> tidy pandas frame -> statistics across seeds, tables and the paper's figures.

Reads MLflow only (never torch, never `stppo.train`): `load_study` for data, `collapse_table` for the
one collapse rule, `aggregate`/`preset_table`/`significance_table`/`growth_table` for numbers, `early_warning` for the
lead time / false alarms / ROC AUC of every alarm indicator, the `fig_*` functions for figures
(`analysis.charts`: their interactive Altair forms), `analysis.samples` for the sampled
trajectories, `python -m analysis.report` for all of it on disk, and `python -m analysis.studies.frontier`
for the stability frontier of a study along the level, the lag of stale rollouts or both
(`analysis.axes` reads a run's lag, lag mode and rollout correction from its params).
"""

from .collapse import collapse_table, run_collapse
from .figures import fig_clip_kl, fig_collapse_diagnosis, fig_success_by_preset, fig_token_vs_turn
from .load import Study, collapse_config, list_experiments, load_study
from .stats import (aggregate, bootstrap_diff_ci, bootstrap_mean_ci, ema, fit_exponential, metric_kind, t_interval,
                    welch_test)
from .store import (
    AnalysisError,
    EmptyExperimentError,
    StoreNotFoundError,
    StoreUnreachableError,
    UnknownExperimentError,
)
from .tables import (
    final_success,
    growth_summary,
    growth_table,
    per_run_table,
    per_run_value,
    preset_table,
    significance_table,
)
from .warning import early_warning, fig_early_warning, roc_auc, run_statistics, run_warnings, warning_table

__all__ = [
    "AnalysisError", "EmptyExperimentError", "StoreNotFoundError", "StoreUnreachableError",
    "UnknownExperimentError", "Study", "aggregate", "bootstrap_diff_ci", "bootstrap_mean_ci", "collapse_config",
    "collapse_table", "early_warning", "ema", "fig_clip_kl", "fig_collapse_diagnosis", "fig_early_warning",
    "fig_success_by_preset", "fig_token_vs_turn", "final_success", "fit_exponential", "growth_summary",
    "growth_table", "list_experiments", "load_study", "metric_kind", "per_run_table", "per_run_value",
    "preset_table", "roc_auc", "run_collapse", "run_statistics", "run_warnings", "significance_table",
    "t_interval", "warning_table", "welch_test",
]
