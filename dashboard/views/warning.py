"""Early warning: for every alarm indicator of stppo.alarms, the lead time before the collapse onset,
the false-alarm rate in runs without collapse and the ROC AUC over thresholds, with the threshold,
the persistence and the baseline adjustable; and one indicator's alarm statistic per run."""

import math

import pandas as pd
import streamlit as st

from analysis import charts as C
from analysis.warning import INDICATORS, AlarmConfig, fig_early_warning, run_warnings, warning_table
from dashboard import common



def _iqr(q1: float, q3: float) -> str:
    return "–" if math.isnan(q1) else f"{q1:g} – {q3:g}"


st.header("Early warning")
study, runs, collapse, kept = common.page_runs("warning", columns=("algo", "model", "task"))

default = AlarmConfig()
c1, c2, c3 = st.columns(3)
h = c1.slider("Threshold h (robust z)", 0.5, 20.0, float(default.threshold), 0.5, key="warning:threshold")
persist = c2.number_input("Consecutive values P", 1, 10, default.persist, key="warning:persist")
baseline = c3.number_input("Baseline values W", 3, 50, default.baseline_steps, key="warning:baseline")
cfg = AlarmConfig(threshold=h, persist=int(persist), baseline_steps=int(baseline))
st.caption(f"Rule (stppo.alarms): z = robust z-score of each indicator against the run's first {cfg.baseline_steps} "
           f"logged values (median, 1.4826·MAD, floored); an alarm fires when z ≥ {h:g} on {cfg.persist} "
           "consecutive values. Lead time = collapse onset − first alarm (alarms after the onset do not count); "
           "false alarm = a run without collapse with any alarm; AUC over thresholds of each run's max statistic.")

ids = set(kept["run_id"].astype(str))
stats = common.warning_stats(study.uri, study.experiments, cfg.persist, cfg.baseline_steps)
stats = stats[stats["run_id"].isin(ids)]
sub = collapse[collapse["run_id"].astype(str).isin(ids)]
n_col, n_ok = int(sub["collapsed"].sum()), int((~sub["collapsed"]).sum())
st.markdown(f"**{common.plural(n_col, 'collapsed run')}**, {common.plural(n_ok, 'run')} without collapse.")
if n_col == 0:
    st.info("No selected run collapsed: lead times need collapsed runs (the false alarms are still counted).")
if stats.empty:
    st.info("The selected runs logged none of the indicators' metrics, or too few steps for a baseline.")
    st.stop()

per_run = run_warnings(study, stats, cfg, sub)
table = warning_table(per_run, cfg, all_runs=len(kept))
logged = table[table["collapsed_runs"] + table["stable_runs"] > 0]
shown = pd.DataFrame({
    "indicator": logged["indicator"], "metric": logged["metric"], "direction": logged["direction"],
    "h": logged["threshold"], "warned k/n": [f"{w}/{n}" for w, n in zip(logged["warned"], logged["collapsed_runs"])],
    "lead median": logged["lead_median"],
    "lead IQR": [_iqr(a, b) for a, b in zip(logged["lead_q1"], logged["lead_q3"])],
    "false alarms": [f"{f}/{n}" for f, n in zip(logged["false_alarms"], logged["stable_runs"])],
    "false-alarm rate": logged["false_alarm_rate"], "ROC AUC": logged["auc"]})
st.table(common.pretty(shown), hide_index=True)
st.pyplot(fig_early_warning(logged, per_run))
with st.expander("Full table"):
    st.dataframe(table, hide_index=True)

st.subheader("Alarm statistic per run")
names = [n for n in INDICATORS if n in set(logged["indicator"])]
name = st.selectbox("Indicator", names, key="warning:indicator")
common.chart(C.alarm_chart(stats, sub, name, h), f"No statistic of {name}.")
with st.expander("Per run"):
    st.dataframe(per_run[per_run["indicator"] == name], hide_index=True)
