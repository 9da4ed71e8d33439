"""Optuna sweeps: trials read from a real sqlite storage, pruned trials marked, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.store import AnalysisError, StoreNotFoundError
from analysis.sweeps import fig_sweep, list_sweeps, param_columns, trials_frame

SWEEP = "clip_range-st_ppo"
# (clip_low, clip_high, objective or None, state, intermediate values)
TRIALS = [(0.1, 0.2, 0.60, "COMPLETE", {}), (0.2, 0.28, 0.72, "COMPLETE", {}),
          (0.3, 0.4, None, "PRUNED", {5: 0.30, 10: 0.12}), (0.15, 0.3, 0.65, "COMPLETE", {})]


def build_optuna_storage(root: Path) -> str:
    """A storage with one maximising study of four trials (one pruned, one with an MLflow run id)."""
    import optuna

    root.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{root / 'optuna.db'}"
    if (root / "done").exists():
        return url
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=SWEEP, storage=url, direction="maximize")
    dist = {"algo.clip_low": optuna.distributions.FloatDistribution(0.05, 0.5),
            "algo.clip_high": optuna.distributions.FloatDistribution(0.1, 0.6)}
    for i, (low, high, value, state, inter) in enumerate(TRIALS):
        study.add_trial(optuna.trial.create_trial(
            state=getattr(optuna.trial.TrialState, state), value=value,
            params={"algo.clip_low": low, "algo.clip_high": high}, distributions=dist,
            intermediate_values=inter, user_attrs={"mlflow_run_id": f"run{i}"} if i == 1 else {}))
    (root / "done").touch()
    return url


@pytest.fixture(scope="session")
def optuna_url(tmp_path_factory) -> str:
    return build_optuna_storage(tmp_path_factory.getbasetemp() / "optuna_store")


def test_trials_frame_marks_pruned_trials_with_their_last_report(optuna_url):
    assert list_sweeps(optuna_url) == [SWEEP]
    trials = trials_frame(optuna_url, SWEEP)
    assert trials["state"].tolist() == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"]
    assert trials["pruned"].tolist() == [False, False, True, False]
    assert trials["objective"].tolist() == [0.60, 0.72, 0.12, 0.65]  # pruned: its report at step 10
    assert param_columns(trials) == ["param:algo.clip_low", "param:algo.clip_high"]
    assert trials.loc[1, "mlflow_run_id"] == "run1" and set(trials["direction"]) == {"maximize"}


def test_sweep_figure_has_one_panel_per_parameter_and_marks_the_best(optuna_url):
    trials = trials_frame(optuna_url, SWEEP)
    fig = fig_sweep(trials)
    assert len(fig.axes) == 2
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["complete", "pruned (last report)", "best (trial 1)"]
    best = fig.axes[0].collections[2].get_offsets()[0]
    assert tuple(best) == pytest.approx((0.2, 0.72))


def test_missing_storage_and_unknown_study_are_one_line(tmp_path, optuna_url):
    path = tmp_path / "absent.db"
    with pytest.raises(StoreNotFoundError, match="Optuna storage not found"):
        list_sweeps(f"sqlite:///{path}")
    assert not path.exists()
    with pytest.raises(AnalysisError, match=f"'nope' not found in .*available: {SWEEP}"):
        trials_frame(optuna_url, "nope")


def test_cli_writes_trials_optimum_and_figure_and_fails_in_one_line(tmp_path, optuna_url, capsys):
    import json

    from analysis.sweeps import main

    assert main(["--storage", optuna_url, "--study", SWEEP, "--out", str(tmp_path / "out")]) == 0
    best = json.loads((tmp_path / "out" / f"{SWEEP}_optimum.json").read_text())
    assert best["best_trial"] == 1 and best["best_objective"] == 0.72 and best["pruned"] == 1
    assert (tmp_path / "out" / f"{SWEEP}_trials.csv").read_text().count("\n") == 5
    assert (tmp_path / "out" / f"{SWEEP}.png").stat().st_size > 0
    assert main(["--storage", optuna_url, "--study", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("analysis.sweeps: error:") and "\n" not in err and not (tmp_path / "x").exists()
