"""Collapse diagnosis of one run: the paper's Fig. 2 panels with the collapse step marked; any logged
metric can be added as a panel."""

import math

import streamlit as st

import analysis
from analysis.figures import ADVANTAGES
from dashboard import common
from stppo import tracking as T

st.header("Collapse diagnosis")
study, runs, _, kept = common.page_runs("collapse")

order = kept.assign(_c=kept["collapse_step"].fillna(math.inf)).sort_values(["_c", "algo", "model", "seed"])
labels = {r["run_id"]: common.run_label(r) for _, r in order.iterrows()}
run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="collapse:run")
row = kept[kept["run_id"] == run_id].iloc[0]

metrics = study.metrics[study.metrics["run_id"] == run_id]
logged = sorted(metrics["metric"].astype(str).unique())
shown = {*ADVANTAGES, T.VALID_ACTION_RATIO, T.GRAD_NORM, T.GRAD_NORM_MAX, T.SUCCESS_RATE, T.VAL_SUCCESS_RATE}
extra = st.multiselect("Add metrics", [m for m in logged if m not in shown], key="collapse:extra")

c1, c2, c3, c4 = st.columns(4)
c1.metric("Status", row["status"])
c2.metric("Collapse step", "none" if not row["collapsed"] else int(row["collapse_step"]))
c3.metric("Final val success", common.fmt_number(row["final_success"]))
c4.metric("Peak grad norm", common.fmt_number(row["peak_grad_norm"]))
if row["collapsed"]:
    st.warning(f"Collapsed at step {int(row['collapse_step'])} of {int(row['last_step'])}.")
else:
    st.success("No collapse detected by the rule of stppo.diagnostics.")

missing = [m for m in (T.SUCCESS_RATE, T.VAL_SUCCESS_RATE, T.GRAD_NORM, T.VALID_ACTION_RATIO, T.ADV_MEAN)
           if m not in logged]
if missing:
    st.info("This run did not log " + ", ".join(f"`{m}`" for m in missing) + ": those panels show a note.")
step = row["collapse_step"] if row["collapsed"] else None
fig = analysis.fig_collapse_diagnosis(study.metrics, run_id, collapse_step=step, extra_metrics=extra,
                                      title=common.run_label(row))
st.pyplot(fig)
st.caption(f"run_id {run_id} · experiment {row['experiment']}")
