"""The testbed's calibration table (analysis.studies.testbed): the paper's shape read from the live checks,
the targets checked on the rows, and a calibration spread over two stores with unfinished runs
left out."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fixtures.runs import write_run
from analysis.studies.testbed import calibration_table, live_shape, main, targets
from stppo import metric_names as T


def test_live_shape_needs_a_rise_then_a_fall_below_half_the_peak():
    rise_fall = pd.Series([0.26, 0.5, 0.64, 0.4, 0.16], index=[0, 5, 10, 15, 20])
    got = live_shape(rise_fall)
    assert (got["peak"], got["peak_step"], got["low_after_peak"], got["shape"]) == (0.64, 10, 0.16, True)
    # falls, but not below half of the peak (0.32 ≥ 0.64 / 2)
    assert not live_shape(pd.Series([0.26, 0.64, 0.32], index=[0, 5, 10]))["shape"]
    # falls below half, but the rise is 0.13 < 0.2
    assert not live_shape(pd.Series([0.26, 0.39, 0.1], index=[0, 5, 10]))["shape"]
    # rises and never falls: the peak is the last check
    assert not live_shape(pd.Series([0.26, 0.5, 0.8], index=[0, 5, 10]))["shape"]
    assert not live_shape(pd.Series([], dtype=float))["shape"]


def _run(client, exp, algo, seed, *, lr, live, val, model="tiny", status="FINISHED"):
    tags = {T.TAG_ALGO: algo, T.TAG_MODEL: model, T.TAG_TASK: "testbed", T.TAG_SEED: str(seed),
            T.TAG_SWEEP: "", T.TAG_GIT_COMMIT: "synthetic"}
    steps = max(s for s, _ in live)
    series = {T.VAL_LIVE_SUCCESS_RATE: live, T.VAL_SUCCESS_RATE: val,
              T.STEP_TIME: [(s, 2.0) for s in range(1, steps + 1)],
              T.SUCCESS_RATE: [(s, 0.5) for s in range(1, steps + 1)]}
    return write_run(client, exp, tags=tags, params={"trainer.actor_lr": lr, "seed": seed}, series=series,
                     status=status)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Store A: on-policy ppo and grpo (3 seeds each, 0.26 → ≥ 0.76), one RUNNING run that must be
    left out. Store B: the reuse regime, ppo at lr 2e-4 with the shape in 3 of 4 seeds, and `small`
    on-policy starting 0.30 and gaining 0.4."""
    import mlflow

    root = tmp_path_factory.mktemp("testbed")
    a, b = f"sqlite:///{root}/a.db", f"sqlite:///{root}/b.db"
    ca, cb = mlflow.MlflowClient(a), mlflow.MlflowClient(b)
    on_a, on_b, reuse = ca.create_experiment("testbed"), cb.create_experiment("testbed"), \
        cb.create_experiment("testbed_reuse")
    for algo in ("ppo", "grpo"):
        for seed in range(3):
            final = 0.76 + 0.02 * seed
            _run(ca, on_a, algo, seed, lr=2e-4, live=[(0, 0.27), (5, 0.5), (10, final)],
                 val=[(0, 0.26), (10, final)])
    _run(ca, on_a, "ppo", 9, lr=2e-4, live=[(0, 0.27), (5, 0.1)], val=[(0, 0.26)], status="RUNNING")
    for seed, low in enumerate((0.1, 0.2, 0.25, 0.5)):
        _run(cb, reuse, "ppo", seed, lr=2e-4, live=[(0, 0.27), (5, 0.6), (10, low)], val=[(0, 0.26), (10, low)])
    _run(cb, on_b, "grpo", 0, lr=2e-4, live=[(0, 0.3), (5, 0.6), (10, 0.7)], val=[(0, 0.30), (10, 0.70)],
         model="small")
    return a, b


def test_calibration_over_two_stores_checks_every_target(stores, tmp_path):
    out = tmp_path / "out"
    assert main(["--tracking-uri", stores[0], "--tracking-uri", stores[1], "--out", str(out)]) == 0
    table = pd.read_csv(out / "calibration.csv")
    assert len(table) == 6 + 4 + 1  # the RUNNING run is left out
    assert 9 not in set(table["seed"])
    reuse = table[table["experiment"] == "testbed_reuse"].sort_values("seed")
    assert reuse["shape"].tolist() == [True, True, True, False]
    np.testing.assert_allclose(table["gain"], table["final"] - table["warm_start"], rtol=0, atol=1e-12)
    lines = (out / "targets.txt").read_text().splitlines()
    assert all(line.startswith("[met]") for line in lines), lines
    assert any("3 of 4 seeds" in line for line in lines)
    assert any(line.startswith("[met] small") for line in lines)


def test_a_missed_target_is_reported_not_met(stores):
    from analysis.export import merge_stores

    study = merge_stores(["testbed", "testbed_reuse"], list(stores), finished_only=True)
    table = calibration_table(study)
    table.loc[table["experiment"] == "testbed_reuse", "shape"] = False
    table.loc[(table["model"] == "tiny") & (table["algo"] == "grpo"), "final"] = 0.7
    lines = targets(table)
    assert any(line.startswith("[NOT met] reuse regime") for line in lines)
    assert any(line.startswith("[NOT met] on-policy grpo") for line in lines)
    assert any(line.startswith("[met] on-policy ppo") for line in lines)


def test_no_finished_runs_is_one_error_line(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/empty.db"
    assert main(["--tracking-uri", uri, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m analysis.studies.testbed: error:") and err.count("\n") == 1
