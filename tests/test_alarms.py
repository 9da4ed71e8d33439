"""stppo.alarms: the one early-warning rule on hand-computed series, online == offline, state round
trip, key preference and one-line config errors."""

from __future__ import annotations

import json
import math
import random

import pytest

from stppo import metric_names as T
from stppo.alarms import (
    INDICATORS,
    AlarmConfig,
    AlarmSet,
    Indicator,
    alarm_statistic,
    first_alarm,
    register_indicator,
    robust_baseline,
)

STEPS = list(range(1, 21))


def test_robust_baseline_by_hand():
    m, s = robust_baseline([1.0, 2.0, 3.0, 4.0, 100.0], min_scale=0.1)
    assert m == 3.0 and s == pytest.approx(1.4826)  # |dev| = 2, 1, 0, 1, 97 -> MAD 1; the outlier moves nothing
    assert robust_baseline([0.5] * 5, min_scale=0.02) == (0.5, 0.02)  # flat baseline: the floor
    assert robust_baseline([1.0, 2.0, 3.0, 4.0], min_scale=0.1)[0] == 2.5  # even count: mean of the middle two


def test_level_indicator_fires_after_two_values_beyond_h():
    # clip_frac: baseline 0.1 x 5 -> m = 0.1, scale = min_scale 0.02; z = (x - 0.1) / 0.02
    x = [0.1] * 5 + [0.15, 0.19, 0.2, 0.21, 0.1]
    stat = alarm_statistic(STEPS[:10], x, "clip_frac")
    assert all(math.isnan(a) for a in stat[:6])  # baseline, then P - 1 = 1 value without a statistic
    assert stat[6:9] == pytest.approx([2.5, 4.5, 5.0])  # min of the last two z: min(2.5, 4.5), min(4.5, 5), ...
    assert first_alarm(STEPS[:10], x, "clip_frac") == 8  # a_7 = 2.5 < 4, a_8 = 4.5
    assert first_alarm(STEPS[:10], x, "clip_frac", AlarmConfig(persist=1)) == 7  # z_6 = 2.5, z_7 = 4.5
    assert first_alarm(STEPS[:10], x, "clip_frac", AlarmConfig(threshold=4.9)) == 9  # a_9 = min(5, 5.5)


def test_single_spike_does_not_fire_but_a_sustained_one_does():
    x = [1.0] * 5 + [1.0, 50.0, 1.0, 1.0, 1.0]  # grad_norm_spike: one batch 50x
    assert first_alarm(STEPS[:10], x, "grad_norm_spike") is None
    assert first_alarm(STEPS[:10], x, "grad_norm_spike", AlarmConfig(persist=1)) == 7
    x = [1.0] * 5 + [1.0, 3.0, 3.0, 1.0, 1.0]  # log 3 / 0.2 = 5.5 twice
    assert first_alarm(STEPS[:10], x, "grad_norm_spike") == 8


def test_directions():
    drop = [0.98] * 5 + [0.97, 0.85, 0.80, 0.80, 0.80]  # valid_action_drop: (0.98 - x) / 0.02
    assert first_alarm(STEPS[:10], drop, "valid_action_drop") == 8
    rise = [0.98] * 5 + [1.0] * 5
    assert first_alarm(STEPS[:10], rise, "valid_action_drop") is None
    # response_length is two-sided: a collapse to short answers fires as well as an explosion
    for factor in (0.2, 5.0):
        x = [100.0] * 5 + [100.0 * factor] * 5
        assert first_alarm(STEPS[:10], x, "response_length") == 7


def test_growth_transform_sees_exponential_growth_not_its_level():
    # clip_bias_growth: y = (log x_t - log x_{t-2}) / 2. A norm that is constant at any level never fires;
    # one that grows by e^{0.2} per step fires once the log growth is (0.2 - 0) / 0.02 = 10 robust SDs away
    flat = [5.0] * 20
    assert first_alarm(STEPS, flat, "clip_bias_growth") is None
    grow = [0.01] * 10 + [0.01 * math.exp(0.2 * k) for k in range(1, 11)]
    stat = alarm_statistic(STEPS, grow, "clip_bias_growth")
    assert all(math.isnan(a) for a in stat[:8])  # L = 2 values without y, W = 5 baseline, P - 1 = 1
    # step 11: y = 0.1 (one of the two lagged steps grew), z = 5; step 12: y = 0.2, z = 10; a_12 = min(5, 10)
    assert stat[10] == 0.0 and stat[11] == pytest.approx(5.0)
    assert first_alarm(STEPS, grow, "clip_bias_growth") == 12


