"""analysis.studies.frontier: Wilson intervals, Holm's adjustment, the cell and pairwise tables and the
frontier figure on a constructed per-run table."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers.stores import SIGNAL, SIGNAL_RUNS, workbench_uri  # noqa: F401

from analysis.group_tests import holm
from analysis.studies.frontier import (cell_table, fig_frontier, level_labels, level_order, pairwise_table,
                                       wilson_interval)


def test_wilson_interval_hand_values():
    z = 1.959963984540054
    low, high = wilson_interval(0, 3)
    assert low == 0.0
    assert high == pytest.approx((z * z / 3) / (1 + z * z / 3), rel=1e-9)  # 0.5615
    assert high == pytest.approx(0.5615, abs=1e-4)
    low, high = wilson_interval(3, 3)
    assert high == 1.0 and low == pytest.approx(1 - 0.5615, abs=1e-4)
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(4, 3)


def test_holm_step_down():
    assert holm([0.01, 0.04, 0.03]).tolist() == pytest.approx([0.03, 0.06, 0.06])
    out = holm([0.2, float("nan"), 0.001])
    assert out[0] == pytest.approx(0.2) and math.isnan(out[1]) and out[2] == pytest.approx(0.002)
    assert holm([0.9, 0.8]).tolist() == [1.0, 1.0]


def _runs() -> pd.DataFrame:
    rows = []
    for level, kp, kg in (("frontier_l1", 0, 0), ("frontier_l2", 3, 0)):
        for algo, k in (("ppo", kp), ("grpo", kg)):
            for seed in range(3):
                collapsed = seed < k
                rows.append({"experiment": level, "algo": algo, "seed": str(seed), "collapsed": collapsed,
                             "collapse_step": 5.0 + seed if collapsed else np.nan,
                             "final_success": 0.1 if collapsed else 0.9, "peak_grad_norm": 3.0 if collapsed else 1.0,
                             "mean_clipfrac": 0.1 * (seed + 1), "mean_ppo_kl": np.nan if seed == 0 else 0.02})
    return pd.DataFrame(rows)


def test_cells_pairwise_and_figure():
    runs = _runs()
    cells = cell_table(runs).set_index(["level", "algo"])
    c = cells.loc[("frontier_l2", "ppo")]
    assert (c["runs"], c["collapsed"], c["collapse_p"], c["median_onset"]) == (3, 3, 1.0, 6.0)
    assert c["collapse_p_low"] == pytest.approx(1 - 0.5615, abs=1e-4) and c["collapse_p_high"] == 1.0
    assert cells.loc[("frontier_l1", "grpo"), "final_success"] == pytest.approx(0.9)
    assert c["mean_clipfrac"] == pytest.approx(0.2) and c["mean_ppo_kl"] == pytest.approx(0.02)  # NaN left out
    pw = pairwise_table(runs).set_index("level")
    assert pw.loc["frontier_l2", "fisher_p"] == pytest.approx(0.1)  # 3/3 vs 0/3, two-sided
    assert pw.loc["frontier_l1", "fisher_p"] == 1.0
    assert pw.loc["frontier_l2", "fisher_p_holm"] == pytest.approx(0.1)  # a family of one pair
    assert level_order(["frontier_l2", "x", "frontier_l1"]) == ["frontier_l1", "frontier_l2"]
    fig = fig_frontier(cell_table(runs), ["frontier_l1", "frontier_l2"])
    assert len(fig.axes[0].lines) >= 2


def test_sweep_optimum_best_and_flatness():
    from analysis.sweeps import sweep_optimum

    trials = pd.DataFrame({"number": range(5), "state": ["COMPLETE"] * 4 + ["PRUNED"],
                           "objective": [0.80, 0.86, 0.85, 0.50, 0.1], "pruned": [False] * 4 + [True],
                           "direction": "maximize", "param:algo.clip_high": [0.1, 0.3, 0.4, 0.6, 0.2]})
    out = sweep_optimum(trials, tolerance=0.02)
    assert (out["best_trial"], out["best_objective"], out["completed"], out["pruned"]) == (1, 0.86, 4, 1)
    assert out["within_0.02"] == 2 and out["best algo.clip_high"] == 0.3
    assert out["algo.clip_high range within 0.02"] == "[0.3, 0.4]"
    assert out["top5_spread"] == pytest.approx(0.36)


def test_level_labels_name_the_settings_and_flag_mixed_ones():
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "experiment": ["frontier_l1", "frontier_l1", "frontier_l2"]})
    params = pd.DataFrame({"run_id": ["a", "a", "b", "b", "c", "c"],
                           "key": ["trainer.actor_lr", "trainer.ppo_epochs"] * 3,
                           "value": ["0.0001", "1", "0.0001", "2", "0.001", "4"]})
    labels = level_labels(runs, params, ["frontier_l1", "frontier_l2", "frontier_l9"])
    assert labels["frontier_l1"] == "frontier_l1\nlr 0.0001 x ? ep"
    assert labels["frontier_l2"] == "frontier_l2\nlr 0.001 x 4 ep"
    assert labels["frontier_l9"] == "frontier_l9"


def test_cli_on_an_exported_study_writes_the_frontier_and_warning_tables(workbench_uri, tmp_path, monkeypatch,
                                                                         capsys):
    from analysis import load_study
    from analysis.export import export_study
    from analysis.studies.frontier import main

    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    export_study(load_study(SIGNAL, workbench_uri), tmp_path / "part")
    out = tmp_path / "out"
    assert main(["--parquet", str(tmp_path / "part"), "--out", str(out), "--level-prefix", SIGNAL,
                 "--thresholds", "3,1000", "--warning-min-onset", "28"]) == 0
    cells = pd.read_csv(out / "cells.csv")
    assert cells["runs"].sum() == len(SIGNAL_RUNS)
    assert cells["collapsed"].sum() == sum(onset is not None for onset, _ in SIGNAL_RUNS)
    warning = pd.read_csv(out / "warning.csv").set_index("indicator")
    sweep = pd.read_csv(out / "warning_thresholds.csv")
    assert sorted(set(sweep["threshold"])) == [3.0, 1000.0]
    assert (sweep[sweep["threshold"] == 1000.0]["warned"] == 0).all()
    assert warning.loc["clip_frac", "collapsed_runs"] == cells["collapsed"].sum()
    late = pd.read_csv(out / "warning_onset_ge28.csv").set_index("indicator")  # onsets 25, 30, 28, 27
    assert late.loc["clip_frac", "collapsed_runs"] == 2 and late.loc["clip_frac", "stable_runs"] == 3
    assert (out / "warning_onset_ge28_thresholds.csv").exists()
    assert (out / "fig_early_warning.png").stat().st_size > 0 and (out / "fig_frontier.png").stat().st_size > 0
    assert main(["--parquet", str(tmp_path / "part"), "--out", str(tmp_path / "bad"), "--level-prefix", SIGNAL,
                 "--thresholds", "x"]) == 2
    assert "--thresholds" in capsys.readouterr().err


def test_contrast_table_pools_the_groups_and_adjusts_over_the_table():
    from analysis.studies.frontier import contrast_table

    rows = []
    for algo, collapsed in [("ppo", [1, 1, 1]), ("s_ppo", [1, 1, 0]), ("grpo", [0, 0, 0]), ("dapo", [0, 0, 1])]:
        for seed, c in enumerate(collapsed):
            rows.append({"experiment": "frontier_l3", "algo": algo, "seed": seed, "collapsed": bool(c),
                         "final_success": 0.2 if c else 0.8 + 0.01 * seed})
    runs = pd.DataFrame(rows)
    out = contrast_table(runs, {"gae vs free": (("ppo", "s_ppo"), ("grpo", "dapo")),
                                "ppo vs dapo": (("ppo",), ("dapo",)), "absent": (("ppo",), ("rloo",))})
    assert out["contrast"].tolist() == ["gae vs free", "ppo vs dapo"]  # a group with no run: no row
    first = out.iloc[0]
    assert (first["collapsed_a"], first["collapsed_b"]) == ("5/6", "1/6")
    assert first["fisher_p"] == pytest.approx(0.08008, abs=1e-4)  # Fisher's exact, [[5,1],[1,5]]
    assert first["fisher_p_holm"] == pytest.approx(min(1.0, 2 * out["fisher_p"].min()))
    assert first["success_a"] == pytest.approx((0.2 * 5 + 0.82) / 6)
