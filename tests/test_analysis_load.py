"""Loading MLflow runs: tidy frame, SQL and MlflowClient readers agree, the parquet cache, errors."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers.stores import EMPTY, KNOWN, RUNS, cache_tmp, closed_port, known_uri, run_ids  # noqa: F401

from analysis import list_experiments, load_study
from analysis.load import TIDY_COLUMNS, collapse_config
from analysis.store import (
    ClientReader,
    EmptyExperimentError,
    SqliteReader,
    StoreNotFoundError,
    StoreUnreachableError,
    UnknownExperimentError,
    open_reader,
)
from stppo import metric_names as T
from stppo.diagnostics import CollapseConfig, SampledCollapseConfig


def test_known_store_holds_the_runs_as_written(known_uri, cache_tmp):
    study = load_study(KNOWN, known_uri)
    assert sorted(run_ids(study)) == sorted(RUNS)
    assert set(study.runs["status"]) == {"FINISHED", "KILLED"}
    assert study.metrics.groupby("run_id", observed=True)["step"].max().sort_values().tolist() == [
        10, 20, 30, 30, 30, 30, 30]


def test_tidy_frame_has_the_columns_and_the_logged_values(known_uri, cache_tmp):
    study = load_study(KNOWN, known_uri)
    assert tuple(study.metrics.columns) == TIDY_COLUMNS
    ids = run_ids(study)
    m = study.metrics
    g = m[(m["run_id"] == ids[("ppo", 2)]) & (m["metric"] == T.GRAD_NORM)]
    assert g["step"].tolist() == list(range(1, 31))
    assert g["value"].tolist() == [3.0 * s for s in range(1, 31)]
    assert set(g["algo"]) == {"ppo"} and set(g["seed"]) == {"2"} and set(g["status"]) == {"FINISHED"}
    val = m[(m["run_id"] == ids[("ppo", 0)]) & (m["metric"] == T.VAL_SUCCESS_RATE)]
    assert list(zip(val["step"], val["value"])) == [(0, 0.5), (10, 0.8), (20, 0.1)]
    # params trainer.collapse.ema: a run of the sampled-success rule (v2, v3), with its settings
    run = study.run(ids[("ppo", 0)])
    assert (run["collapse_rule"], run["sampled_ema"], run["sampled_patience"]) == ("sampled", 1.0, 3)
    assert collapse_config(run) == CollapseConfig(rule="sampled", sampled=SampledCollapseConfig(ema=1.0, patience=3))
    # no such params: the live rule, at its defaults
    run = study.run(ids[("ppo", 1)])
    assert (run["collapse_rule"], run["collapse_every"], run["collapse_patience"]) == ("live", 5, 2)
    assert collapse_config(run) == CollapseConfig()


def test_nan_and_inf_values_come_back_as_logged(known_uri, cache_tmp):
    study = load_study(KNOWN, known_uri)
    m = study.metrics
    pg = m[(m["run_id"] == run_ids(study)[("ppo", 1)]) & (m["metric"] == T.PG_LOSS)].set_index("step")["value"]
    assert math.isnan(pg[3]) and pg[4] == math.inf and pg[5] == -math.inf and pg[6] == 0.5


def test_sql_reader_and_mlflow_client_reader_agree(known_uri):
    names = [KNOWN]
    sql, client = SqliteReader(known_uri, open_reader(known_uri).path), ClientReader(known_uri)
    runs_sql, runs_cli = sql.runs(names), client.runs(names)
    cols = ["run_id", "experiment", "status", "algo", "model", "task", "seed", "start_time", "end_time"]
    pd.testing.assert_frame_equal(runs_sql[cols], runs_cli[cols])
    ids = list(runs_sql["run_id"])
    pd.testing.assert_frame_equal(sql.metrics(ids), client.metrics(ids))
    p_sql = sql.params(ids).sort_values(["run_id", "key"], ignore_index=True)
    p_cli = client.params(ids).sort_values(["run_id", "key"], ignore_index=True)
    pd.testing.assert_frame_equal(p_sql, p_cli)


def test_experiments_are_listed_with_run_counts(known_uri):
    assert list_experiments(known_uri) == {"Default": 0, EMPTY: 0, KNOWN: 7}
    assert ClientReader(known_uri).run_counts() == {"Default": 0, EMPTY: 0, KNOWN: 7}


def _spy_metrics(monkeypatch) -> list[list[str]]:
    """Record which runs' metrics are read from the store (the real reader still does the work)."""
    calls: list[list[str]] = []
    real = SqliteReader.metrics

    def spy(self, run_ids):
        calls.append(sorted(run_ids))
        return real(self, run_ids)

    monkeypatch.setattr(SqliteReader, "metrics", spy)
    return calls


