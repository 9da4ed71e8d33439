"""The combined early warning (analysis.studies.combined_warning): its model, threshold, labels and the
preset-grouped cross-validation, on hand-made data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.logistic import false_alarm_threshold, fit_logistic, run_balanced_weights
from analysis.studies.combined_warning import (BEST_SINGLE, COMBINED, Settings, cross_validate, feature_frame, main,
                                               run_outcomes, step_labels, summary_table)


def _newton(x, y, w, l2):
    """Reference: Newton's method on the same objective (standardised features, no penalty on b)."""
    w = w / w.sum()
    mu = (w[:, None] * x).sum(0)
    sd = np.sqrt((w[:, None] * (x - mu) ** 2).sum(0))
    z = np.hstack([(x - mu) / sd, np.ones((len(x), 1))])
    theta = np.zeros(z.shape[1])
    pen = np.diag([l2] * (z.shape[1] - 1) + [0.0])
    for _ in range(50):
        p = 1 / (1 + np.exp(-z @ theta))
        g = z.T @ (w * (p - y)) + pen @ theta
        h = (z * (w * p * (1 - p))[:, None]).T @ z + pen
        theta -= np.linalg.solve(h, g)
    return theta, mu, sd


def test_logistic_fit_is_the_penalised_optimum():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    y = (x @ np.array([1.5, -1.0, 0.0]) + rng.normal(size=200) > 0).astype(float)
    w = rng.uniform(0.5, 2.0, size=200)
    m = fit_logistic(x, y, w, l2=0.3)
    theta, mu, sd = _newton(x, y, w, 0.3)
    np.testing.assert_allclose(np.append(m.w, m.b), theta, atol=1e-5)
    np.testing.assert_allclose(m.decision(x), ((x - mu) / sd) @ theta[:3] + theta[3], atol=1e-5)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        fit_logistic(x, y * 2)


def test_false_alarm_threshold_allows_the_stated_share():
    assert false_alarm_threshold([3.0, 2.0, 1.0, 0.0], 0.25) == np.nextafter(2.0, np.inf)  # 1 of 4 ≥ θ
    assert false_alarm_threshold([3.0, 2.0, 1.0, 0.0], 0.0) == np.nextafter(3.0, np.inf)  # none
    assert false_alarm_threshold([3.0, -np.inf], 0.5) == np.nextafter(-np.inf, 0)  # every finite score
    assert false_alarm_threshold([], 0.1) == -np.inf


def test_step_labels_cover_the_horizon_before_the_onset_only():
    idx = pd.MultiIndex.from_tuples([("a", s) for s in range(1, 11)] + [("b", 3), ("b", 4)],
                                    names=["run_id", "step"])
    collapse = pd.DataFrame({"run_id": ["a", "b"], "collapsed": [True, False], "collapse_step": [8.0, np.nan]})
    y = step_labels(idx, collapse, horizon=2)
    assert y.loc["a"].to_dict() == pytest.approx({1: np.nan, 2: np.nan, 3: np.nan, 4: np.nan, 5: np.nan,
                                                  6: 1.0, 7: 1.0, 8: 1.0, 9: np.nan, 10: np.nan}, nan_ok=True)
    assert list(y.loc["b"]) == [0.0, 0.0]


def test_run_balanced_weights():
    w = run_balanced_weights(np.array(["a", "a", "b", "c", "c", "c"]), np.array([1, 1, 0, 0, 0, 0.0]))
    # run a: two rows of 1/2; runs b, c: 1 and 3 × 1/3; then each class half of the total 3
    np.testing.assert_allclose(w, [0.75, 0.75, 0.75, 0.25, 0.25, 0.25])


