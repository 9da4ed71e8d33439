"""Sweeps: an Optuna study's trials, their parameters against the objective, pruned trials marked."""

import streamlit as st

from analysis.store import AnalysisError
from analysis.sweeps import fig_sweep, list_sweeps, param_columns, trials_frame
from dashboard import common

st.header("Sweeps")
storage = str(st.session_state.get(common.OPTUNA_KEY, "")).strip()
try:
    names = list_sweeps(storage)
except AnalysisError as e:
    st.warning(f"{e}. Set the Optuna storage URL in the sidebar.")
    st.stop()
if not names:
    st.info(f"The Optuna storage {storage} has no studies yet.")
    st.stop()

name = st.selectbox("Study", names, key="sweeps:study")
try:
    trials = trials_frame(storage, name)
except AnalysisError as e:
    st.warning(str(e))
    st.stop()
if trials.empty:
    st.info(f"Study {name} has no trials yet.")
    st.stop()

counts = trials["state"].value_counts()
st.markdown(f"**{len(trials)} trials** in {name} ({trials['direction'].iloc[0]}): "
            + ", ".join(f"{n} {state.lower()}" for state, n in counts.items()))
params = param_columns(trials)
chosen = st.multiselect("Parameters", params, default=params, format_func=lambda c: c.removeprefix("param:"),
                        key=f"sweeps:params:{name}")
st.pyplot(fig_sweep(trials, params=chosen or params, title=name))
st.dataframe(trials, hide_index=True)
