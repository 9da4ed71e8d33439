import math

import pytest

from stppo.diagnostics import CollapseConfig, CollapseDetector, detect_collapse


def test_stable_run_never_collapses():
    steps = list(range(50))
    success = [0.6 + 0.05 * math.sin(s) for s in steps]
    assert detect_collapse(steps, success) is None


def test_collapse_step_is_first_step_of_the_low_streak():
    cfg = CollapseConfig(ema=1.0, drop=0.5, min_peak=0.2, patience=3)
    success = [0.8] * 10 + [0.1] * 5
    assert detect_collapse(range(15), success, cfg=cfg) == 10


def test_short_dip_is_not_a_collapse():
    cfg = CollapseConfig(ema=1.0, patience=3)
    success = [0.8] * 10 + [0.1, 0.1] + [0.8] * 10
    assert detect_collapse(range(22), success, cfg=cfg) is None


def test_low_peak_never_counts():
    cfg = CollapseConfig(ema=1.0, min_peak=0.2, patience=2)
    success = [0.15] * 5 + [0.0] * 10
    assert detect_collapse(range(15), success, cfg=cfg) is None


def test_ema_smooths_single_noisy_steps():
    cfg = CollapseConfig(ema=0.3, patience=2)
    success = [0.8] * 10 + [0.0] + [0.8] * 10  # one bad batch
    assert detect_collapse(range(21), success, cfg=cfg) is None


def test_nonfinite_patience():
    cfg = CollapseConfig(nonfinite_patience=3)
    succ = [0.5] * 10
    assert detect_collapse(range(10), succ, [False, True, True, False] + [False] * 6, cfg) is None
    assert detect_collapse(range(10), succ, [False, True, True, True] + [False] * 6, cfg) == 1


def test_online_state_roundtrip_matches_uninterrupted():
    cfg = CollapseConfig(ema=0.5, patience=4)
    success = [0.7] * 8 + [0.05] * 8
    a = CollapseDetector(cfg)
    for s in range(16):
        a.update(s, success[s])
    b = CollapseDetector(cfg)
    for s in range(6):
        b.update(s, success[s])
    c = CollapseDetector()
    c.load_state_dict(b.state_dict())
    for s in range(6, 16):
        c.update(s, success[s])
    assert a.detected and c.collapse_step == a.collapse_step


@pytest.mark.parametrize("kw", [dict(ema=0.0), dict(drop=1.0), dict(patience=0), dict(min_peak=1.0)])
def test_invalid_config_names_the_field(kw):
    with pytest.raises(ValueError, match="collapse"):
        CollapseConfig(**kw)
