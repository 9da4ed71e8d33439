"""The staleness axis of the stability frontier: the runs' lag, lag mode and rollout correction read
from their params (`analysis.axes`), cells and tests per lag on hand-made tables, and the lag and
level × lag frontiers (tables, figures, early warning per lag) on a real MLflow store of synthetic
stale runs with known collapse counts (`fixtures.stale_runs`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers.stores import STALE, STALE_B, stale_b_cells, workbench_uri  # noqa: F401

from analysis import load_study
from analysis.axes import base_preset, preset_label, split_label, with_axes
from analysis.studies.frontier import build_frontier, cell_table, contrast_table, main, pairwise_table
from analysis.figures import TURN_MISMATCH
from fixtures.runs import turn_metric
from fixtures.stale_runs import STALE_CELLS
from stppo import metric_names as T


def test_axes_from_params_with_defaults_for_older_runs():
    runs = pd.DataFrame({"run_id": ["a", "b", "c", "d"], "algo": ["ppo", "grpo", "grpo", "ppo"],
                         "experiment": ["x", "x", "x", "critic_ws_l2"]})
    params = pd.DataFrame({"run_id": ["b", "b", "b", "c", "c", "c", "a", "d"],
                           "key": ["trainer.offpolicy.lag", "trainer.offpolicy.lag_mode", "algo.rollout_correction",
                                   "trainer.offpolicy.lag", "trainer.offpolicy.lag_mode", "algo.rollout_correction",
                                   "trainer.critic_warmstart.enabled", "trainer.critic_warmstart.enabled"],
                           "value": ["4", "uniform", "decoupled_geo_rs", "2", "fixed", "none", "True", "False"]})
    out = with_axes(runs, params).set_index("run_id")
    assert out["lag"].tolist() == [0, 4, 2, 0]  # a and d predate trainer.offpolicy: lag 0
    assert out["lag_mode"].tolist() == ["fixed", "uniform", "fixed", "fixed"]
    assert out["correction"].tolist() == ["none", "decoupled_geo_rs", "none", "none"]
    assert out["algo"].tolist() == ["ppo", "grpo+decoupled_geo_rs", "grpo", "ppo"]
    assert out["base_algo"].tolist() == ["ppo", "grpo", "grpo", "ppo"]
    assert out["critic_warmstart"].tolist() == [True, False, False, True]  # the param, or a critic_ws_ experiment
    assert with_axes(out.reset_index(), params).equals(out.reset_index())  # idempotent
    assert preset_label("grpo", "none") == "grpo" and base_preset("grpo+decoupled_geo_rs") == "grpo"


def test_split_label_names_only_what_varies():
    runs = pd.DataFrame({"algo": ["ppo", "ppo", "grpo"], "lag": [0, 2, 2], "lag_mode": ["fixed", "fixed", "uniform"],
                         "experiment": ["e", "e", "e"]})
    both = ["ppo · lag 0", "ppo · lag 2", "grpo · lag 2 uniform"]
    assert split_label(runs, ["experiment", "lag", "lag_mode"]).tolist() == both
    assert split_label(runs, ["lag"]).tolist() == ["ppo · lag 0", "ppo · lag 2", "grpo · lag 2"]
    assert split_label(runs, ["lag_mode"]).tolist() == ["ppo · fixed", "ppo · fixed", "grpo · uniform"]
    assert split_label(runs.iloc[:1], ["lag"]).tolist() == ["ppo"]


def _runs() -> pd.DataFrame:
    """ppo and grpo at lags 0 and 2 (3 seeds), and grpo+decoupled_geo_rs at lag 2; collapses: ppo 0/3,
    3/3; grpo 0/3, 2/3; grpo+correction 0/3."""
    rows = []
    for algo, lag, k in (("ppo", 0, 0), ("ppo", 2, 3), ("grpo", 0, 0), ("grpo", 2, 2), ("grpo+decoupled_geo_rs", 2, 0)):
        for seed in range(3):
            c = seed < k
            rows.append({"experiment": "stale", "algo": algo, "lag": lag, "lag_mode": "fixed", "seed": seed,
                         "collapsed": c, "collapse_step": 10.0 + seed if c else np.nan,
                         "final_success": 0.1 if c else 0.8, "peak_grad_norm": 2.0, "mean_clipfrac": 0.1,
                         "mean_ppo_kl": 0.01})
    return pd.DataFrame(rows)


def test_cells_tests_and_contrasts_per_lag():
    runs, x = _runs(), ("lag", "lag_mode")
    cells = cell_table(runs, x=x).set_index(["lag", "algo"])
    assert list(cell_table(runs, x=x).columns[:3]) == ["lag", "lag_mode", "algo"]
    assert (cells.loc[(2, "ppo"), "collapsed"], cells.loc[(2, "grpo"), "collapsed"]) == (3, 2)
    assert cells.loc[(2, "grpo+decoupled_geo_rs"), "collapse_p_high"] == pytest.approx(0.5615, abs=1e-4)
    assert cells.loc[(2, "grpo"), "median_onset"] == 10.5
    pw = pairwise_table(runs, x=x)
    assert len(pw[pw["lag"] == 0]) == 1 and len(pw[pw["lag"] == 2]) == 3  # one family per lag
    two = pw[pw["lag"] == 2].set_index(["a", "b"])
    assert two.loc[("grpo", "ppo"), "fisher_p"] == pytest.approx(1.0)
    assert two.loc[("grpo+decoupled_geo_rs", "ppo"), "fisher_p"] == pytest.approx(0.1)
    # Holm within the lag-2 family of three pairs
    assert two.loc[("grpo+decoupled_geo_rs", "ppo"), "fisher_p_holm"] == pytest.approx(0.3)
    con = contrast_table(runs, x=x).set_index(["lag", "contrast"])
    assert con.loc[(2, "grpo vs grpo+decoupled_geo_rs"), "collapsed_a"] == "2/3"
    assert con.loc[(2, "grpo vs grpo+decoupled_geo_rs"), "collapsed_b"] == "0/3"
    assert con.loc[(2, "critic (GAE) vs critic-free"), "collapsed_b"] == "2/3"  # the corrected grpo is not pooled
    assert (0, "grpo vs grpo+decoupled_geo_rs") not in con.index  # no corrected runs at lag 0


def test_critic_table_by_lag_compares_warm_and_cold_runs_of_a_cell():
    from analysis.studies.critic_warmstart import critic_table_by
    from analysis.load import Study

    runs = pd.DataFrame({"run_id": list("abcd"), "experiment": ["e"] * 4, "algo": ["ppo"] * 4, "lag": [2] * 4,
                         "lag_mode": ["fixed"] * 4, "critic_warmstart": [True, True, False, False],
                         "collapsed": [True, False, True, True], "final_success": [0.2, 0.8, 0.1, 0.1]})
    metrics = pd.DataFrame({"run_id": list("aabbcd"), "step": [0, 1, 0, 1, 1, 1],
                            "metric": [T.CRITIC_WS_EV_BEFORE, T.VF_EXPLAINED_VAR] * 2 + [T.VF_EXPLAINED_VAR] * 2,
                            "value": [-0.2, 0.1, -0.4, 0.3, -0.1, -0.3]})
    study = Study("x", ("e",), runs[["run_id", "experiment"]], metrics)
    row = critic_table_by(study, runs, x=("lag", "lag_mode")).iloc[0]
    assert (row["lag"], row["algo"], row["collapsed_warm"], row["collapsed_cold"]) == (2, "ppo", "1/2", "2/2")
    assert row["ws_ev_before"] == pytest.approx(-0.3) and row["train_ev_cold"] == pytest.approx(-0.2)
    assert row["final_success_warm"] == pytest.approx(0.5)


@pytest.fixture(scope="module")
def stale(workbench_uri, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("stale_cache")))
        return load_study([STALE, STALE_B], workbench_uri)


def test_synthetic_stale_runs_log_the_mismatch_and_staleness_metrics(stale):
    m = stale.metrics
    ppo0 = stale.runs[(stale.runs["experiment"] == STALE) & (stale.runs["algo"] == "ppo")]["run_id"]
    names = set(m["metric"].astype(str))
    assert {T.ROLLOUT_CORR_CHI2_TOKEN, T.OFFPOLICY_KL_TO_CURRENT, turn_metric(2, TURN_MISMATCH)} <= names
    assert {T.alarm_key("rollout_chi2"), T.alarm_key("offpolicy_kl")} <= names
    lag_keys = set(stale.params.loc[stale.params["run_id"].isin(ppo0), "key"])
    assert "trainer.offpolicy.lag" in lag_keys  # ppo at lag 0 is the only cell written without it
    old = stale.params[stale.params["key"] == "trainer.offpolicy.lag"]["run_id"]
    assert len(stale.runs) - old.nunique() == 2


def test_lag_frontier_has_the_known_collapse_counts(stale):
    front = build_frontier(stale, axis="lag")
    assert front.lags == [0, 1, 2, 4] and front.x == ("lag", "lag_mode")
    cells = front.cells.set_index(["lag", "lag_mode", "algo"])
    expected = {}
    for cell in (*STALE_CELLS, *stale_b_cells()):
        key = (cell.lag, cell.lag_mode, preset_label(cell.algo, cell.correction))
        runs, k = expected.get(key, (0, 0))
        expected[key] = (runs + cell.runs, k + cell.collapsed)
    assert {key: (int(r["runs"]), int(r["collapsed"])) for key, r in cells.iterrows()} == expected
    assert cells.loc[(4, "uniform", "ppo"), "collapsed"] == 1  # the lag mode is a cell of its own
    assert front.critic.empty and set(front.contrasts["contrast"]) >= {"grpo vs grpo+decoupled_geo_rs"}


def test_level_by_lag_frontier_and_grid_figure(stale):
    from analysis.studies.frontier import frontier_figure

    front = build_frontier(stale, axis="both", prefix="stale_")
    assert front.levels == [STALE, STALE_B]
    cells = front.cells.set_index(["level", "lag", "lag_mode", "algo"])
    assert (cells.loc[(STALE_B, 0, "fixed", "ppo"), "collapsed"], cells.loc[(STALE, 0, "fixed", "ppo"), "collapsed"]) == (1, 0)
    fig = frontier_figure(front, stale)
    assert len(fig.axes) == 2 and [a.get_title() for a in fig.axes] == [STALE, STALE_B]
    assert len(fig.axes[0].get_xticklabels()) == 4  # lags 0, 1, 2, 4 in every panel


def test_cli_lag_axis_from_the_store_writes_tables_figure_and_warning_per_lag(workbench_uri, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "lag"
    assert main(["--axis", "lag", "--experiment", STALE, "--tracking-uri", workbench_uri, "--out", str(out)]) == 0
    assert "(22 runs, lags 0, 1, 2, 4)" in capsys.readouterr().out
    cells = pd.read_csv(out / "cells.csv")
    assert list(cells.columns[:3]) == ["lag", "lag_mode", "algo"] and cells["collapsed"].sum() == 10
    assert (out / "fig_frontier.png").stat().st_size > 10_000 and (out / "fig_early_warning.png").exists()
    by = pd.read_csv(out / "warning_by_lag.csv").set_index(["lag", "lag_mode", "indicator"])
    for lag, mode in ((1, "fixed"), (2, "fixed"), (4, "fixed"), (4, "uniform")):
        row = by.loc[(lag, mode, "rollout_chi2")]
        assert row["warned"] == row["collapsed_runs"] > 0 and row["lead_median"] == 3  # jumps 4 steps ahead, P = 2
        assert row["false_alarms"] == 0
    assert by.loc[(0, "fixed", "offpolicy_kl"), "runs_without"] == 4  # no stale rollouts, no offpolicy/*
    assert by.loc[(4, "fixed", "offpolicy_kl"), "warned"] == 5  # ppo 2, grpo 2, grpo+decoupled_geo_rs 1
    assert by.loc[(4, "fixed", "rollout_is_ess_drop"), "warned"] == 0  # the ESS falls at the onset: too late
    runs = pd.read_csv(out / "warning_runs.csv")
    assert {"lag", "lag_mode", "correction"} <= set(runs.columns)


def test_cli_parquet_with_experiment_filter_and_errors(stale, tmp_path, capsys):
    from analysis.export import export_study

    export_study(stale, tmp_path / "part")
    out = tmp_path / "both"
    assert main(["--parquet", str(tmp_path / "part"), "--experiment", STALE_B, "--axis", "lag", "--out", str(out),
                 "--no-warning"]) == 0
    assert pd.read_csv(out / "cells.csv")["runs"].sum() == 4
    assert main(["--parquet", str(tmp_path / "part"), "--axis", "both", "--out", str(out)]) == 2
    assert "no experiment named frontier_*" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--axis", "lag", "--out", str(out)])
    assert e.value.code == 2 and "--parquet DIR (exported) or --experiment NAME" in capsys.readouterr().err


def _cells() -> pd.DataFrame:
    return cell_table(_runs().assign(lag_mode=["fixed"] * 12 + ["uniform"] * 3), x=("lag", "lag_mode"))


def test_fig_frontier_over_the_lag_styles_corrections_and_lag_modes():
    from analysis.figures import fig_frontier

    fig = fig_frontier(_cells(), [0, 2], x="lag", labels={0: "lag 0", 2: "lag 2"}, xlabel="lag k")
    ax = fig.axes[0]
    lines = {t.get_text(): h for h, t in zip(ax.get_legend().legend_handles, ax.get_legend().get_texts())}
    assert set(lines) == {"ppo (fixed)", "grpo (fixed)", "grpo+decoupled_geo_rs (uniform)"}
    drawn = {c.get_label(): c.lines[0] for c in ax.containers}  # errorbar: (data line, caps, bars)
    assert drawn["grpo+decoupled_geo_rs (uniform)"].get_linestyle() == "-."  # corrected and not fixed
    assert drawn["grpo (fixed)"].get_linestyle() == "-" and drawn["grpo (fixed)"].get_color() == drawn[
        "grpo+decoupled_geo_rs (uniform)"].get_color()  # a preset's colour, whatever its correction
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lag 0", "lag 2"] and ax.get_xlabel() == "lag k"


def test_frontier_chart_spec_over_the_lag_and_per_level():
    from analysis.charts import frontier_chart

    spec = frontier_chart(_cells(), "lag", [0, 2]).to_dict()
    rule, line = spec["layer"]
    assert (rule["mark"]["type"], rule["encoding"]["y2"]["field"]) == ("rule", "collapse_p_high")
    assert line["encoding"]["x"]["sort"] == ["lag 0", "lag 2"] and line["encoding"]["xOffset"]["field"] == "series"
    assert spec["autosize"] == {"type": "pad", "contains": "padding"}
    data = next(iter(spec["datasets"].values()))
    assert {d["series"] for d in data} == {"ppo (fixed)", "grpo (fixed)", "grpo+decoupled_geo_rs (uniform)"}
    assert {d["k/n"] for d in data if d["series"] == "ppo (fixed)"} == {"0/3", "3/3"}
    assert {d["corrected"] for d in data} == {"", "corrected"}  # dashed through strokeDash
    grid = frontier_chart(_cells().assign(level="l1"), "lag", [0, 2]).to_dict()
    assert grid["facet"]["column"]["field"] == "level"


def test_turn_frame_reads_rollout_kl_before_and_after_it_joins_turn_metrics(monkeypatch):
    from analysis import charts as C

    metrics = pd.DataFrame({"run_id": "r", "step": [1, 1, 2], "value": [0.1, 0.2, 0.3],
                            "metric": ["turn/k0/rollout_kl", "turn/k1/rollout_kl", "turn/k0/rollout_kl"]})
    without = tuple(n for n in T.TURN_METRICS if n != TURN_MISMATCH)
    monkeypatch.setattr(T, "TURN_METRICS", without)  # before metric_names lists it
    frame = C.turn_frame(metrics, "r", TURN_MISMATCH)
    assert frame[["step", "turn"]].values.tolist() == [[1, 0], [2, 0], [1, 1]]
    assert C.turn_names(metrics, "r") == [] and turn_metric(1, TURN_MISMATCH) == "turn/k1/rollout_kl"
    monkeypatch.setattr(T, "TURN_METRICS", (*without, TURN_MISMATCH))  # once metric_names has it
    assert C.turn_names(metrics, "r") == [TURN_MISMATCH] and turn_metric(1, TURN_MISMATCH) == T.turn_key(1, "rollout_kl")
    assert C.turn_frame(metrics, "r", TURN_MISMATCH).equals(frame)
