"""Every dashboard page through streamlit.testing.v1.AppTest on real stores: runs shown, charts
drawn, samples marked, the early-warning table, and a message (never a traceback) for an empty store,
a missing file or an unreachable server."""

from __future__ import annotations

from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest
import json

from helpers.stores import (DEMO, EMPTY, KNOWN, SIGNAL, STALE, STALE_B, closed_port, known_uri,  # noqa: F401
                                    workbench_uri)
from test_analysis_sweeps import SWEEP, optuna_url  # noqa: F401

from stppo import metric_names as T

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


@pytest.fixture
def app(known_uri, optuna_url, tmp_path, monkeypatch):
    """A fresh AppTest over the known store and the Optuna storage (cleared Streamlit caches)."""
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", known_uri)
    monkeypatch.setenv("OPTUNA_STORAGE", optuna_url)
    st.cache_data.clear()
    return AppTest.from_file(APP, default_timeout=120)


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def _texts(elements) -> str:
    return " | ".join(str(e.value) for e in elements)


def _charts(at: AppTest) -> list[dict]:
    """The Vega-Lite specs of the page's Altair charts."""
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def _chart_data(at: AppTest, i: int) -> list:
    """The datasets (frames) Streamlit sends with chart i (Arrow IPC streams)."""
    import pyarrow as pa

    return [pa.ipc.open_stream(d.data.data).read_pandas() for d in at.get("vega_lite_chart")[i].proto.datasets]


def test_overview_lists_the_runs_with_a_chart(app):
    at = _ok(app.run())
    assert "**7 runs** in known" in _texts(at.markdown)
    assert "ppo: 3 runs, 2 collapsed" in _texts(at.markdown) and "st_ppo: 3 runs, 0 collapsed" in _texts(at.markdown)
    runs = at.dataframe[0].value
    assert len(runs) == 7 and runs["status"].value_counts().to_dict() == {"FINISHED": 6, "KILLED": 1}
    table = at.table[0].value
    assert table.set_index("preset").loc["ppo", "collapsed k/n"] == "2/3"
    assert len(_charts(at)) == 1 and not at.get("image")
    _ok(at.multiselect(key="overview:algo").set_value(["st_ppo"]).run())
    assert "**3 runs** in known" in _texts(at.markdown) and len(at.dataframe[0].value) == 3


def test_collapse_page_marks_the_collapse_and_notes_missing_metrics(app):
    at = _ok(app.run())
    ids = at.dataframe[0].value.set_index(["algo", "seed"])["run_id"]
    _ok(at.switch_page("views/collapse.py").run())
    run = at.selectbox(key="collapse:run")
    assert len(run.options) == 7
    assert run.value == ids[("grpo", "0")]  # the earliest collapse comes first (grpo, logged at 5)
    assert run.options[0].startswith("grpo · tiny · seed 0") and run.options[0].endswith("collapsed at step 5")
    assert "did not log" in _texts(at.info) and "Collapsed at step 5 of 10." in _texts(at.warning)
    _ok(run.set_value(ids[("ppo", "0")]).run())
    assert "Collapsed at step 15 of 20." in _texts(at.warning) and "did not log" not in _texts(at.info)
    (before,) = _charts(at)
    _ok(at.multiselect(key="collapse:extra").set_value(["clip_bias/norm", "actor/pg_loss_norm"]).run())
    (spec,) = _charts(at)
    assert len(spec["vconcat"]) == len(before["vconcat"]) + 2 and at.metric[1].value == "15"
    assert {p["name"] for p in spec["params"]} >= {"steps", "zoom1"}  # brush + zoom
    assert "no per-turn metrics" in _texts(at.info)


def test_compare_page_draws_figures_and_tables(app):
    at = _ok(app.run())
    _ok(at.switch_page("views/compare.py").run())
    assert len(_charts(at)) == 3 and not at.get("image")  # Figs. 3, 4 (one model), 5
    caption = _texts(at.caption)
    assert "Welch's two-sided t-test" in caption
    presets = at.dataframe[0].value.set_index("algo")
    assert presets.loc["ppo", "collapsed"] == "2/3"
    at.slider(key="compare:smoothing").set_value(0.5)
    at.toggle(key="compare:log").set_value(True)
    _ok(at.multiselect(key="compare:algo").set_value(["ppo"]).run())
    assert "Choose at least two presets" in _texts(at.info) and len(_charts(at)) == 3
    assert at.dataframe[0].value["algo"].tolist() == ["ppo"]