def test_run_outcomes_window_lead_and_false_alarm():
    s = pd.Series([0.0, 2.0, 5.0, 0.0, 3.0, 1.0],
                  index=pd.MultiIndex.from_tuples([("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("b", 3)]))
    collapse = pd.DataFrame({"run_id": ["a", "b"], "collapsed": [True, False], "collapse_step": [2.0, np.nan]})
    out = run_outcomes(s, collapse, 1.5).set_index("run_id")
    assert out.loc["a", "score"] == 2.0  # step 3 is after the onset: outside the window
    assert out.loc["a", "warned"] and out.loc["a", "lead"] == 0.0
    assert out.loc["b", "false_alarm"] and out.loc["b", "score"] == 3.0


def _synthetic(n_per=4, presets=("p", "q", "r", "s"), seed=0):
    """Runs of 12 steps; collapsed runs (half of each preset) collapse at step 10, and indicator
    'good' rises from step 7 on in them; 'noise' is noise."""
    rng = np.random.default_rng(seed)
    rows, runs, col = [], [], []
    for p in presets:
        for i in range(n_per):
            rid, collapsed = f"{p}{i}", i % 2 == 0
            runs.append({"run_id": rid, "algo": p, "model": "tiny"})
            col.append({"run_id": rid, "collapsed": collapsed, "collapse_step": 10.0 if collapsed else np.nan})
            for t in range(1, 13):
                rows.append({"run_id": rid, "step": t, "indicator": "good",
                             "stat": (t - 6) * 2.0 if collapsed and t >= 7 else rng.normal(0, 0.5)})
                rows.append({"run_id": rid, "step": t, "indicator": "noise", "stat": rng.normal()})
    return pd.DataFrame(rows), pd.DataFrame(runs), pd.DataFrame(col)


def test_cross_validation_holds_each_preset_out_and_finds_the_signal():
    stats, runs, collapse = _synthetic()
    feats = feature_frame(stats, ["good", "noise"])
    out = cross_validate(feats, collapse, runs, Settings(horizon=3, max_false_alarm=0.1))
    assert (out["fold"] == out["algo"]).all()  # a run is only ever scored by the fold that left its preset out
    assert set(out["alarm"]) == {COMBINED, BEST_SINGLE}
    assert set(out.loc[out["alarm"] == BEST_SINGLE, "indicator"]) == {"good"}
    table = summary_table(out).set_index("alarm")
    assert table.loc[COMBINED, "auc"] == 1.0 and table.loc[COMBINED, "warned"] == 8
    assert table.loc[COMBINED, "lead_median"] >= 2
    assert table.loc[COMBINED, "false_alarms"] == 0


def test_feature_frame_clips_and_fills():
    stats = pd.DataFrame({"run_id": ["a", "a", "a"], "indicator": ["x", "y", "x"], "step": [1, 1, 2],
                          "stat": [50.0, -1.0, np.inf]})
    f = feature_frame(stats, ["x", "y", "z"])
    assert f.loc[("a", 1)].tolist() == [10.0, -1.0, 0.0]
    assert ("a", 2) not in f.index  # a non-finite statistic is no evidence


def test_cli_on_exported_runs(tmp_path, capsys):
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "docs" / "results" / "frontier" / "data"
    rc = main(["--data", str(data / "grid_l3"), str(data / "grid_l1"), "--out", str(tmp_path)])
    assert rc == 0
    table = pd.read_csv(tmp_path / "combined_warning.csv")
    assert list(table["alarm"]) == [COMBINED, BEST_SINGLE]
    # 78 runs, 58 units: 20 runs repeat another preset's outcomes (analysis.identical)
    assert (table["runs"] == 58).all() and table["folds"].eq(13).all()
    assert (tmp_path / "fig_combined_warning.png").stat().st_size > 0
    assert main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_folds_hold_a_corrected_or_coupled_preset_out_with_its_preset():
    stats, runs, collapse = _synthetic(presets=("p", "q", "r"))
    # half of p's runs carry a correction label, half of q's the coupled form: the same presets
    runs["algo"] = [a + ("+decoupled_geo_rs" if a == "p" and i % 4 >= 2 else "+bypass_ppo_clip" if a == "q"
                         and i % 4 >= 2 else "") for i, a in enumerate(runs["algo"])]
    out = cross_validate(feature_frame(stats, ["good", "noise"]), collapse, runs, Settings(horizon=3))
    assert set(out["fold"]) == {"p", "q", "r"}  # three folds, not five
    assert (out["fold"] == out["algo"].str.split("+").str[0]).all()
    assert out[out["alarm"] == COMBINED].groupby("fold")["run_id"].nunique().to_dict() == {"p": 4, "q": 4, "r": 4}


def test_runs_without_the_mismatch_metrics_get_zero_for_those_indicators():
    from stppo.alarms import AlarmConfig

    mismatch = ["rollout_chi2", "offpolicy_kl", "rollout_is_ess_drop"]
    assert set(mismatch) <= set(AlarmConfig().indicators)  # the combined model's default features
    stats = pd.DataFrame({"run_id": ["v2", "v2", "v3"], "indicator": ["grad_norm_spike", "clip_frac", "offpolicy_kl"],
                          "step": [3, 3, 3], "stat": [2.0, 1.0, 5.0]})
    f = feature_frame(stats, AlarmConfig().indicators)
    assert f.loc[("v2", 3), mismatch].tolist() == [0.0, 0.0, 0.0]
    assert f.loc[("v3", 3), "offpolicy_kl"] == 5.0 and f.loc[("v3", 3), "grad_norm_spike"] == 0.0
