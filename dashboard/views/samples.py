"""Samples: the trajectories a run saved (`samples/step_*.json` table artifacts) by run and step, with
the actions marked and the observations set apart; the step nearest the collapse comes first."""

import pandas as pd
import streamlit as st

from analysis.samples import default_step, trajectories
from analysis.store import AnalysisError
from dashboard import common
from dashboard.render import trajectory_html

st.header("Samples")
study, runs, _, kept = common.page_runs("samples")
uri = study.uri

labels = common.ordered_runs(kept)
run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="samples:run")
row = kept[kept["run_id"] == run_id].iloc[0]
try:
    steps = common.saved_steps(uri, run_id)
except AnalysisError as e:
    st.warning(str(e))
    st.stop()
if not steps:
    st.info("This run saved no sampled trajectories (diagnostics.samples_every = 0, or the run predates them).")
    st.stop()

collapse = row["collapse_step"] if row["collapsed"] else None
first = default_step(steps, collapse)
step = st.select_slider("Step", options=steps, value=first, key=f"samples:step:{run_id}")
where = f"collapse onset at step {int(collapse)}; " if collapse is not None else "no collapse; "
st.caption(f"Saved at steps {', '.join(map(str, steps))} — {where}"
           f"{'the step nearest the collapse' if collapse is not None else 'the last step'} ({first}) comes first.")
try:
    frame = common.samples(uri, run_id, int(step))
except AnalysisError as e:
    st.warning(str(e))
    st.stop()

agent = frame[frame["role"] == "agent"]
trajs = trajectories(frame)
c1, c2, c3, c4 = st.columns(4)
c1.metric("Trajectories", len(trajs))
c2.metric("Mean reward", common.fmt_number(pd.Series([t["reward"] for t in trajs]).mean()))
c3.metric("Searches / answers / invalid", " / ".join(str(int((agent["action"] == a).sum()))
                                                         for a in ("search", "answer", "invalid")))
c4.metric("Max turn ratio", common.fmt_number(agent["ratio_max"].max()))
show_prompt = st.toggle("Show prompts", value=False, key="samples:prompts")
for traj in trajs:
    st.html(trajectory_html(traj, show_prompt=show_prompt))
with st.expander("As a table"):
    st.dataframe(frame, hide_index=True)
st.caption(f"run_id {run_id} · artifact samples/step_{int(step):06d}.json")
