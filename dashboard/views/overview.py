"""Overview: every run of the selected experiments with status, tags, collapse and final metrics;
presets split by the study's axes (level = experiment, lag, lag mode) where they vary."""

import streamlit as st

import analysis
from analysis import charts as C
from analysis.axes import varies
from analysis.stats import GROUP
from dashboard import common
from stppo import metric_names as T

st.header("Overview")
study, runs, _, kept = common.page_runs("overview")
split = common.split_by(kept, "overview")

by_preset = kept.groupby("algo", sort=True)
parts = [f"{algo}: {common.plural(len(g), 'run')}, {int(g['collapsed'].sum())} collapsed" for algo, g in by_preset]
st.markdown(f"**{common.plural(len(kept), 'run')}** in {', '.join(study.experiments)} — " + "; ".join(parts))

summary = analysis.preset_table(study, by=(*split, *GROUP), runs=kept)
table = summary[[*split, "algo", "model", "task", "collapsed", "median_collapse_step", "final_success_mean",
                 "final_success_ci_low", "final_success_ci_high", "final_success_n"]].rename(columns={
    **{c: common.SPLITS[c] for c in split}, "algo": "preset", "collapsed": "collapsed k/n",
    "median_collapse_step": "median collapse step", "final_success_mean": "final val success (mean)",
    "final_success_ci_low": "95% CI low", "final_success_ci_high": "95% CI high", "final_success_n": "seeds"})
st.table(common.pretty(table), hide_index=True)

axes = [c for c in ("experiment", "lag", "lag_mode", "correction") if varies(kept, c)]
columns = ["run_name", "algo", *axes, "model", "task", "seed", "status", "collapsed", "collapse_step", "last_step",
           "final_success", "final_train_success", "peak_grad_norm", "mean_clipfrac", "mean_ppo_kl", "sweep",
           "git_commit", "run_id"]
st.subheader("Runs")
st.dataframe(kept[columns], hide_index=True, width="stretch",
             column_config={"final_success": st.column_config.NumberColumn("final val success", format="%.3f"),
                            "peak_grad_norm": st.column_config.NumberColumn(format="%.3f"),
                            "mean_clipfrac": st.column_config.NumberColumn(format="%.4f"),
                            "mean_ppo_kl": st.column_config.NumberColumn(format="%.4f")})

st.subheader("Success by preset")
metrics = common.series_metrics(study.metrics, kept, split)
key = T.VAL_SUCCESS_RATE if (metrics["metric"] == T.VAL_SUCCESS_RATE).any() else T.SUCCESS_RATE
common.chart(C.band_charts(metrics, [key]), f"No {key} logged yet.")
st.caption(f"{key}: mean and 95% band across seeds (hover for the number of seeds).")