def test_missing_and_nonfinite_values_are_skipped():
    x = [0.1, None, 0.1, math.nan, 0.1, 0.1, math.inf, 0.1, 0.2, 0.2]
    stat = alarm_statistic(STEPS[:10], x, "clip_frac")
    assert math.isnan(stat[1]) and math.isnan(stat[3]) and math.isnan(stat[6])
    assert first_alarm(STEPS[:10], x, "clip_frac") == 10  # baseline = the five finite 0.1s, streak at 9, 10


def test_noise_only_gives_no_alarm_on_any_indicator():
    rng = random.Random(0)
    cfg = AlarmConfig()
    for name, ind in INDICATORS.items():
        base = {"level": 0.3, "log": 1.0, "growth": 0.05}[ind.transform]
        x = [base * (1 + 0.01 * rng.gauss(0, 1)) for _ in range(200)]
        assert first_alarm(range(200), x, name, cfg) is None, name


def test_alarm_set_online_equals_offline_and_fires_once():
    rng = random.Random(1)
    steps = list(range(1, 41))
    clip = [0.05 + 0.002 * rng.gauss(0, 1) + (0.3 if s >= 25 else 0.0) for s in steps]
    grad = [1.0 + 0.01 * rng.gauss(0, 1) + (4.0 if s >= 30 else 0.0) for s in steps]
    alarms = AlarmSet()
    fired_at: dict[str, int] = {}
    for s, c, g in zip(steps, clip, grad):
        for name in alarms.update(s, {T.PG_CLIPFRAC: c, T.GRAD_NORM: g, T.SUCCESS_RATE: 0.5}):
            assert name not in fired_at  # first firing only
            fired_at[name] = s
    assert fired_at == alarms.fired == {"clip_frac": first_alarm(steps, clip, "clip_frac"),
                                        "grad_norm_spike": first_alarm(steps, grad, "grad_norm_spike")}
    assert fired_at == {"clip_frac": 26, "grad_norm_spike": 31}
    assert math.isnan(alarms.statistics()["entropy_fall"])  # never logged


def test_alarm_set_uses_the_first_logged_key_of_an_indicator():
    alarms = AlarmSet(AlarmConfig(indicators=["rollout_mismatch"], persist=1))
    fired = [alarms.update(s, {T.ROLLOUT_CORR_ABS_DIFF_MEAN: 0.01 if s < 8 else 1.0}) for s in range(1, 10)]
    assert fired[7] == ["rollout_mismatch"] and alarms.keys == {"rollout_mismatch": T.ROLLOUT_CORR_ABS_DIFF_MEAN}


def test_state_roundtrip_matches_uninterrupted():
    cfg = AlarmConfig(indicators=["clip_bias_growth", "valid_action_drop"], thresholds={"valid_action_drop": 3.0})
    series = [{T.CLIP_BIAS_NORM: 0.01 * math.exp(0.3 * max(0, s - 12)), T.VALID_ACTION_RATIO: 0.98 - 0.1 * (s > 14)}
              for s in range(1, 25)]
    a = AlarmSet(cfg)
    fired_a = [a.update(s, m) for s, m in enumerate(series, 1)]
    b = AlarmSet(cfg)
    fired_b = [b.update(s, m) for s, m in enumerate(series[:10], 1)]
    c = AlarmSet()
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))  # plain JSON-able state
    fired_b += [c.update(s, m) for s, m in enumerate(series[10:], 11)]
    assert fired_a == fired_b and a.fired == c.fired and c.cfg == cfg
    assert a.fired == {"clip_bias_growth": 14, "valid_action_drop": 16}  # z = 7.5 at 13, 15 at 14; 5, 5 at 15, 16


