"""`python -m stppo.where`: where a run's results are and how to open them (printed by `make demo`)."""

from __future__ import annotations

import sys
from pathlib import Path

from stppo.tracking import resolve_uri


def main() -> None:
    uri = resolve_uri()
    exe = Path(sys.executable).parent
    print(f"""
Results
  MLflow store : {uri}
  checkpoints  : {Path('runs').resolve()}
Open them
  MLflow UI    : {exe}/mlflow ui --backend-store-uri {uri} --host 127.0.0.1   (then http://127.0.0.1:5000)
  dashboard    : {exe}/streamlit run dashboard/app.py                          (http://127.0.0.1:8501)
  report       : {exe}/python -m analysis.report --experiment stppo --out reports/stppo
""")


if __name__ == "__main__":
    main()
