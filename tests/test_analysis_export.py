"""`python -m analysis.export` and `analysis.report --parquet`: a study written to parquet parts
and read back gives the same study, the same tables, and merges parts without double counting."""

from __future__ import annotations

import pandas as pd
import pytest
from test_analysis_fixtures import KNOWN, cache_tmp, known_uri  # noqa: F401

from analysis import load_study, per_run_table, collapse_table
from analysis.export import export_study, load_exported, main
from analysis.report import main as report_main
from analysis.store import AnalysisError


def _sorted(frame: pd.DataFrame, keys) -> pd.DataFrame:
    out = frame.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(str)
    return out.sort_values(keys, ignore_index=True)


def test_export_then_load_is_the_same_study(known_uri, tmp_path, cache_tmp):
    study = load_study(KNOWN, known_uri)
    assert main(["--experiment", KNOWN, "--out", str(tmp_path / "a"), "--tracking-uri", known_uri]) == 0
    back = load_exported(tmp_path / "a")
    assert back.experiments == (KNOWN,)
    keys = ["run_id", "metric", "step"]
    pd.testing.assert_frame_equal(_sorted(back.metrics, keys), _sorted(study.metrics, keys))
    pd.testing.assert_frame_equal(_sorted(back.params, ["run_id", "key"]), _sorted(study.params, ["run_id", "key"]))
    a, b = per_run_table(study, collapse_table(study)), per_run_table(back, collapse_table(back))
    pd.testing.assert_frame_equal(_sorted(a, ["run_id"]), _sorted(b, ["run_id"]))


def test_parts_merge_once_and_report_reads_them(known_uri, tmp_path, cache_tmp):
    study = load_study(KNOWN, known_uri)
    ids = list(study.runs["run_id"])
    half = study.runs["run_id"].isin(ids[: len(ids) // 2 + 1])  # the parts overlap by one run

    def part(mask):
        keep = set(study.runs.loc[mask, "run_id"])
        return type(study)(study.uri, study.experiments, study.runs[mask],
                           study.metrics[study.metrics["run_id"].astype(str).isin(keep)],
                           study.params[study.params["run_id"].isin(keep)])

    export_study(part(half), tmp_path / "p1")
    export_study(part(~half | study.runs["run_id"].eq(ids[0])), tmp_path / "p2")
    both = load_exported([tmp_path / "p1", tmp_path / "p2"])
    assert sorted(both.runs["run_id"]) == sorted(ids)
    assert len(both.metrics) == len(study.metrics)
    out = tmp_path / "report"
    assert report_main(["--experiment", KNOWN, "--parquet", str(tmp_path / "p1"), "--parquet",
                        str(tmp_path / "p2"), "--out", str(out), "--bootstrap", "500"]) == 0
    assert len(pd.read_csv(out / "runs.csv")) == len(ids) and (out / "warning.csv").is_file()
    with pytest.raises(AnalysisError, match="does not exist"):
        load_exported(tmp_path / "nowhere")
