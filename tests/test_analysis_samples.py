"""analysis.samples: the sampled-trajectory tables of a run, read through MlflowClient from a real
store (written with MlflowClient.log_table, as the trainer writes them), and one-line errors."""

from __future__ import annotations

import math

import pytest
from helpers.stores import DEMO, closed_port, workbench_uri  # noqa: F401

from analysis import collapse_table, load_study
from analysis.samples import SamplesError, default_step, load_samples, samples_frame, saved_steps, trajectories
from analysis.store import StoreNotFoundError, StoreUnreachableError
from stppo import metric_names as T


@pytest.fixture(scope="module")
def demo(workbench_uri, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("samples_cache")))
        study = load_study(DEMO, workbench_uri)
    col = collapse_table(study)
    return study, col.assign(seed=col["seed"].astype(int)).set_index(["algo", "seed"])


def test_saved_steps_and_the_default_near_the_collapse(demo, workbench_uri):
    study, col = demo
    rid = col.loc[("ppo", 0), "run_id"]
    steps = saved_steps(workbench_uri, rid)
    # every 10 steps, and at the step the collapse was detected (onset 22 + patience 5 - 1 = 26)
    assert col.loc[("ppo", 0), "collapse_step"] == 22 and steps == [10, 20, 26, 30, 40]
    assert default_step(steps, 22.0) == 20 and default_step(steps, 25.0) == 26 and default_step(steps, 15) == 20
    assert default_step(steps, math.nan) == 40 and default_step([], 3.0) is None
    stable = col.loc[("st_ppo", 0), "run_id"]
    assert saved_steps(workbench_uri, stable) == [10, 20, 30, 40]


def test_load_samples_types_and_marks(demo, workbench_uri):
    _, col = demo
    rid = col.loc[("ppo", 0), "run_id"]
    before = load_samples(workbench_uri, rid, 20)
    assert list(before.columns) == list(T.SAMPLE_COLUMNS) and before["step"].eq(20).all()
    assert before["sample"].nunique() == 3 and before["collapse_step"].eq(-1).all()  # not detected yet at 20
    agent = before[before["role"] == "agent"]
    assert set(agent["action"]) <= {"search", "answer"} and agent["ratio_mean"].notna().all()
    assert before.loc[before["role"] == "observation", "ratio_mean"].isna().all()
    assert before.loc[before["role"] == "observation", "text"].str.contains("<information>").all()
    after = load_samples(workbench_uri, rid, 26)
    assert after["collapse_step"].eq(22).all() and set(after.loc[after["role"] == "agent", "action"]) == {"invalid"}
    traj = trajectories(before)
    assert [t["sample"] for t in traj] == [0, 1, 2]
    assert [s["role"] for s in traj[0]["segments"]] == ["prompt", "agent", "observation", "agent"]


def test_samples_frame_keeps_numeric_looking_text_as_text():
    row = [5, 0, "Which year?", "1990", None, 0, "agent", 0, "<answer> 1990 </answer>", "answer", 1.0, 1.2, None, -1]
    frame = samples_frame({"columns": list(T.SAMPLE_COLUMNS), "data": [row]})
    assert frame.loc[0, "answers"] == "1990" and isinstance(frame.loc[0, "answers"], str)
    assert math.isnan(frame.loc[0, "reward"]) and math.isnan(frame.loc[0, "advantage_mean"])
    with pytest.raises(SamplesError, match="lacks the columns text"):
        samples_frame({"columns": [c for c in T.SAMPLE_COLUMNS if c != "text"], "data": []})


def test_store_problems_are_one_line(demo, workbench_uri, tmp_path):
    _, col = demo
    rid = col.loc[("ppo", 0), "run_id"]
    with pytest.raises(SamplesError) as e:
        load_samples(workbench_uri, rid, 21)
    assert "cannot read samples/step_000021.json" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(StoreNotFoundError):
        saved_steps(f"sqlite:///{tmp_path / 'none.db'}", rid)
    with pytest.raises(StoreUnreachableError):
        saved_steps(f"http://127.0.0.1:{closed_port()}", rid)
