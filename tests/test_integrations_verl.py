"""The engine-free parts of the verl backend's losses (docs/design.md, "verl backend: losses"):
turn ids from a mask, the spec of a verl call (`verl_spec`), verl's global counts as stppo's
denominators, verl's dual-clip fraction — and that they need neither verl nor, for the packages,
torch. Runs in
stppo's .venv (no verl); the calls through verl itself are in tests/verl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stppo.algos import PRESETS, ClipBias
from stppo.algos.aggregation import agg_loss
from stppo.algos.segments import turn_ids_from_mask
from stppo.integrations.verl.losses import (dual_clip_fraction, verl_global_denoms,
                                            verl_loss_agg)
from keyword_loss import policy_loss
from helpers.algos import make_inputs

ROOT = Path(__file__).resolve().parents[1]


# --- turn ids ------------------------------------------------------------------------------------
def loop_turn_ids(mask: torch.Tensor) -> torch.Tensor:
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for i in range(mask.shape[0]):
        k, prev = -1, False
        for t in range(mask.shape[1]):
            cur = bool(mask[i, t])
            if cur and not prev:
                k += 1
            if cur:
                out[i, t] = k
            prev = cur
    return out


def test_turn_ids_hand_computed_runs_truncation_and_empty_row():
    m = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1],   # three turns, the last cut at T
                      [0, 0, 0, 0, 0, 0, 0, 0],   # no agent token
                      [0, 1, 1, 1, 1, 1, 1, 1],   # starts after an observation
                      [1, 0, 1, 0, 1, 0, 1, 0]])  # one-token turns
    assert torch.equal(turn_ids_from_mask(m.bool()), torch.tensor([
        [0, 0, -1, 1, -1, -1, 2, 2], [-1] * 8, [-1, 0, 0, 0, 0, 0, 0, 0],
        [0, -1, 1, -1, 2, -1, 3, -1]]))
    assert torch.equal(turn_ids_from_mask(m), turn_ids_from_mask(m.bool()))  # 0/1 ints too
    assert turn_ids_from_mask(m.bool()).dtype == torch.int64


@pytest.mark.parametrize("seed", range(3))
def test_turn_ids_equal_a_loop_over_rows(seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(7, 40, generator=g) < 0.6
    assert torch.equal(turn_ids_from_mask(m), loop_turn_ids(m))
    assert turn_ids_from_mask(m[:0]).shape == (0, 40)


def test_turn_ids_reject_a_non_matrix():
    with pytest.raises(ValueError, match=r"loss_mask must have shape \(N, T\), got \(5,\)"):
        turn_ids_from_mask(torch.ones(5, dtype=torch.bool))


# --- the spec of a verl call ---------------------------------------------------------------------
def _config(**kw):
    """verl's actor config as the losses read it (a stand-in namespace, no verl here)."""
    from types import SimpleNamespace

    pl = SimpleNamespace(**{k: kw.pop(k) for k in ("tau", "estimator", "granularity", "options",
                                                   "spec") if k in kw})
    return SimpleNamespace(policy_loss=pl, **kw)


def test_verl_spec_is_the_preset_with_verls_clip_and_aggregation():
    from stppo.integrations.verl.losses import verl_spec

    for name, p in PRESETS.items():
        if name == "sspo":  # subsentences need token ids, which verl does not pass to a loss
            with pytest.raises(ValueError, match="loss_mode='sspo' reads subsentences"):
                verl_spec(name, "token-mean", _config())
            continue
        s = verl_spec(name, "token-mean", _config(clip_ratio_low=0.1, clip_ratio_high=0.3,
                                                  clip_ratio_c=3.0))
        assert s.replace(clip_low=p.clip_low, clip_high=p.clip_high, loss_agg=p.loss_agg,
                         dual_clip=None) == p.spec(), name
        assert (s.clip_low, s.clip_high, s.loss_agg) == (0.1, 0.3, "token-mean")
    st = verl_spec("st_ppo", "token-mean", _config(tau=0.7, granularity="sequence"))
    assert st.clip_bias == ClipBias("clip_bias_norm", 0.7, "token", "sequence")
    assert verl_spec("st_ppo", "token-mean", _config()).clip_bias == ClipBias("clip_bias_norm", 0.5)
    assert verl_spec("ppo", "token-mean", _config(tau=0.7)).clip_bias is None
    assert verl_spec("sapo", "token-mean", _config(clip_ratio_c=3.0)).dual_clip is None  # no dual clip


def test_a_sent_spec_wins_over_the_preset_and_the_knobs():
    from stppo.integrations.verl.losses import verl_spec

    sent = PRESETS["st_ppo"].spec(ratio_level="token", clip_bias=ClipBias("clip_triggered", 1.5))
    s = verl_spec("st_ppo", "seq-mean-token-mean", _config(spec=sent.to_dict(), tau=0.9))
    assert s.ratio_level == "token" and s.clip_bias == ClipBias("clip_triggered", 1.5)
    with pytest.raises(ValueError, match="estimator 'grad' needs the policy parameters"):
        verl_spec("st_ppo", "token-mean", _config(
            spec=PRESETS["st_ppo"].spec(clip_bias=ClipBias("clip_bias_norm", 0.5, "grad")).to_dict()))


