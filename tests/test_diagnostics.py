"""The collapse rules of stppo.diagnostics: the live rule (checks of the live policy; the
definition) and the sampled-success rule (studies v2 and v3; the `sampled_collapse` alarm)."""

import math

import pytest

from stppo.diagnostics import (CollapseConfig, CollapseDetector, SampledCollapseConfig,
                               SampledCollapseDetector, collapse_detector, detect_collapse,
                               detect_sampled_collapse)


def checks(values, every=5):
    return [(i * every, v) for i, v in enumerate(values)]


# --- the live rule ------------------------------------------------------------------------------
def test_live_collapse_is_the_first_check_of_the_low_streak():
    # warm start 0.3, rises to 0.8, then two checks below 0.4: onset at the first of them
    step, reason = detect_collapse(checks([0.3, 0.5, 0.8, 0.7, 0.35, 0.1, 0.0]), cfg=CollapseConfig(patience=2))
    assert step == 20 and reason.startswith("live greedy success fell below 0.5 x its peak 0.800")


def test_one_low_check_is_noise_not_a_collapse():
    assert detect_collapse(checks([0.3, 0.8, 0.3, 0.8, 0.8]), cfg=CollapseConfig(patience=2)) == (None, None)


def test_a_run_that_never_reaches_min_peak_never_collapses():
    assert detect_collapse(checks([0.15, 0.19, 0.0, 0.0, 0.0]), cfg=CollapseConfig(min_peak=0.2)) == (None, None)
    # the peak counts from the warm start's check on: at 0.2 it counts (≥ min_peak)
    assert detect_collapse(checks([0.2, 0.05, 0.05]), cfg=CollapseConfig(min_peak=0.2))[0] == 5


def test_live_nonfinite_rule_reads_training_steps():
    bad = [(s, s in (3, 4, 5)) for s in range(1, 11)]
    assert detect_collapse(checks([0.5, 0.5, 0.5]), bad, CollapseConfig(nonfinite_patience=3))[0] == 3
    assert detect_collapse(checks([0.5, 0.5, 0.5]), bad, CollapseConfig(nonfinite_patience=4)) == (None, None)


def test_a_check_is_fed_after_the_training_step_of_its_number():
    """Check at 5 low, the non-finite streak 3..5: the streak completes at training step 5,
    before the check of step 5, so the non-finite rule marks the collapse (at 3)."""
    step, reason = detect_collapse([(0, 0.8), (5, 0.0), (10, 0.0)], [(s, s >= 3) for s in range(1, 11)],
                                   CollapseConfig(patience=1, nonfinite_patience=3))
    assert (step, reason) == (3, "non-finite loss or gradient")


def test_live_state_roundtrip_matches_uninterrupted():
    cfg = CollapseConfig(patience=3)
    vals = [0.3, 0.6, 0.8, 0.3, 0.2, 0.1, 0.1]
    a = CollapseDetector(cfg)
    for s, v in checks(vals):
        a.observe_validation(s, v)
    b = CollapseDetector(cfg)
    for s, v in checks(vals)[:4]:
        b.observe_validation(s, v)
    c = CollapseDetector()
    c.load_state_dict(b.state_dict())
    for s, v in checks(vals)[4:]:
        c.observe_validation(s, v)
    assert a.detected and (c.collapse_step, c.reason) == (a.collapse_step, a.reason) == (15, a.reason)


@pytest.mark.parametrize("kw", [dict(rule="ema"), dict(every=-1), dict(questions=0), dict(drop=1.0),
                                dict(patience=0), dict(min_peak=1.0), dict(nonfinite_patience=0)])
def test_invalid_live_config_names_the_field(kw):
    with pytest.raises(ValueError, match=r"trainer\.collapse\."):
        CollapseConfig(**kw)


# --- the sampled-success rule (v2, v3; the sampled_collapse alarm) ---------------------------------
def test_stable_run_never_collapses():
    steps = list(range(50))
    success = [0.6 + 0.05 * math.sin(s) for s in steps]
    assert detect_sampled_collapse(steps, success) == (None, None)


def test_collapse_step_is_first_step_of_the_low_streak():
    cfg = SampledCollapseConfig(ema=1.0, drop=0.5, min_peak=0.2, patience=3)
    success = [0.8] * 10 + [0.1] * 5
    assert detect_sampled_collapse(range(15), success, cfg=cfg)[0] == 10


def test_short_dip_is_not_a_collapse():
    cfg = SampledCollapseConfig(ema=1.0, patience=3)
    success = [0.8] * 10 + [0.1, 0.1] + [0.8] * 10
    assert detect_sampled_collapse(range(22), success, cfg=cfg)[0] is None


def test_low_peak_never_counts():
    cfg = SampledCollapseConfig(ema=1.0, min_peak=0.2, patience=2)
    success = [0.15] * 5 + [0.0] * 10
    assert detect_sampled_collapse(range(15), success, cfg=cfg)[0] is None


def test_ema_smooths_single_noisy_steps():
    cfg = SampledCollapseConfig(ema=0.3, patience=2)
    success = [0.8] * 10 + [0.0] + [0.8] * 10  # one bad batch
    assert detect_sampled_collapse(range(21), success, cfg=cfg)[0] is None


def test_nonfinite_patience():
    succ = [0.5] * 10
    assert detect_sampled_collapse(range(10), succ, [False, True, True, False] + [False] * 6,
                                   nonfinite_patience=3)[0] is None
    assert detect_sampled_collapse(range(10), succ, [False, True, True, True] + [False] * 6,
                                   nonfinite_patience=3)[0] == 1


def test_sampled_state_roundtrip_and_rearm():
    cfg = SampledCollapseConfig(ema=0.5, patience=4)
    success = [0.7] * 8 + [0.05] * 8
    a = SampledCollapseDetector(cfg)
    for s in range(16):
        a.update(s, success[s])
    b = SampledCollapseDetector(cfg)
    for s in range(6):
        b.update(s, success[s])
    c = SampledCollapseDetector()
    c.load_state_dict(b.state_dict())
    for s in range(6, 16):
        c.update(s, success[s])
    assert a.detected and c.collapse_step == a.collapse_step
    c.rearm()  # fires again only after a new streak; the peak is kept
    assert not c.detected and not any(c.update(s, 0.05) for s in range(16, 19)) and c.update(19, 0.05)


@pytest.mark.parametrize("kw", [dict(ema=0.0), dict(drop=1.0), dict(patience=0), dict(min_peak=1.0)])
def test_invalid_sampled_config_names_the_field(kw):
    with pytest.raises(ValueError, match=r"trainer\.collapse\.sampled\."):
        SampledCollapseConfig(**kw)


def test_rule_sampled_decides_by_the_rollouts_success_and_logs_the_checks_only():
    """trainer.collapse.rule=sampled (studies v2, v3): the detector's verdict is the sampled
    rule's; the live checks change nothing."""
    det = collapse_detector(CollapseConfig(rule="sampled", sampled=SampledCollapseConfig(ema=1.0, patience=2)))
    det.observe_validation(0, 0.8)
    for step, success in enumerate([0.8, 0.8, 0.1, 0.1], start=1):
        det.observe_step(step, False, success)
        det.observe_validation(step, 0.0)  # a live collapse the rule does not read
    assert det.collapse_step == 3 and det.reason.startswith("success EMA")
    live = collapse_detector(CollapseConfig())
    for step, success in enumerate([0.8, 0.8, 0.1, 0.1], start=1):
        live.observe_step(step, False, success)  # the rollouts' success: not read by the live rule
    assert not live.detected