@pytest.mark.parametrize("kwargs, message", [
    ({"indicators": ["nope"]}, "unknown indicator 'nope'; valid: clip_bias_growth"),
    ({"thresholds": {"nope": 2.0}}, "unknown indicator 'nope'"),
    ({"threshold": 0.0}, "alarm.threshold and alarm.thresholds must be > 0"),
    ({"persist": 0}, "alarm.persist must be >= 1"),
    ({"baseline_steps": 2}, "alarm.baseline_steps must be >= 3"),
])
def test_config_errors_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as e:
        AlarmConfig(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_registering_a_name_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_indicator(Indicator("clip_frac", (T.PG_CLIPFRAC,), "up", "level", 0.02))
    with pytest.raises(ValueError, match="direction must be one of"):
        Indicator("x", (T.PG_CLIPFRAC,), "sideways", "level", 0.02)


def test_tracking_names_of_the_workbench():
    assert T.turn_key(3, "ratio_max") == "turn/k3/ratio_max"
    assert T.parse_turn_key("turn/k3/ratio_max") == (3, "ratio_max")
    assert T.parse_turn_key("turn/kx/ratio_max") is None and T.parse_turn_key("actor/ratio_max") is None
    assert T.reduce_name("turn/k0/ratio_max") == "max" and T.reduce_name("turn/k0/pg_clipfrac") == "mean"
    assert T.alarm_key("clip_frac") == "alarm/clip_frac" and T.samples_artifact(12) == "samples/step_000012.json"
    assert T.known_metric("turn/k1/entropy") and T.known_metric(T.COLLAPSE_ROLLBACKS)
    assert not T.known_metric("turn/k1/x")
    with pytest.raises(ValueError, match="unknown per-turn metric"):
        T.turn_key(0, "nope")
    every_key = {k for ind in INDICATORS.values() for k in ind.keys}
    assert every_key <= set(T.ALL_METRICS)


def test_mismatch_and_staleness_indicators_by_hand():
    # rollout_chi2: y = log(x + 1e-3); a flat 1e-4 baseline sits at log(1.1e-3), scale = min_scale 0.2
    chi2 = [1e-4] * 5 + [1e-4, 0.05, 0.05, 1e-4, 1e-4]
    z = (math.log(0.05 + 1e-3) - math.log(1e-4 + 1e-3)) / 0.2  # 19.2
    assert alarm_statistic(STEPS[:10], chi2, "rollout_chi2")[7] == pytest.approx(z)
    assert first_alarm(STEPS[:10], chi2, "rollout_chi2") == 8
    # below ε the χ² of float noise is flat: a tenfold wiggle under 1e-4 stays far from h
    assert first_alarm(STEPS[:10], [1e-5] * 5 + [1e-4] * 5, "rollout_chi2") is None
    # offpolicy_kl: a KL to the current policy that triples, (log 3.1e-3 − log 1.1e-3) / 0.2 = 5.2 ≥ 4
    kl = [1e-3] * 5 + [3e-3] * 5
    assert first_alarm(STEPS[:10], kl, "offpolicy_kl") == 7
    assert first_alarm(STEPS[:10], [1e-3] * 5 + [2e-3] * 5, "offpolicy_kl") is None  # (log 2.1/1.1) / 0.2 = 3.2
    # rollout_is_ess_drop: (0.98 − x) / 0.05 on a flat baseline
    ess = [0.98] * 5 + [0.95, 0.7, 0.6, 0.6, 0.6]
    stat = alarm_statistic(STEPS[:10], ess, "rollout_is_ess_drop")
    assert stat[6:8] == pytest.approx([0.6, 5.6])  # z = 0.6, 5.6, 7.6: a_7 = min(0.6, 5.6), a_8 = min(5.6, 7.6)
    assert first_alarm(STEPS[:10], ess, "rollout_is_ess_drop") == 8


def test_chi2_prefers_the_token_level_and_falls_back_to_the_sequence_level():
    token = AlarmSet(AlarmConfig(indicators=["rollout_chi2"]))
    for s in range(1, 8):
        token.update(s, {T.ROLLOUT_CORR_CHI2_TOKEN: 1e-3, T.ROLLOUT_CORR_CHI2_SEQ: 1.0})
    seq = AlarmSet(AlarmConfig(indicators=["rollout_chi2"]))
    seq.update(1, {T.ROLLOUT_CORR_CHI2_SEQ: 1.0})
    assert token.keys == {"rollout_chi2": T.ROLLOUT_CORR_CHI2_TOKEN} and seq.keys == {"rollout_chi2": T.ROLLOUT_CORR_CHI2_SEQ}


def test_an_indicator_whose_metric_a_run_does_not_log_never_fires():
    """A run without stale rollouts logs no offpolicy/*, an older run no rollout_corr/chi2_*: those
    indicators stay silent (no key, no statistic) while the others fire as usual."""
    alarms, fired = AlarmSet(), {}
    for s in range(1, 31):
        for name in alarms.update(s, {T.PG_CLIPFRAC: 0.05 if s < 15 else 0.5, T.ROLLOUT_CORR_K3_KL: 1e-4}):
            fired[name] = s
    assert fired == {"clip_frac": 16}
    for name in ("rollout_chi2", "offpolicy_kl", "rollout_is_ess_drop"):
        assert name not in alarms.keys and math.isnan(alarms.statistics()[name])
