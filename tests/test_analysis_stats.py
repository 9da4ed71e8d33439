"""Statistics, collapse, tables and figures on the known store (hand-computed expectations)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import stats as sps
from helpers.stores import GROWTH, KNOWN, cache_tmp, known_uri, run_ids  # noqa: F401

import analysis
from analysis import (
    aggregate,
    bootstrap_diff_ci,
    bootstrap_mean_ci,
    collapse_table,
    ema,
    fit_exponential,
    growth_table,
    load_study,
    metric_kind,
    preset_table,
    significance_table,
    t_interval,
    welch_test,
)
from stppo import metric_names as T

T975_DF2 = 4.302652729749464  # t quantile 0.975 with 2 degrees of freedom (tables)
T975_DF1 = 12.706204736174707  # ... with 1 degree of freedom


@pytest.fixture(scope="module")
def study(known_uri, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("stats_cache")))
        return load_study(KNOWN, known_uri)


def test_t_interval_by_hand():
    mean, half, n = t_interval([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3)
    assert half == pytest.approx(T975_DF2 * 1.0 / math.sqrt(3), rel=1e-12)
    assert math.isnan(t_interval([5.0])[1]) and t_interval([5.0, math.nan])[2] == 1


def test_aggregate_mean_and_ci_across_seeds(study):
    agg = aggregate(study.metrics, T.GRAD_NORM, kind="real")  # the t-interval, as for unbounded quantities
    ppo = agg[agg["algo"] == "ppo"].set_index("step")
    # step 10: seeds log 10, 20, 30 -> mean 20, s = 10
    assert ppo.loc[10, "mean"] == pytest.approx(20.0)
    assert ppo.loc[10, "half_width"] == pytest.approx(T975_DF2 * 10 / math.sqrt(3))
    assert ppo.loc[10, "ci_low"] == pytest.approx(20.0 - T975_DF2 * 10 / math.sqrt(3))
    assert ppo.loc[10, "n"] == 3
    # step 25: seed 0 stopped at 20 -> 50, 75: mean 62.5, s = 25/sqrt(2)
    assert ppo.loc[25, "n"] == 2 and ppo.loc[25, "mean"] == pytest.approx(62.5)
    assert ppo.loc[25, "half_width"] == pytest.approx(T975_DF1 * (25 / math.sqrt(2)) / math.sqrt(2))
    st = agg[agg["algo"] == "st_ppo"]
    assert np.allclose(st["mean"], 1.0) and np.allclose(st["half_width"], 0.0)
    assert set(agg["interval"]) == {"t"}


def test_bands_stay_in_the_range_of_their_quantity(study):
    """Success with 2 seeds (0.0 and 0.8 after ppo seed 0 collapsed): the t-interval dips below 0,
    the default (bootstrap for rates) stays in [0, 1]; norms stay >= 0."""
    t = aggregate(study.metrics, T.SUCCESS_RATE, kind="real")
    assert (t["ci_low"] < 0).any()
    agg = aggregate(study.metrics, T.SUCCESS_RATE)
    assert set(agg["interval"]) == {"bootstrap"} and agg["ci_low"].min() >= 0 and agg["ci_high"].max() <= 1
    ppo = agg[agg["algo"] == "ppo"].set_index("step")
    assert ppo.loc[16, "n"] == 3 and (ppo.loc[16, "ci_low"], ppo.loc[16, "ci_high"]) == pytest.approx((0.0, 0.8))
    assert ppo.loc[25, "n"] == 2 and agg[agg["algo"] == "grpo"]["half_width"].isna().all()  # one run
    grad = aggregate(study.metrics, T.GRAD_NORM)
    assert set(grad["interval"]) == {"bootstrap"} and grad["ci_low"].min() >= 0
    g = grad[grad["algo"] == "ppo"].set_index("step")
    assert 10 <= g.loc[10, "ci_low"] < 20 < g.loc[10, "ci_high"] <= 30  # within the seeds' 10, 20, 30
    assert g.loc[10, "half_width"] == pytest.approx((g.loc[10, "ci_high"] - g.loc[10, "ci_low"]) / 2)
    one = aggregate(study.metrics, T.SUCCESS_RATE, by=("algo", "seed"))
    assert one["half_width"].isna().all()  # one value per point: no interval, not a zero-width one
    assert aggregate(study.metrics, T.SUCCESS_RATE).equals(agg)  # seeded: the same band every time
    with pytest.raises(ValueError, match="kind must be"):
        aggregate(study.metrics, T.SUCCESS_RATE, kind="bogus")


def test_bootstrap_mean_ci_and_metric_kinds():
    low, high = bootstrap_mean_ci([0.0, 0.0, 1.0], n_boot=4000)
    assert 0.0 <= low < 1 / 3 < high <= 1.0
    assert bootstrap_mean_ci([0.2, 0.2]) == (0.2, 0.2) and all(map(math.isnan, bootstrap_mean_ci([0.5])))
    assert metric_kind(T.SUCCESS_RATE) == "rate" and metric_kind(T.ZERO_STD_GROUP_FRAC) == "rate"
    assert metric_kind(T.CLIP_BIAS_NORM) == "nonneg" and metric_kind(T.ENTROPY) == "nonneg"
    assert metric_kind(T.PG_LOSS) == "real" and metric_kind(T.PPO_KL) == "real" and metric_kind("x/y") == "real"
    assert metric_kind("turn/k1/pg_clipfrac") == "rate" and metric_kind("turn/k0/adv_mean") == "real"


def test_aggregate_ema_smoothing_and_forward_fill(study):
    assert ema([0.0, 1.0, 1.0], 0.5).tolist() == [0.0, 0.5, 0.75]
    agg = aggregate(study.metrics, T.GRAD_NORM, smoothing=0.5)
    ppo = agg[agg["algo"] == "ppo"].set_index("step")
    # per seed k: y1 = k, y2 = 0.5k + 0.5*2k = 1.5k -> mean over k=1,2,3 of 1.5k = 3
    assert ppo.loc[2, "mean"] == pytest.approx(3.0)
    ff = aggregate(study.metrics, T.GRAD_NORM, forward_fill=True)
    assert ff[(ff["algo"] == "ppo") & (ff["step"] == 25)]["n"].item() == 3  # seed 0 carried at 20
    assert ff[(ff["algo"] == "ppo") & (ff["step"] == 25)]["mean"].item() == pytest.approx((20 + 50 + 75) / 3)
    with pytest.raises(ValueError, match="smoothing"):
        ema([1.0], 1.0)


def test_welch_test_equals_scipy_and_the_formula():
    a, b = [0.1, 0.7, 0.75], [0.8, 0.85, 0.9]
    res = welch_test(a, b)
    ref = sps.ttest_ind(a, b, equal_var=False)
    assert res["t"] == pytest.approx(ref.statistic) and res["p"] == pytest.approx(ref.pvalue)
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 3
    assert res["t"] == pytest.approx((np.mean(a) - np.mean(b)) / math.sqrt(va + vb))
    assert res["df"] == pytest.approx((va + vb) ** 2 / (va**2 / 2 + vb**2 / 2))


@pytest.mark.parametrize("a, b, t, p", [
    ([0.5, 0.5, 0.5], [0.25, 0.25], math.inf, 0.0),  # no spread, different means
    ([0.0, 0.0], [0.5, 0.5, 0.5], -math.inf, 0.0),
    ([0.5, 0.5, 0.5], [0.5, 0.5], math.nan, math.nan),  # no spread, no difference
])
def test_welch_test_of_tied_seeds(a, b, t, p):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        res = welch_test(a, b)
    assert res["t"] == pytest.approx(t, nan_ok=True) and res["p"] == pytest.approx(p, nan_ok=True)
    assert math.isnan(res["df"])


def test_welch_test_with_one_constant_group_is_scipys_without_its_warning():
    a, b = [0.1, 0.1, 0.1], [0.2, 0.25, 0.3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = welch_test(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning welch_test keeps from its user
        ref = sps.ttest_ind(a, b, equal_var=False)
    assert res["t"] == pytest.approx(ref.statistic) and res["p"] == pytest.approx(ref.pvalue)
    assert res["t"] == pytest.approx(-0.15 / math.sqrt(np.var(b, ddof=1) / 3))


def test_bootstrap_ci_of_the_difference():
    low, high = bootstrap_diff_ci([1.0, 1.0, 1.0], [0.25, 0.25])
    assert low == high == 0.75  # no spread, no uncertainty
    a, b = [0.1, 0.7, 0.75], [0.8, 0.85, 0.9]
    low, high = bootstrap_diff_ci(a, b, seed=1)
    assert low < np.mean(a) - np.mean(b) < high < 0
    assert (low, high) == bootstrap_diff_ci(a, b, seed=1)  # seeded


def test_exponential_fit_recovers_rate_and_r2():
    steps = np.arange(5, 15)
    fit = fit_exponential(steps, 0.01 * np.exp(0.2 * steps))
    assert fit["b"] == pytest.approx(0.2) and fit["r2"] == pytest.approx(1.0) and fit["n"] == 10
    assert fit["a"] == pytest.approx(math.log(0.01)) and fit["doubling_steps"] == pytest.approx(math.log(2) / 0.2)
    noisy = fit_exponential(steps, np.exp(0.2 * steps) * np.array([1, 2] * 5))
    assert 0 < noisy["r2"] < 1
    assert math.isnan(fit_exponential([1, 2], [1.0, 2.0])["b"])


def test_collapse_steps_are_found(study):
    col = collapse_table(study).set_index(["algo", "seed"])
    assert col.loc[("ppo", "0"), "collapse_step"] == 15  # success drop, run's own ema=1, patience=3
    assert "success EMA" in col.loc[("ppo", "0"), "reason"]
    assert col.loc[("ppo", "2"), "collapse_step"] == 20  # 3 non-finite steps from 20
    assert "non-finite" in col.loc[("ppo", "2"), "reason"]
    assert col.loc[("grpo", "0"), "collapse_step"] == 5 and "logged" in col.loc[("grpo", "0"), "reason"]
    assert not col.loc[("ppo", "1"), "collapsed"] and not col.loc[("st_ppo", "0"), "collapsed"]
    assert col["collapsed"].sum() == 3


def test_preset_table_numbers(study):
    tab = preset_table(study).set_index("algo")
    ppo = tab.loc["ppo"]
    assert ppo["collapsed"] == "2/3" and ppo["collapse_rate"] == pytest.approx(2 / 3)
    assert ppo["median_collapse_step"] == 17.5
    finals = [0.1, 0.7, 0.75]
    assert ppo["final_success_mean"] == pytest.approx(np.mean(finals))
    assert ppo["final_success_ci"] == pytest.approx(T975_DF2 * np.std(finals, ddof=1) / math.sqrt(3))
    assert ppo["final_success_mean"] - ppo["final_success_ci"] < 0  # the t-interval leaves [0, 1] ...
    low_high = (ppo["final_success_ci_low"], ppo["final_success_ci_high"])
    assert low_high == pytest.approx((0.1, 0.75))  # ... the bootstrap interval does not
    assert ppo["peak_grad_norm"] == pytest.approx((20 + 60 + 90) / 3)
    assert ppo["clip_ratio"] == pytest.approx(0.2) and ppo["ppo_kl"] == pytest.approx(0.02)
    assert math.isnan(ppo["kl_ref"]) and tab.loc["st_ppo", "kl_ref"] == pytest.approx(0.001)
    assert tab.loc["st_ppo", "collapsed"] == "0/3" and math.isnan(tab.loc["st_ppo", "median_collapse_step"])
    assert tab.loc["grpo", "collapsed"] == "1/1" and tab.loc["grpo", "final_success_n"] == 0


def test_significance_table_is_welch_per_pair(study):
    sig = significance_table(study, n_boot=2000)
    row = sig[(sig["a"] == "ppo") & (sig["b"] == "st_ppo")].iloc[0]
    ref = sps.ttest_ind([0.1, 0.7, 0.75], [0.8, 0.85, 0.9], equal_var=False)
    assert row["t"] == pytest.approx(ref.statistic) and row["p"] == pytest.approx(ref.pvalue)
    assert row["diff"] == pytest.approx(np.mean([0.1, 0.7, 0.75]) - 0.85)
    assert row["diff_ci_low"] < row["diff"] < row["diff_ci_high"]
    assert "Welch" in row["test"] and "bootstrap" in row["test"]
    assert len(sig) == 3  # grpo-ppo, grpo-st_ppo, ppo-st_ppo; grpo has no final success -> NaN test
    assert math.isnan(sig[(sig["a"] == "grpo") & (sig["b"] == "ppo")]["p"].item())


def test_growth_table_recovers_the_known_exponentials(study):
    g = growth_table(study, window=10).set_index(["algo", "seed"])
    pre = g.loc[("ppo", "0")]
    assert (pre["window_start"], pre["window_end"], pre["points"]) == (5, 14, 10)
    assert pre["growth_rate"] == pytest.approx(GROWTH[("ppo", 0)]) and pre["r2"] == pytest.approx(1.0)
    assert g.loc[("ppo", "2"), "growth_rate"] == pytest.approx(0.05)  # collapsed at 20: steps 10..19
    assert g.loc[("ppo", "1"), "window"] == "last steps" and g.loc[("ppo", "1"), "window_start"] == 21
    assert g.loc[("ppo", "1"), "growth_rate"] == pytest.approx(0.01)
    assert g.loc[("st_ppo", "0"), "growth_rate"] == pytest.approx(-0.01)
    assert math.isnan(g.loc[("grpo", "0"), "growth_rate"]) and g.loc[("grpo", "0"), "points"] == 0
    matched = growth_table(study, window=10, control="matched").set_index(["algo", "seed"])
    # median collapse step of the three collapsed runs (5, 15, 20) is 15: window 5..14
    assert (matched.loc[("st_ppo", "1"), "window_start"], matched.loc[("st_ppo", "1"), "window_end"]) == (5, 14)
    summary = analysis.growth_summary(g).set_index(["algo", "collapsed"])
    assert summary.loc[("ppo", True), "median_growth_rate"] == pytest.approx((0.2 + 0.05) / 2)
    with pytest.raises(ValueError, match="control must be one of"):
        growth_table(study, control="bogus")


def _texts(fig) -> str:
    return " ".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_collapse_figure_marks_the_step_and_notes_missing_metrics(study, tmp_path):
    ids = run_ids(study)
    fig = analysis.fig_collapse_diagnosis(study.metrics, ids[("ppo", 0)], collapse_step=15,
                                          extra_metrics=[T.CLIP_BIAS_NORM])
    assert len(fig.axes) == 5
    marks = [ln for ax in fig.axes for ln in ax.lines if list(ln.get_xdata()) == [15, 15]]
    assert len(marks) == 5 and _texts(fig) == ""
    bare = analysis.fig_collapse_diagnosis(study.metrics, ids[("grpo", 0)], collapse_step=5)
    assert "advantages: not logged" in _texts(bare) and "grad norm (pre-clip): not logged" in _texts(bare)
    bare.savefig(tmp_path / "bare.png")
    assert (tmp_path / "bare.png").stat().st_size > 1000


def test_band_figures_draw_mean_and_ci_per_preset(study):
    fig3 = analysis.fig_token_vs_turn(study.metrics, presets=["ppo", "st_ppo"], log_scale=True)
    success, grad = fig3.axes[0], fig3.axes[1]
    assert success.get_yscale() == "linear" and grad.get_yscale() == "log"
    assert [ln.get_label() for ln in grad.lines if not ln.get_label().startswith("_")] == ["ppo (n=3)", "st_ppo (n=3)"]
    ydata = grad.lines[0].get_ydata()
    assert ydata[9] == pytest.approx(20.0)  # the aggregated mean at step 10
    # ppo seed 0 stops at step 20: from step 21 two seeds; the drop is marked and labelled once
    assert [t.get_text() for t in grad.texts] == ["n=2"] and grad.texts[0].xy[0] == 21
    marked = grad.lines[1]  # the points with fewer seeds than the curve's maximum
    assert list(marked.get_xdata()) == list(range(21, 31)) and marked.get_marker() == "."
    for ax in fig3.axes:
        ticks = ax.get_xticks()
        assert len(ticks) and np.allclose(ticks, np.round(ticks))  # integer step axes
    assert success.collections[0].get_paths()[0].vertices[:, 1].min() >= 0  # the band stays >= 0
    only_grpo = analysis.fig_token_vs_turn(study.metrics, presets=["grpo"])
    assert "actor/grad_norm: not logged" in _texts(only_grpo)
    fig4 = analysis.fig_success_by_preset(study.metrics)
    assert len(fig4.axes) == 1 and fig4.axes[0].get_title().startswith(T.VAL_SUCCESS_RATE)
    fig5 = analysis.fig_clip_kl(study.metrics)
    assert [ax.get_title() for ax in fig5.axes] == [T.PG_CLIPFRAC, T.PPO_KL, T.KL_REF]