def test_spec_round_trips_through_plain_values():
    import json

    from stppo.algos import LossSpec

    for p in PRESETS.values():
        spec = p.spec()
        assert LossSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# --- verl's counts, modes and metrics ------------------------------------------------------------
def verl_agg_loss(v, m, mode, dp, n_tok, n_rows):
    """verl 0.9.1 core_algos.agg_loss, written out (its +1e-8 aside)."""
    if mode == "token-mean":
        return (v * m).sum() / n_tok * dp
    rows = (v * m).sum(1)
    if mode == "seq-mean-token-mean":
        rows = rows / m.sum(1).clamp(min=1)
    return rows.sum() / n_rows * dp


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dp", [1, 4])
def test_global_denoms_reproduce_verl_agg_loss(mode, dp):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(5, 9, generator=g, dtype=torch.float64)
    m = torch.rand(5, 9, generator=g) < 0.5
    m[2] = False  # an empty row
    n_tok, n_rows = 37, 12  # the mini-batch's, over every rank and micro-batch
    d = verl_global_denoms(m, mode, dp_size=dp, batch_num_tokens=n_tok, global_batch_size=n_rows,
                           loss_scale_factor=None)
    assert d == (n_tok / dp, n_rows / dp)
    got = agg_loss(v, m, mode, global_denoms=d)
    want = verl_agg_loss(v, m.double(), mode, dp, n_tok, n_rows)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_global_denoms_fall_back_to_the_micro_batch_like_verl():
    m = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    d_tok, d_seq = verl_global_denoms(m, "token-mean")  # verl: local tokens, local rows with ≥1
    assert (int(d_tok), int(d_seq)) == (3, 2)
    with pytest.raises(ValueError, match="no batch_num_tokens with dp_size=2"):
        verl_global_denoms(m, "token-mean", dp_size=2, global_batch_size=8)
    with pytest.raises(ValueError, match="no global_batch_size with dp_size=2"):
        verl_global_denoms(m, "seq-mean-token-sum", dp_size=2, batch_num_tokens=8)


def test_verl_loss_agg_modes():
    assert verl_loss_agg("seq-mean-token-mean") == "seq-mean-token-mean"
    for bad in ("token-sum", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match=f"actor.loss_agg_mode='{bad}' is not supported"):
            verl_loss_agg(bad)


def test_dual_clip_fraction_hand_computed():
    ratio = torch.tensor([[3.5, 3.5, 2.0, 9.0], [4.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[-1.0, 1.0, -1.0, float("nan")], [-2.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    # agent tokens: 5; A < 0 and ρ > 3 at (0, 0) and (1, 0); (0, 3) is off the mask
    assert float(dual_clip_fraction(ratio, adv, mask, 3.0)) == pytest.approx(2 / 5)
    assert float(dual_clip_fraction(ratio, adv, mask & False, 3.0)) == 0.0


def test_packages_import_neither_torch_nor_verl():
    code = ("import sys, stppo.integrations, stppo.integrations.verl\n"
            "print(sorted(m for m in ('torch', 'verl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    code = "import sys, stppo.integrations.verl.losses\nprint('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # the losses are torch + stppo.algos only


# --- the monitor's copies of the loss's metrics ----------------------------------------------------
def test_loss_copies_take_every_key_outside_actor_back_to_its_name():
    from stppo import metric_names as K
    from stppo.integrations.verl.metrics import LOSS_COPIES, as_logged, copy_values

    assert as_logged(K.CLIP_BIAS_NORM) == "actor/clip_bias/norm" and as_logged(K.PG_LOSS) == K.PG_LOSS
    targets = {c.stppo for c in LOSS_COPIES}
    assert targets == {k for k in K.ALL_METRICS if not k.startswith("actor/")}
    logged = {"actor/clip_bias/norm": 0.7, "actor/clip_bias/scale": 0.5, "actor/pg_loss": 0.1}
    assert copy_values(LOSS_COPIES, logged) == {K.CLIP_BIAS_NORM: 0.7, K.CLIP_BIAS_SCALE: 0.5}


def test_turn_copies_divide_by_the_turns_weight_and_skip_turns_without_tokens():
    from stppo import metric_names as K
    from stppo.integrations.verl.metrics import copy_values, turn_copies

    logged = {"actor/turn/k0/tokens": 4.0, "actor/turn/k0/pg_clipfrac": 1.0, "actor/turn/k0/ratio_max": 5.0,
              "actor/turn/k1/tokens": 0.0, "actor/turn/k1/pg_clipfrac": 0.0}
    got = copy_values(turn_copies(2), logged)
    assert got == {K.turn_key(0, "tokens"): 4.0, K.turn_key(0, "pg_clipfrac"): 0.25,
                   K.turn_key(0, "ratio_max"): 1.25, K.turn_key(1, "tokens"): 0.0}
    assert not any(c.stppo.endswith("/entropy") for c in turn_copies(3))  # verl gives a loss no entropy
