"""`python -m analysis.report`: the files it writes, their numbers, and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
from helpers.stores import EMPTY, KNOWN, cache_tmp, closed_port, known_uri  # noqa: F401

from analysis.report import main


def _cli(*args: str, cache) -> subprocess.CompletedProcess:
    env = os.environ | {"STPPO_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "analysis.report", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_report_writes_figures_tables_and_summary(known_uri, tmp_path, cache_tmp):
    out = tmp_path / "report"
    code = main(["--experiment", KNOWN, "--out", str(out), "--tracking-uri", known_uri, "--window", "10",
                 "--bootstrap", "2000"])
    assert code == 0
    names = {p.name for p in out.iterdir()}
    for stem in ("fig3_token_vs_turn", "fig4_success_by_preset", "fig5_clip_kl"):
        assert {f"{stem}.png", f"{stem}.pdf"} <= names
    runs = pd.read_csv(out / "runs.csv", dtype={"seed": str}).set_index(["algo", "seed"])
    earliest = runs.loc[("ppo", "0"), "run_id"][:8]  # ppo's earliest collapse (step 15)
    fig2 = {n for n in names if n.startswith("fig2_collapse_") and n.endswith(".png")}
    assert f"fig2_collapse_ppo_tiny_{earliest}.png" in fig2 and len(fig2) == 3  # one per (preset, model)
    assert {"runs.csv", "presets.csv", "significance.csv", "growth.csv", "growth_summary.csv", "summary.md"} <= names
    assert all((out / n).stat().st_size > 0 for n in names)
    presets = pd.read_csv(out / "presets.csv").set_index("algo")
    assert presets.loc["ppo", "collapsed"] == "2/3" and presets.loc["st_ppo", "collapsed"] == "0/3"
    growth = pd.read_csv(out / "growth.csv")
    assert growth.loc[growth["collapsed"], "growth_rate"].round(6).tolist()[1:] == [0.2, 0.05]  # grpo: no norm logged
    assert growth.loc[growth["algo"] == "grpo", "points"].item() == 0
    md = (out / "summary.md").read_text()
    assert "| ppo | tiny | synthetic_multihop | 2/3 |" in md
    assert "before collapse: b = 0.125 per step" in md  # median of 0.2 and 0.05
    assert "Welch's two-sided t-test" in md and "0.517 [0.100, 0.750] (n=3)" in md  # ppo: 0.1, 0.7, 0.75
    warning = pd.read_csv(out / "warning.csv")
    assert list(warning["indicator"])[:2] == ["clip_bias_growth", "grad_norm_spike"] and "warning.csv" in names
    assert "## Early warning of collapse" in md and {"fig6_early_warning.png", "fig6_early_warning.pdf"} <= names


def test_bad_experiment_exits_nonzero_with_one_line(known_uri, tmp_path):
    """The real command line: exit status 2 and one line on stderr."""
    res = _cli("--experiment", "nope", "--out", str(tmp_path / "o"), "--tracking-uri", known_uri,
               cache=tmp_path / "cache")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "experiment 'nope' not found" in lines[0] and KNOWN in lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["empty", "unreachable", "missing_file"])
def test_store_problems_exit_nonzero_with_one_line(case, known_uri, tmp_path, cache_tmp, capsys):
    uri = {"empty": known_uri, "unreachable": f"http://127.0.0.1:{closed_port()}",
           "missing_file": f"sqlite:///{tmp_path / 'absent.db'}"}[case]
    exp = EMPTY if case == "empty" else KNOWN
    code = main(["--experiment", exp, "--out", str(tmp_path / "o"), "--tracking-uri", uri])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("analysis.report: error: ")
    expected = {"empty": "has no runs", "unreachable": "is unreachable", "missing_file": "tracking store not found"}
    assert expected[case] in err[0]