def test_cache_returns_the_same_frame_and_skips_unchanged_runs(known_uri, cache_tmp, monkeypatch):
    calls = _spy_metrics(monkeypatch)
    first = load_study(KNOWN, known_uri)
    assert len(calls) == 1 and len(calls[0]) == 7
    second = load_study(KNOWN, known_uri)
    assert len(calls) == 1  # nothing re-read
    pd.testing.assert_frame_equal(first.metrics, second.metrics)
    pd.testing.assert_frame_equal(first.runs, second.runs)
    uncached = load_study(KNOWN, known_uri, use_cache=False)
    pd.testing.assert_frame_equal(first.metrics, uncached.metrics)
    assert len(list(cache_tmp.rglob("*.parquet"))) == 7


def test_cache_is_invalidated_when_a_run_changes(known_uri, cache_tmp, tmp_path, monkeypatch):
    import mlflow
    from mlflow.entities import Metric

    db = tmp_path / "copy.db"
    shutil.copy(known_uri.removeprefix("sqlite:///"), db)
    uri = f"sqlite:///{db}"
    calls = _spy_metrics(monkeypatch)
    before = load_study(KNOWN, uri)
    rid = run_ids(before)[("st_ppo", 1)]
    client = mlflow.MlflowClient(tracking_uri=uri)
    client.log_batch(rid, metrics=[Metric(T.GRAD_NORM, 123.0, int(time.time() * 1000), 31)])
    after = load_study(KNOWN, uri)
    assert calls[-1] == [rid]  # only the changed run is re-read
    g = after.metrics[(after.metrics["run_id"] == rid) & (after.metrics["metric"] == T.GRAD_NORM)]
    assert g["step"].max() == 31 and g["value"].iloc[-1] == 123.0
    assert len(after.metrics) == len(before.metrics) + 1
    assert len(list(cache_tmp.rglob(f"{rid}-*.parquet"))) == 1  # the stale file is gone
    other = run_ids(before)[("ppo", 0)]
    client.set_terminated(other, status="FAILED")  # a status change alone invalidates too
    again = load_study(KNOWN, uri)
    assert calls[-1] == [other] and again.run(other)["status"] == "FAILED"
    assert set(again.metrics.loc[again.metrics["run_id"] == other, "status"]) == {"FAILED"}


def test_a_run_without_metrics_loads_tabulates_and_plots(known_uri, cache_tmp, tmp_path):
    import mlflow

    import analysis

    db = tmp_path / "copy.db"
    shutil.copy(known_uri.removeprefix("sqlite:///"), db)
    uri = f"sqlite:///{db}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(KNOWN).experiment_id
    rid = client.create_run(exp, tags={T.TAG_ALGO: "ppo", T.TAG_SEED: "9"}).info.run_id  # crashed at start
    study = load_study(KNOWN, uri)
    assert len(study.runs) == 8 and study.run(rid)["status"] == "RUNNING" and study.run(rid)["model"] == ""
    assert (study.metrics["run_id"] == rid).sum() == 0
    again = load_study(KNOWN, uri)  # its empty cache entry reads back
    pd.testing.assert_frame_equal(study.metrics, again.metrics)
    row = analysis.per_run_table(study).set_index("run_id").loc[rid]
    assert not row["collapsed"] and math.isnan(row["final_success"]) and math.isnan(row["peak_grad_norm"])
    fig = analysis.fig_collapse_diagnosis(study.metrics, rid)
    assert sum("not logged" in t.get_text() for ax in fig.axes for t in ax.texts) == 4


def test_unknown_experiment_is_one_clear_line(known_uri, cache_tmp):
    with pytest.raises(UnknownExperimentError) as e:
        load_study("nope", known_uri)
    msg = str(e.value)
    assert "'nope' not found" in msg and KNOWN in msg and "\n" not in msg


def test_empty_experiment_is_one_clear_line(known_uri, cache_tmp):
    with pytest.raises(EmptyExperimentError, match=f"'{EMPTY}' .* has no runs"):
        load_study([KNOWN, EMPTY], known_uri)


def test_missing_sqlite_file_is_not_created(tmp_path, cache_tmp):
    path = tmp_path / "absent.db"
    with pytest.raises(StoreNotFoundError, match="tracking store not found"):
        load_study(KNOWN, f"sqlite:///{path}")
    assert not path.exists()


@pytest.mark.timeout(60)  # MLflow's own client would retry for minutes; the probe fails at once
def test_unreachable_server_is_one_clear_line(cache_tmp):
    with pytest.raises(StoreUnreachableError, match=r"tracking server http://127\.0\.0\.1:\d+ is unreachable"):
        load_study(KNOWN, f"http://127.0.0.1:{closed_port()}")


def test_analysis_and_dashboard_do_not_import_torch():
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import analysis, analysis.report, analysis.sweeps, fixtures.runs, dashboard.common; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
