"""analysis.charts: the Vega-Lite specs the dashboard draws — integer step axes, the step brush that
filters the companion panels, zoom, tooltips, seed counts where seeds drop out, the turn × step
heatmap and the alarm-statistic chart — on the real stores of the other analysis tests."""

from __future__ import annotations

import json

import pytest
from helpers.stores import DEMO, KNOWN, known_uri, run_ids, workbench_uri  # noqa: F401

from analysis import charts as C
from analysis import collapse_table, load_study
from analysis.warning import run_statistics
from stppo import metric_names as T


@pytest.fixture(scope="module")
def studies(known_uri, workbench_uri, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("charts_cache")))
        return load_study(KNOWN, known_uri), load_study(DEMO, workbench_uri)


def _walk(spec, key):
    """Every value of `key` anywhere in a spec."""
    if isinstance(spec, dict):
        for k, v in spec.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(spec, list):
        for v in spec:
            yield from _walk(v, key)


def _step_axes(spec) -> list[dict]:
    return [enc["axis"] for enc in _walk(spec, "x") if isinstance(enc, dict) and enc.get("title") == "step"]


def test_run_panels_brush_filters_the_companions(studies):
    known, _ = studies
    rid = run_ids(known)[("ppo", 0)]
    chart = C.run_panels(known.metrics, rid, [("success", (T.SUCCESS_RATE,)), ("grad", (T.GRAD_NORM,)),
                                              ("absent", ("nope/x",)), ("clip", (T.PG_CLIPFRAC,))], collapse_step=15)
    spec = chart.to_dict()
    assert len(spec["vconcat"]) == 3  # the panel of a metric the run did not log is left out
    params = {p["name"]: p for p in spec["params"]}
    assert params["steps"]["select"]["encodings"] == ["x"] and "bind" not in params["steps"]
    assert all(params[z]["bind"] == "scales" for z in ("zoom1", "zoom2"))
    filters = [f for f in _walk(spec, "filter") if f == {"param": "steps"}]
    assert len(filters) == 2  # both companion panels follow the brush
    axes = _step_axes(spec)
    assert axes and all(a["format"] == "d" and a["tickMinStep"] == 1 for a in axes)
    rules = [v for v in _walk(spec, "datasets")][0]
    assert any(rows == [{"step": 15, "label": "collapse (step 15)"}] for rows in rules.values())
    tips = json.dumps(list(_walk(spec, "tooltip")))
    assert '"field": "value"' in tips and '"field": "metric"' in tips
    assert C.run_panels(known.metrics, rid, [("absent", ("nope/x",))]) is None


def test_band_charts_show_seed_counts_where_seeds_drop(studies):
    known, _ = studies
    agg = C.band_frame(known.metrics, T.GRAD_NORM)
    ppo = agg[agg["series"] == "ppo"].set_index("step")
    assert ppo.loc[21, "drop"] == "n=2" and ppo.loc[20, "drop"] == "" and ppo.loc[25, "drop"] == ""
    assert ppo["n_max"].eq(3).all() and (agg["ci_low"] >= 0).all()
    spec = C.band_charts(known.metrics, [T.SUCCESS_RATE, T.GRAD_NORM, "nope/x"]).to_dict()
    assert len(spec["concat"]) == 2
    assert any(f == "datum.n < datum.n_max" for f in _walk(spec, "filter"))  # the points with fewer seeds
    assert any(t == {"field": "drop", "type": "nominal"} for t in _walk(spec, "text"))
    assert [f for f in _walk(spec, "filter") if f == {"param": "steps"}]
    assert {"field": "n", "title": "seeds", "type": "quantitative"} in list(_walk(spec, "tooltip"))[0]
    assert any(s == {"domain": [0, 1]} for s in _walk(spec, "scale"))  # success on its [0, 1] range


def test_turn_heatmap_of_a_per_turn_metric(studies):
    _, demo = studies
    col = collapse_table(demo).set_index("run_id")
    rid = str(col.index[0])
    assert C.turn_names(demo.metrics, rid) == list(T.TURN_METRICS)
    frame = C.turn_frame(demo.metrics, rid, "pg_clipfrac")
    assert sorted(frame["turn"].unique()) == [0, 1, 2] and len(frame) == 3 * 40
    spec = C.turn_heatmap(frame, "pg_clipfrac", collapse_step=col.loc[rid, "collapse_step"]).to_dict()
    assert spec["layer"][0]["mark"]["type"] == "rect"
    assert spec["layer"][0]["encoding"]["y"] == {"field": "turn", "title": "turn k", "type": "ordinal"}
    assert spec["height"] == {"step": 28}
    assert spec["layer"][0]["encoding"]["x"]["axis"] == {"format": "d", "tickMinStep": 1}


def test_alarm_chart_draws_each_run_and_the_threshold(studies):
    _, demo = studies
    stats = run_statistics(demo)
    spec = C.alarm_chart(stats, collapse_table(demo), "clip_frac", 4.0).to_dict()
    data = list(spec["datasets"].values())
    assert any(rows == [{"h": 4.0}] for rows in data)
    runs = next(rows for rows in data if rows and "run" in rows[0])
    assert {r["collapsed"] for r in runs} == {"collapsed", "no collapse"} and len({r["run"] for r in runs}) == 4
