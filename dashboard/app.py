"""stppo stability dashboard: `streamlit run dashboard/app.py` (binds 127.0.0.1, see .streamlit/).

Pages: Overview (runs, status, final metrics), Collapse diagnosis (one run, the paper's Fig. 2 with
the sampler/trainer mismatch and staleness panels, and turn × step heatmaps), Variant comparison
(Figs. 3-5 and the statistics tables), Stability frontier (P(collapse) per cell against the level,
the lag of stale rollouts, or both), Samples (the saved trajectories by run and step), Early warning
(lead time, false alarms and ROC AUC per alarm indicator), Sweeps (Optuna trials). Presets are split
by the study's axes (level, lag) where they vary. Charts are interactive (Altair). The tracking URI
defaults to $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; the Optuna storage to $OPTUNA_STORAGE,
else sqlite:///optuna.db.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # so `import analysis, dashboard` work from a plain checkout too
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from dashboard import common  # noqa: E402

st.set_page_config(page_title="stppo stability", page_icon="📉", layout="wide")
common.sidebar()
pages = [
    st.Page("views/overview.py", title="Overview", url_path="overview", default=True),
    st.Page("views/collapse.py", title="Collapse diagnosis", url_path="collapse"),
    st.Page("views/compare.py", title="Variant comparison", url_path="compare"),
    st.Page("views/frontier.py", title="Stability frontier", url_path="frontier"),
    st.Page("views/samples.py", title="Samples", url_path="samples"),
    st.Page("views/warning.py", title="Early warning", url_path="warning"),
    st.Page("views/sweeps.py", title="Sweeps", url_path="sweeps"),
]
st.navigation(pages).run()
