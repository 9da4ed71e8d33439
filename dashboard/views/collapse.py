"""Collapse diagnosis of one run: the paper's Fig. 2 panels as interactive charts (drag over steps on
the first panel to filter the others; wheel to zoom, drag to pan; hover for values) with the
collapse step marked, followed by the sampler vs trainer mismatch and staleness panels the run
logged (`rollout_corr/*`, `offpolicy/*`); any logged metric can be added as a panel; a turn × step
heatmap of any per-turn metric, and of the per-turn sampler/trainer KL (`turn/k{k}/rollout_kl`)."""

import streamlit as st

from analysis import charts as C
from analysis.axes import lag_label
from analysis.figures import ADVANTAGES, MISMATCH_PANELS, TURN_MISMATCH
from dashboard import common
from stppo import metric_names as T

st.header("Collapse diagnosis")
study, runs, _, kept = common.page_runs("collapse")

labels = common.ordered_runs(kept)
run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="collapse:run")
row = kept[kept["run_id"] == run_id].iloc[0]

metrics = study.metrics[study.metrics["run_id"] == run_id]
logged = sorted(metrics["metric"].astype(str).unique())
shown = {*ADVANTAGES, T.VALID_ACTION_RATIO, T.GRAD_NORM, T.GRAD_NORM_MAX, T.SUCCESS_RATE, T.VAL_SUCCESS_RATE,
         *(k for _, keys in MISMATCH_PANELS for k in keys)}
extra = st.multiselect("Add metrics", [m for m in logged if m not in shown and T.parse_turn_key(m) is None
                                       and not m.startswith(T.TURN_PREFIX)], key="collapse:extra")

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
    st.info("This run did not log " + ", ".join(f"`{m}`" for m in missing) + ": those panels are left out.")
mismatch = [(title, keys) for title, keys in MISMATCH_PANELS if set(keys) & set(logged)]
if mismatch:
    stale = f"rollouts {lag_label(row['lag'], row['lag_mode'])} behind" if row["lag"] else "no stale rollouts"
    correction = f", rollout correction {row['correction']}" if row["correction"] != "none" else ""
    st.caption(f"Below Fig. 2: the sampler vs trainer mismatch and staleness panels ({stale}{correction}).")
step = row["collapse_step"] if row["collapsed"] else None
panels = [("success rate (drag here to select steps)", (T.SUCCESS_RATE, T.VAL_SUCCESS_RATE)),
          ("advantages", ADVANTAGES), ("valid action ratio", (T.VALID_ACTION_RATIO,)),
          ("grad norm (pre-clip)", (T.GRAD_NORM, T.GRAD_NORM_MAX))] + mismatch + [(m, (m,)) for m in extra]
st.caption("Drag over steps on the first panel to filter the others (double-click clears); mouse wheel zooms "
           "and dragging pans the others; hover for values. The red dashed line is the collapse step.")
common.chart(C.run_panels(study.metrics, run_id, panels, collapse_step=step), "This run logged none of these metrics.")

st.subheader("Per turn")
names = C.turn_names(study.metrics, run_id)
if not names:
    st.info("This run logged no per-turn metrics (`turn/k{k}/…`, diagnostics.per_turn).")
else:
    name = st.selectbox("Per-turn metric", names, key="collapse:turn_metric")
    frame = C.turn_frame(study.metrics, run_id, name)
    common.chart(C.turn_heatmap(frame, name, collapse_step=step), f"No values of turn/k*/{name}.")
turn_kl = C.turn_frame(study.metrics, run_id, TURN_MISMATCH)
if len(turn_kl):
    st.subheader("Per-turn sampler vs trainer mismatch")
    st.caption(f"`turn/k*/{TURN_MISMATCH}`: the KL between the sampler's and the trainer's log-probs on the agent "
               "tokens of turn k, per step — which turn diverges first.")
    common.chart(C.turn_heatmap(turn_kl, TURN_MISMATCH, collapse_step=step), "")
st.caption(f"run_id {run_id} · experiment {row['experiment']}")
