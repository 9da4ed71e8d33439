"""`python -m analysis.export` and `analysis.report --parquet`: a study written to parquet parts
and read back gives the same study, the same tables, and merges parts without double counting."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers.stores import KNOWN, cache_tmp, known_uri  # noqa: F401

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


def test_stores_merge_into_one_folder_without_unfinished_runs(known_uri, tmp_path, cache_tmp):
    """Per-run stores of a study run elsewhere (scripts/staleness_gpu.sh): one folder, each run
    once; `--finished-only` drops a run killed at the deadline; a store without the experiment is
    skipped; none having it is one error line."""
    import shutil

    from mlflow import MlflowClient

    src = known_uri.removeprefix("sqlite:///")
    ids = list(load_study(KNOWN, known_uri).runs["run_id"])
    uris = []
    for name in ("a", "b"):
        shutil.copy(src, tmp_path / f"{name}.db")
        uris.append(f"sqlite:///{tmp_path / name}.db")
    MlflowClient(uris[0]).delete_run(ids[0])  # a: every run but the first, finished
    MlflowClient(uris[1]).update_run(ids[0], status="RUNNING")  # b: the first one killed
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    MlflowClient(empty).create_experiment("other")
    args = ["--experiment", KNOWN, *[x for u in (*uris, empty) for x in ("--tracking-uri", u)]]
    assert main([*args, "--out", str(tmp_path / "all")]) == 0
    every = load_exported(tmp_path / "all")
    assert sorted(every.runs["run_id"]) == sorted(ids)
    assert every.runs.set_index("run_id").loc[ids[0], "status"] == "RUNNING"
    assert main([*args, "--finished-only", "--out", str(tmp_path / "done")]) == 0
    done = load_exported(tmp_path / "done")
    assert sorted(done.runs["run_id"]) == sorted(ids[1:])
    assert ids[0] not in set(done.metrics["run_id"].astype(str)) | set(done.params["run_id"])
    assert main(["--experiment", KNOWN, "--tracking-uri", empty, "--tracking-uri", empty,
                 "--out", str(tmp_path / "none")]) == 2
    # a store that does not exist is an error, not a store without the experiment
    assert main([*args, "--tracking-uri", f"sqlite:///{tmp_path / 'typo.db'}", "--out", str(tmp_path / "t")]) == 2



def test_a_study_continues_from_its_exported_folder(known_uri, tmp_path, cache_tmp):
    """A study continued on another machine: the first part's exported folder plus the new
    store's runs give one folder with every run once, written over the folder it read; the
    experiments asked for filter both; a folder that does not exist is one error."""
    import shutil

    from mlflow import MlflowClient

    study = load_study(KNOWN, known_uri)
    ids = list(study.runs["run_id"])
    first = set(ids[:2])
    keep = study.runs["run_id"].isin(first)
    export_study(type(study)(study.uri, study.experiments, study.runs[keep],
                             study.metrics[study.metrics["run_id"].astype(str).isin(first)],
                             study.params[study.params["run_id"].isin(first)]), tmp_path / "data")
    shutil.copy(known_uri.removeprefix("sqlite:///"), tmp_path / "new.db")
    new = f"sqlite:///{tmp_path / 'new.db'}"
    MlflowClient(new).delete_run(ids[0])  # the new store: every run but the first
    args = ["--experiment", KNOWN, "--tracking-uri", new, "--finished-only"]
    assert main([*args, "--with-exported", str(tmp_path / "data"), "--out", str(tmp_path / "data")]) == 0
    back = load_exported(tmp_path / "data")
    assert sorted(back.runs["run_id"]) == sorted(ids)
    keys = ["run_id", "metric", "step"]
    pd.testing.assert_frame_equal(_sorted(back.metrics, keys), _sorted(study.metrics, keys))
    assert main(["--experiment", "other", "--tracking-uri", new, "--with-exported", str(tmp_path / "data"),
                 "--out", str(tmp_path / "o")]) == 2
    assert main([*args, "--with-exported", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