def test_sweeps_page_shows_trials_with_pruned_marked(app):
    at = _ok(app.run())
    _ok(at.switch_page("views/sweeps.py").run())
    assert f"**4 trials** in {SWEEP} (maximize): 3 complete, 1 pruned" in _texts(at.markdown)
    assert len(at.get("image")) == 1 and at.dataframe[0].value["pruned"].sum() == 1


def test_missing_optuna_storage_is_a_message(app, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTUNA_STORAGE", f"sqlite:///{tmp_path / 'none.db'}")
    at = _ok(app.run())
    _ok(at.switch_page("views/sweeps.py").run())
    assert "Optuna storage not found" in _texts(at.warning)


def test_empty_store_is_a_message_on_every_page(app, tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'empty.db'}"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()  # a fresh store: only 'Default'
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    at = _ok(app.run())
    assert "has no runs" in _texts(at.info)
    for page in ("views/collapse.py", "views/compare.py", "views/samples.py", "views/warning.py"):
        _ok(at.switch_page(page).run())
        assert "has no runs" in _texts(at.info)


def test_empty_experiment_is_a_message(app):
    at = _ok(app.run())
    _ok(at.sidebar.multiselect[0].set_value([EMPTY]).run())
    assert f"experiment '{EMPTY}'" in _texts(at.info) and not at.dataframe


@pytest.mark.parametrize("case", ["unreachable", "missing_file"])
def test_bad_tracking_uri_is_a_warning(app, case, tmp_path, monkeypatch):
    uri = f"http://127.0.0.1:{closed_port()}" if case == "unreachable" else f"sqlite:///{tmp_path / 'no.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    at = _ok(app.run())
    expected = "is unreachable" if case == "unreachable" else "tracking store not found"
    assert expected in _texts(at.warning)
    for page in ("views/collapse.py", "views/samples.py", "views/warning.py"):
        _ok(at.switch_page(page).run())
        assert expected in _texts(at.warning)


@pytest.fixture
def workbench(app, workbench_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", workbench_uri)
    return app


def _pick(at: AppTest, *experiments: str) -> AppTest:
    return _ok(at.sidebar.multiselect[0].set_value(list(experiments)).run())


def test_collapse_page_draws_the_turn_heatmap(workbench):
    at = _pick(_ok(workbench.run()), DEMO)
    _ok(at.switch_page("views/collapse.py").run())
    # every per-turn name of TURN_METRICS the demo logs (rollout_kl once metric_names lists it)
    assert at.selectbox(key="collapse:turn_metric").options == list(T.TURN_METRICS)
    _ok(at.selectbox(key="collapse:turn_metric").set_value("ratio_max").run())
    heat = _charts(at)[1]
    assert heat["layer"][0]["mark"]["type"] == "rect" and heat["layer"][0]["encoding"]["color"]["title"] == "ratio_max"


def test_samples_page_marks_actions_and_defaults_near_the_collapse(workbench):
    at = _pick(_ok(workbench.run()), DEMO)
    _ok(at.switch_page("views/samples.py").run())
    run = at.selectbox(key="samples:run")
    assert run.options[0].startswith("ppo · tiny · seed 0") and run.options[0].endswith("collapsed at step 22")
    step = at.select_slider(key=f"samples:step:{run.value}")
    assert step.value == 20 and list(step.options) == ["10", "20", "26", "30", "40"]
    assert "collapse onset at step 22" in _texts(at.caption)
    html = " ".join(h.proto.body for h in at.get("html"))
    assert len(at.get("html")) == 3 and html.count(">tool call: search</span>") == 3
    assert html.count(">answer</span>") == 3
    assert html.count(">observation</b>") == 3 and "&lt;information&gt;" in html  # observations set apart
    assert "&lt;search&gt;" in html and "<search>" not in html  # escaped, never live markup
    assert "<details" not in html  # prompts hidden by default
    _ok(step.set_value(26).run())
    html = " ".join(h.proto.body for h in at.get("html"))
    assert html.count(">invalid action</span>") == 6 and "tool call: search" not in html
    _ok(at.toggle(key="samples:prompts").set_value(True).run())
    assert "<details" in " ".join(h.proto.body for h in at.get("html"))


def test_samples_page_defaults_to_the_last_step_without_collapse(workbench):
    at = _pick(_ok(workbench.run()), DEMO)
    _ok(at.switch_page("views/samples.py").run())
    _ok(at.multiselect(key="samples:algo").set_value(["st_ppo"]).run())
    run = at.selectbox(key="samples:run")
    assert run.options[0].startswith("st_ppo") and at.select_slider(key=f"samples:step:{run.value}").value == 40
    assert "no collapse" in _texts(at.caption)


def test_samples_page_without_samples_is_a_message(app):
    at = _ok(app.run())
    _ok(at.switch_page("views/samples.py").run())
    assert "saved no sampled trajectories" in _texts(at.info)


def test_early_warning_page_table_and_threshold(workbench):
    at = _pick(_ok(workbench.run()), SIGNAL)
    _ok(at.switch_page("views/warning.py").run())
    assert "**4 collapsed runs**, 3 runs without collapse." in _texts(at.markdown)
    row = at.table[0].value.set_index("indicator").loc["clip_frac"]
    assert (row["warned k/n"], row["false alarms"]) == ("3/4", "0/3")
    assert (row["lead median"], row["lead IQR"]) == ("5", "3.5 – 7")  # leads 5, 9, 2 with P = 2
    assert "entropy_fall" not in at.table[0].value["indicator"].tolist()  # never logged: not shown
    full = at.dataframe[0].value.set_index("indicator")
    assert full.loc["clip_frac", "lead_median"] == 5.0 and full.loc["entropy_fall", "runs_without"] == 7
    assert len(at.get("image")) == 1 and len(_charts(at)) == 1
    _ok(at.number_input(key="warning:persist").set_value(1).run())
    assert at.table[0].value.set_index("indicator").loc["clip_frac", "lead median"] == "6"  # leads 6, 10, 3
    _ok(at.slider(key="warning:threshold").set_value(20.0).run())
    assert at.table[0].value.set_index("indicator").loc["clip_frac", "warned k/n"] == "0/4"
    rule = [d for d in _chart_data(at, 0) if list(d.columns) == ["h"]]
    assert len(rule) == 1 and rule[0]["h"].tolist() == [20.0]  # the threshold line follows the slider


def test_frontier_page_over_the_lag_the_level_and_both(workbench):
    at = _pick(_ok(workbench.run()), STALE)
    _ok(at.switch_page("views/frontier.py").run())
    assert at.radio(key="frontier:axis").value == "lag"  # the lag varies: it is the default axis
    assert "**22 runs** in 11 cells: lags 0, 1, 2, 4" in _texts(at.markdown)
    table = at.table[0].value.set_index(["lag", "lag mode", "preset"])
    assert table.loc[(2, "fixed", "ppo"), "collapsed k/n"] == "2/2"
    assert table.loc[(4, "fixed", "grpo+decoupled_geo_rs"), "collapsed k/n"] == "1/2"
    assert table.loc[(4, "uniform", "ppo"), "collapsed k/n"] == "1/2"  # the lag mode is a cell of its own
    (spec,) = _charts(at)
    assert [layer["mark"]["type"] for layer in spec["layer"]] == ["rule", "line"]
    assert spec["layer"][1]["encoding"]["x"]["sort"] == ["lag 0", "lag 1", "lag 2", "lag 4"]
    _ok(at.radio(key="frontier:axis").set_value("level").run())
    assert "One level" in _texts(at.info)
    at = _pick(at, STALE, STALE_B)
    _ok(at.radio(key="frontier:axis").set_value("both").run())
    (spec,) = _charts(at)
    assert spec["facet"]["column"]["field"] == "level"  # one panel per level, the lag across
    table = at.table[0].value.set_index(["level", "lag", "lag mode", "preset"])
    assert table.loc[(STALE_B, 0, "fixed", "ppo"), "collapsed k/n"] == "1/2"


def test_frontier_page_without_lags_draws_the_levels(workbench):
    at = _pick(_ok(workbench.run()), DEMO, SIGNAL)
    _ok(at.switch_page("views/frontier.py").run())
    assert at.radio(key="frontier:axis").value == "level"
    table = at.table[0].value.set_index(["level", "preset"])
    assert table.loc[(DEMO, "ppo"), "collapsed k/n"] == "2/2" and table.loc[(SIGNAL, "ppo"), "collapsed k/n"] == "4/7"
    _ok(at.radio(key="frontier:axis").set_value("lag").run())
    assert "Every selected run has lag 0" in _texts(at.info)


def test_collapse_page_shows_the_mismatch_panels_and_the_per_turn_mismatch(workbench):
    at = _pick(_ok(workbench.run()), STALE)
    _ok(at.switch_page("views/collapse.py").run())
    _ok(at.multiselect(key="collapse:lag").set_value(["4"]).run())
    run = at.selectbox(key="collapse:run")
    assert run.options[0].startswith("grpo · tiny · seed 0") and run.options[0].endswith("collapsed at step 12")
    assert "rollouts lag 4 behind" in _texts(at.caption)
    charts = _charts(at)  # Fig. 2 with the mismatch panels, [the generic per-turn heatmap,] the mismatch heatmap
    panels, heat = charts[0], charts[-1]
    titles = [p["layer"][0]["title"] if "layer" in p else p["title"] for p in panels["vconcat"]]
    assert titles[:4] == ["success rate (drag here to select steps)", "valid action ratio", "grad norm (pre-clip)",
                          "sampler vs trainer KL"]  # the run logged no advantages
    assert {"χ² of π_old / π_rollout", "KL of the stale policy to the current one",
            "staleness: lag of the sampling policy (steps)", "IS weights"} <= set(titles)
    assert heat["layer"][0]["encoding"]["color"]["title"] == "rollout_kl"
    assert "`turn/k*/rollout_kl`" in _texts(at.caption)
    _ok(at.multiselect(key="collapse:lag").set_value(["0"]).run())
    panels = _charts(at)[0]
    titles = [p["layer"][0]["title"] if "layer" in p else p["title"] for p in panels["vconcat"]]
    assert "sampler vs trainer KL" in titles and "KL of the stale policy to the current one" not in titles
    assert "no stale rollouts" in _texts(at.caption)


def test_overview_and_compare_split_presets_by_lag(workbench):
    at = _pick(_ok(workbench.run()), STALE)
    assert at.multiselect(key="overview:split").value == ["lag", "lag_mode"]
    table = at.table[0].value.set_index(["lag", "lag mode", "preset"])
    assert table.loc[(4, "fixed", "ppo"), "collapsed k/n"] == "2/2"
    assert table.loc[(0, "fixed", "ppo"), "collapsed k/n"] == "0/2"  # runs from before trainer.offpolicy: lag 0
    assert {"lag", "lag_mode", "correction"} <= set(at.dataframe[0].value.columns)
    series = set(_chart_data(at, 0)[0]["series"])
    assert {"ppo · lag 0", "ppo · lag 4", "ppo · lag 4 uniform", "grpo+decoupled_geo_rs · lag 2"} <= series
    _ok(at.multiselect(key="overview:lag").set_value(["2"]).run())
    assert "**6 runs** in stale_a" in _texts(at.markdown)
    _ok(at.switch_page("views/compare.py").run())
    presets = at.dataframe[0].value
    assert list(presets.columns[:3]) == ["lag", "lag_mode", "algo"] and len(presets) == 11
    sig = at.dataframe[1].value  # pairs within a lag: 1 + 1 + 3 + 3 (+ none at lag 4 uniform, ppo alone)
    assert len(sig) == 8 and set(sig.columns) >= {"lag", "lag_mode", "a", "b"}
