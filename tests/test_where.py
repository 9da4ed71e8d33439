"""`python -m stppo.where` (printed by `make demo`): its commands work from any directory."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stppo.tracker import absolute_uri


def where(cwd: Path, uri: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    if uri is not None:
        env["MLFLOW_TRACKING_URI"] = uri
    out = subprocess.run([sys.executable, "-m", "stppo.where"], cwd=cwd, env=env, check=True,
                         capture_output=True, text=True).stdout
    lines, joined = out.splitlines(), {}
    for i, line in enumerate(lines):  # "  name : command", continued on indented lines
        if " : " in line:
            name, text = line.split(" : ", 1)
            more = [m.strip() for m in lines[i + 1:i + 3]
                    if m.startswith(" " * 17) and " : " not in m and "(then" not in m]
            joined[name.strip()] = " ".join([text.strip(), *more]).replace("\\ ", "")
    return joined


@pytest.mark.parametrize("uri, db", [(None, "mlflow.db"), ("sqlite:///sub/x.db", "sub/x.db")])
def test_where_prints_absolute_store_and_app_paths(tmp_path, uri, db):
    got = where(tmp_path, uri)
    store = f"sqlite:///{tmp_path / db}"
    assert got["MLflow store"] == store
    assert got["checkpoints"] == str(tmp_path / "runs")
    ui = shlex.split(got["MLflow UI"])
    assert ui[ui.index("--backend-store-uri") + 1] == store
    dash = shlex.split(got["dashboard"])
    assert dash[0] == f"MLFLOW_TRACKING_URI={store}"
    app = Path(dash[-1])
    assert dash[-2] == "run" and app.is_absolute() and app.is_file()
    assert (app.parent.name, app.name) == ("dashboard", "app.py")
    report = shlex.split(got["report"])
    assert report[report.index("--tracking-uri") + 1] == store
    assert report[report.index("--out") + 1] == str(tmp_path / "reports" / "stppo")


@pytest.mark.parametrize("uri, expected", [
    ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
    ("sqlite:///:memory:", "sqlite:///:memory:"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ("file:///tmp/mlruns", "file:///tmp/mlruns"),
])
def test_absolute_uri_leaves_other_uris_alone(uri, expected):
    assert absolute_uri(uri) == expected


def test_absolute_uri_resolves_a_relative_sqlite_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_uri("sqlite:///a/../m.db") == f"sqlite:///{tmp_path / 'm.db'}"
