"""TEST-ONLY: the dashboard's collapse page over an MLflow store, in stppo's environment (.venv:
streamlit is not in the verl environment). Prints one JSON line for the verl suite to check.

    .venv/bin/python tests/verl/loop/dashboard_check.py EXPERIMENT CACHE_DIR   (MLFLOW_TRACKING_URI set)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

APP = str(Path(__file__).resolve().parents[3] / "dashboard" / "app.py")


def main(experiment: str, cache_dir: str) -> dict:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    os.environ["STPPO_CACHE_DIR"] = cache_dir
    st.cache_data.clear()
    at = AppTest.from_file(APP, default_timeout=300).run()
    at = at.sidebar.multiselect[0].set_value([experiment]).run()
    errors = [str(e.value) for e in at.exception]
    runs = at.dataframe[0].value if at.dataframe else None
    at.switch_page("views/collapse.py").run()
    errors += [str(e.value) for e in at.exception]
    run_box = at.selectbox(key="collapse:run")
    turn_box = at.selectbox(key="collapse:turn_metric")
    return {"errors": errors, "overview_run_ids": sorted(runs["run_id"]) if runs is not None else [],
            "collapse_runs": list(run_box.options), "collapse_run": str(run_box.value),
            "turn_metrics": list(turn_box.options), "charts": len(at.get("vega_lite_chart")),
            "experiment": experiment}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
