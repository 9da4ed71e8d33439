"""analysis.warning on a real MLflow store of runs with a known leading signal: the known lead
times, zero false alarms, no alarm without a signal; ROC AUC on a constructed case; the report's
warning table and figure."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers.stores import DEMO, SIGNAL, SIGNAL_RUNS, workbench_uri  # noqa: F401

from analysis import collapse_table, load_study
from analysis.report import main
from analysis.collapse import COLLAPSE_COLUMNS
from analysis.warning import (STAT_COLUMNS, early_warning, fig_early_warning, roc_auc, roc_curve, run_statistics,
                              run_warnings, warning_table)
from stppo import metric_names as T
from stppo.alarms import AlarmConfig


@pytest.fixture(scope="module")
def signal(workbench_uri, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("warning_cache")))
        return load_study(SIGNAL, workbench_uri)


def _by_seed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(seed=frame["seed"].astype(int)).set_index("seed")


def test_onsets_are_the_drop_steps(signal):
    col = _by_seed(collapse_table(signal))
    for i, (c, _) in enumerate(SIGNAL_RUNS):
        assert (col.loc[i, "collapse_step"] == c) if c else not col.loc[i, "collapsed"]


@pytest.mark.parametrize("persist", [1, 2])
def test_known_leading_signal_gives_the_known_lead_time(signal, persist):
    """clip fraction jumps k steps before the onset: the alarm needs `persist` values beyond h, so it
    fires at onset − k + persist − 1 and the lead time is k − persist + 1."""
    cfg = AlarmConfig(persist=persist)
    table, runs = early_warning(signal, cfg)
    clip = _by_seed(runs[runs["indicator"] == "clip_frac"])
    for i, (c, k) in enumerate(SIGNAL_RUNS):
        if c is not None and k is not None:
            assert clip.loc[i, "warned"] and clip.loc[i, "lead"] == k - persist + 1
            assert clip.loc[i, "first_alarm"] == c - k + persist - 1
        else:
            assert not clip.loc[i, "warned"] and math.isnan(clip.loc[i, "lead"])
    row = table.set_index("indicator").loc["clip_frac"]
    leads = [k - persist + 1 for c, k in SIGNAL_RUNS if k is not None]
    assert (row["collapsed_runs"], row["warned"], row["not_warned"]) == (4, 3, 1)
    assert row["lead_median"] == np.median(leads)
    assert (row["lead_q1"], row["lead_q3"]) == tuple(np.quantile(leads, [0.25, 0.75]))
    assert (row["stable_runs"], row["false_alarms"], row["false_alarm_rate"]) == (3, 0, 0.0)


def test_indicators_without_signal_never_fire(signal):
    table, runs = early_warning(signal)
    flat = runs[runs["indicator"].isin(["grad_norm_spike", "valid_action_drop"])]
    assert len(flat) == 2 * len(SIGNAL_RUNS) and not flat["first_alarm"].notna().any()
    assert not runs.loc[runs["indicator"] == "clip_frac", "false_alarm"].any()  # no alarm in a run without signal
    rows = table.set_index("indicator")
    assert rows.loc["grad_norm_spike", "warned"] == 0 and rows.loc["grad_norm_spike", "false_alarms"] == 0
    assert rows.loc["entropy_fall", "runs_without"] == len(SIGNAL_RUNS)  # never logged: left out


def test_online_alarm_flags_match_the_offline_rule(signal):
    """The `alarm/clip_frac` flags written by AlarmSet (as the trainer logs them) at the offline first alarms."""
    _, runs = early_warning(signal)
    m = signal.metrics
    flags = m[m["metric"] == T.alarm_key("clip_frac")].set_index("run_id")["step"]
    clip = runs[(runs["indicator"] == "clip_frac") & runs["warned"]].set_index("run_id")["first_alarm"]
    assert len(clip) == 3 and all(flags[str(r)] == clip[r] for r in clip.index)


def test_roc_auc_and_curve_on_a_constructed_case():
    pos, neg = [3.0, 2.0, 1.0], [0.5, 2.0, -math.inf]
    # 3 beats all three; 2 beats 0.5 and -inf, ties 2 (1/2); 1 beats 0.5 and -inf -> (3 + 2.5 + 2) / 9
    assert roc_auc(pos, neg) == pytest.approx(7.5 / 9)
    assert roc_auc([1.0, 2.0], [0.0]) == 1.0 and roc_auc([0.0], [1.0, 2.0]) == 0.0
    assert math.isnan(roc_auc([], [1.0]))
    curve = roc_curve(pos, neg)
    assert curve["threshold"].tolist()[:4] == [math.inf, 3.0, 2.0, 1.0]
    assert curve[["fpr", "tpr"]].to_numpy().tolist() == [[0, 0], [0, 1 / 3], [1 / 3, 2 / 3], [1 / 3, 1],
                                                         [2 / 3, 1], [1, 1]]
    area = np.trapezoid(curve["tpr"], curve["fpr"])  # the linear ROC's area is the Mann–Whitney AUC
    assert area == pytest.approx(7.5 / 9)


def test_threshold_moves_the_trade_off_on_real_statistics(signal):
    stats = run_statistics(signal)
    assert set(stats.columns) == {"run_id", "indicator", "key", "step", "stat"}
    strict, _ = early_warning(signal, AlarmConfig(threshold=1000.0), stats=stats)
    loose, _ = early_warning(signal, AlarmConfig(threshold=0.5), stats=stats)
    s, lo = strict.set_index("indicator").loc["clip_frac"], loose.set_index("indicator").loc["clip_frac"]
    assert s["warned"] == 0 and s["false_alarms"] == 0
    assert lo["warned"] >= 3 and lo["auc"] == s["auc"]  # the AUC does not depend on h


def test_threshold_sweep_stacks_one_table_per_threshold(signal):
    from analysis.warning import threshold_sweep

    sweep = threshold_sweep(signal, [0.5, 1000.0])
    assert sorted(set(sweep["threshold"])) == [0.5, 1000.0]
    lo = sweep[(sweep["threshold"] == 0.5) & (sweep["indicator"] == "clip_frac")].iloc[0]
    hi = sweep[(sweep["threshold"] == 1000.0) & (sweep["indicator"] == "clip_frac")].iloc[0]
    assert hi["warned"] == 0 and lo["warned"] >= 3 and lo["auc"] == hi["auc"]
    single, _ = early_warning(signal, AlarmConfig(threshold=0.5))
    pd.testing.assert_frame_equal(sweep[sweep["threshold"] == 0.5].reset_index(drop=True), single)


def test_figure_and_report_write_the_warning_table(signal, workbench_uri, tmp_path, monkeypatch):
    table, runs = early_warning(signal)
    fig = fig_early_warning(table, runs)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "clip_frac\nwarned 3/4 · false 0/3" in labels
    assert any("clip_frac (AUC" in t.get_text() for t in fig.axes[1].get_legend().get_texts())
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "report"
    assert main(["--experiment", SIGNAL, "--out", str(out), "--tracking-uri", workbench_uri,
                 "--bootstrap", "200", "--alarm-persist", "1"]) == 0
    csv = pd.read_csv(out / "warning.csv").set_index("indicator")
    assert csv.loc["clip_frac", "warned"] == 3 and csv.loc["clip_frac", "lead_median"] == 6.0  # leads 6, 10, 3
    per_run = pd.read_csv(out / "warning_runs.csv")
    assert len(per_run[per_run["indicator"] == "clip_frac"]) == len(SIGNAL_RUNS)
    assert {"fig6_early_warning.png", "fig6_early_warning.pdf"} <= {p.name for p in out.iterdir()}
    md = (out / "summary.md").read_text()
    assert "## Early warning of collapse" in md and "| clip_frac | actor/pg_clipfrac | 3/4 | 6 [4.5, 8] | 0/3 |" in md


def test_report_alarm_options_are_validated_in_one_line(workbench_uri, tmp_path, capsys):
    code = main(["--experiment", DEMO, "--out", str(tmp_path / "o"), "--tracking-uri", workbench_uri,
                 "--alarm-baseline", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "alarm.baseline_steps must be >= 3" in err[0]


def test_no_logged_indicator_is_an_empty_table_not_an_error(tmp_path):
    stats = pd.DataFrame({c: pd.Series(dtype="float64" if c == "stat" else "object") for c in STAT_COLUMNS})
    runs = run_warnings(None, stats, collapse=pd.DataFrame(columns=list(COLLAPSE_COLUMNS)))
    table = warning_table(runs, all_runs=3)
    assert runs.empty and (table["runs_without"] == 3).all() and table["auc"].isna().all()
    fig = fig_early_warning(table.iloc[:0], runs)
    assert "no run logged any indicator" in [t.get_text() for t in fig.axes[0].texts]
    fig.savefig(tmp_path / "empty.png")
