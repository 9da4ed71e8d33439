"""Stability frontier: the collapse probability of every cell (x, preset) with its Wilson 95%
interval against the study's axis of off-policyness — the level (each selected experiment), the
lag of stale rollouts (`trainer.offpolicy.lag`, each lag mode its own cell), or both (one panel per
level) —, the cells' table, and the pairwise tests and pooled contrasts per x with Holm's
adjustment (`analysis.studies.frontier`, the tables of `python -m analysis.studies.frontier`)."""

import pandas as pd
import streamlit as st

from analysis import charts as C
from analysis.axes import varies
from analysis.studies.frontier import build_frontier, level_labels
from analysis.store import AnalysisError
from dashboard import common

AXIS_LABELS = {"level": "level (experiment)", "lag": "lag (trainer.offpolicy.lag)", "both": "level × lag"}


def _interval(low: float, high: float) -> str:
    return "–" if low != low else f"[{low:.2f}, {high:.2f}]"


st.header("Stability frontier")
study, runs, _, kept = common.page_runs("frontier", columns=("algo", "model", "task"))
default = "lag" if varies(kept, "lag") else "level"
axis = st.radio("Axis", list(AXIS_LABELS), index=list(AXIS_LABELS).index(default), format_func=AXIS_LABELS.get,
                horizontal=True, key="frontier:axis")
try:
    front = build_frontier(study, kept, axis=axis, prefix="")
except AnalysisError as e:
    st.info(str(e))
    st.stop()
names = [n for n in ("level", "lag", "lag_mode") if n in front.cells.columns]
x, order = ("level", front.levels) if axis == "level" else ("lag", front.lags)
chart = C.frontier_chart(front.cells, x, order)  # along both: one panel per level
st.markdown(f"**{common.plural(len(front.runs), 'run')}** in {common.plural(len(front.cells), 'cell')}: "
            + (f"levels {', '.join(front.levels)}" if front.levels else "")
            + (" × " if front.levels and axis == "both" else "")
            + (f"lags {', '.join(map(str, front.lags))}" if axis != "level" else ""))
if axis == "level" and len(front.levels) < 2:
    st.info("One level: choose several experiments (one per off-policyness level) in the sidebar to draw a frontier.")
if axis != "level" and not varies(front.runs, "lag"):
    st.info("Every selected run has lag 0 (no `trainer.offpolicy.lag`): the lag axis has one point.")
common.chart(chart, "No cells to draw.")
st.caption("Points: collapsed share of a cell's runs; bars: Wilson 95% interval; a corrected preset "
           "(`preset+correction`) dashed. Hover for k/n, the median onset and final success.")

cells = front.cells
table = cells[[*names, "algo"]].rename(columns={"algo": "preset", "lag_mode": "lag mode"}).assign(**{
    "collapsed k/n": [f"{k}/{n}" for k, n in zip(cells["collapsed"], cells["runs"])],
    "P(collapse)": cells["collapse_p"],
    "95% CI": [_interval(a, b) for a, b in zip(cells["collapse_p_low"], cells["collapse_p_high"])],
    "median onset": cells["median_onset"], "final success": cells["final_success"],
    "final success 95% CI": [_interval(a, b) for a, b in zip(cells["final_success_low"], cells["final_success_high"])],
    "peak grad norm": cells["peak_grad_norm"]})
st.table(common.pretty(table), hide_index=True)
if axis != "lag" and front.levels:
    with st.expander("What each level is (its runs' settings)"):
        settings = level_labels(study.runs, study.params, front.levels)
        st.table(pd.DataFrame({"level": list(settings), "settings": [v.partition("\n")[2] or "–"
                                                                   for v in settings.values()]}), hide_index=True)
with st.expander("Pairwise tests per x (Fisher's exact test on collapses, Welch's t-test on final success; Holm)"):
    st.dataframe(front.pairwise, hide_index=True)
with st.expander("Pooled contrasts (critic vs critic-free, token vs turn, corrected vs not; Holm over the table)"):
    st.dataframe(front.contrasts, hide_index=True)
if len(front.critic):
    with st.expander("Critic warm start: warm vs cold runs of a cell"):
        st.dataframe(front.critic, hide_index=True)
