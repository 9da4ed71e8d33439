"""`python -m stppo.where`: where a run's results are and how to open them (printed by `make demo`).

Every path printed is absolute, so the commands work from any directory."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from stppo.tracker import absolute_uri, resolve_uri

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"


def main() -> None:
    uri = absolute_uri(resolve_uri())
    exe, store = Path(sys.executable).parent, shlex.quote(uri)
    report = Path("reports/stppo").resolve()
    print(f"""
Results
  MLflow store : {uri}
  checkpoints  : {Path('runs').resolve()}
Open them
  MLflow UI    : {exe}/mlflow ui --backend-store-uri {store} --host 127.0.0.1
                 (then http://127.0.0.1:5000)
  dashboard    : MLFLOW_TRACKING_URI={store} {exe}/streamlit run {DASHBOARD}
                 (then http://127.0.0.1:8501)
  report       : {exe}/python -m analysis.report --tracking-uri {store} --experiment stppo \\
                     --out {report}
""")


if __name__ == "__main__":
    main()
