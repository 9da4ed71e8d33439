"""stppo's rollout corrections (`stppo.algos.rollout_corr`) equal verl 0.9.1's on the same
multi-turn tensors (padding, observation tokens between turns, finite garbage there, a row
without agent tokens), in float64 to 1e-10: every name's fields (verl's RolloutCorrectionConfig
classmethods), the IS weights (token / sequence, truncation, IcePop, batch normalisation) and
their metrics, every rejection option and a combination with their metrics, the whole
correction with the off-policy diagnostics of every name, and the bypass-mode losses (REINFORCE
with IS weights and rejection; the clip loss against π_rollout). Run in .venv-verl."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import LossSpec, RolloutCorrection, is_weights, policy_loss, rejection_mask, sampler_mismatch
from stppo.algos.rollout_corr import DIAGNOSTIC_IS_THRESHOLD, ROLLOUT_CORRECTIONS, rollout_correction
from stppo.algos.rollout_corr.presets import FIELDS, REJECTION_OPTIONS
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos as core
from verl.trainer.ppo import rollout_corr_helper as H
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

TOL = 1e-10
PREFIX = "rollout_corr/"


def batch(n: int = 10, t: int = 30, seed: int = 0, noise: float = 0.3) -> dict:
    """verl's response view of multi-turn rollouts (1–3 agent turns between observations, then
    padding; the last row has no agent token), finite garbage off agent tokens; the sampler's
    log-probs off π_old by `noise` per token plus a per-row drift, so thresholds bind both ways."""
    rng = random.Random(seed)
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n - 1):
        pos = 0
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(1, 6)
            mask[i, pos:pos + length] = True
            pos += length + rng.randint(1, 4)
    g = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=g)
    old = -torch.rand(n, t, **d) * 2.0 - 0.1
    drift = noise * torch.randn(n, 1, **d)
    rollout = old + drift + noise * torch.randn(n, t, **d)
    lp = old + 0.2 * torch.randn(n, t, **d)
    junk = lambda: 30.0 * torch.randn(n, t, **d)  # noqa: E731
    pick = lambda x: torch.where(mask, x, junk())  # noqa: E731
    return dict(old=pick(old), rollout=pick(rollout), lp=pick(lp), adv=pick(torch.randn(n, t, **d)),
                mask=mask)


def same_metrics(ours: dict, theirs: dict, tol: float = TOL) -> None:
    """Every verl key (prefixed) is ours with the same value (|a − b| ≤ tol (1 + |b|))."""
    theirs = {k if k.startswith(PREFIX) else PREFIX + k: float(v) for k, v in theirs.items()}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, missing
    for k, v in theirs.items():
        a = float(ours[k])
        assert (math.isnan(a) and math.isnan(v)) or abs(a - v) <= tol * (1 + abs(v)), (k, a, v)


def verl_fields(cfg: RolloutCorrectionConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "_target_"}


# --- names -----------------------------------------------------------------------------------------
VERL_NAMES = sorted(n for n, v in vars(RolloutCorrectionConfig).items()
                    if isinstance(v, classmethod) and n != "disabled")


def test_every_verl_preset_is_a_name():
    assert set(ROLLOUT_CORRECTIONS) == {"none", *VERL_NAMES}
    assert set(verl_fields(RolloutCorrectionConfig())) == set(FIELDS)


@pytest.mark.parametrize("name", ["none", *VERL_NAMES])
def test_names_resolve_to_verls_fields(name):
    verl_name = "disabled" if name == "none" else name
    ours = RolloutCorrection(name)
    assert {f: getattr(ours, f) for f in verl_fields(RolloutCorrectionConfig())} == \
        verl_fields(getattr(RolloutCorrectionConfig, verl_name)())
    args = {k: (v * 1.5 if isinstance(v, float) else "0.9_1.2") for k, v in ours.options.items()
            if k != "batch_normalize"}
    changed = RolloutCorrection(name, args)
    assert {f: getattr(changed, f) for f in verl_fields(RolloutCorrectionConfig())} == \
        verl_fields(getattr(RolloutCorrectionConfig, verl_name)(**args))


# --- IS weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.5, "0.8_1.6", 1e6])
@pytest.mark.parametrize("normalise", [False, True])
def test_is_weights_and_metrics_equal_verl(level, threshold, normalise):
    x = batch(seed=1, noise=0.1 if level == "sequence" else 0.3)
    r = x["old"] - x["rollout"]
    ours, om = is_weights(r, x["mask"], level, threshold, normalise)
    theirs, vm = H.compute_rollout_correction_weights(r, x["mask"], level, threshold, normalise)
    torch.testing.assert_close(ours, torch.where(x["mask"], theirs, 0.0), rtol=TOL, atol=TOL)
    same_metrics(om, vm)
    assert set(om) == {PREFIX + k for k in vm}
    if threshold == 1.5:  # the bounds bind on both sides
        assert 0 < vm["rollout_is_ratio_fraction_high"] and 0 < vm["rollout_is_ratio_fraction_low"]


# --- rejection -------------------------------------------------------------------------------------
def _rs_threshold(option: str) -> str:
    """A threshold that keeps some and rejects some of `batch(noise=0.15)` under `option`."""
    if option.startswith("seq_sum"):
        return "0.5_2.0" if option.endswith("k1") else "0.15"
    return "0.9_1.1" if option.endswith("k1") else "0.02"


RS_CASES = [(opt, _rs_threshold(opt)) for opt in REJECTION_OPTIONS] + [
    ("seq_sum_k1", 1.5), ("seq_mean_k1,token_k3", "0.95_1.05,0.05"), ("seq_max_k2,seq_mean_k3", 0.03)]


@pytest.mark.parametrize("rs,threshold", RS_CASES)
def test_rejection_masks_and_metrics_equal_verl(rs, threshold):
    x = batch(seed=2, noise=0.15)
    r = x["old"] - x["rollout"]
    kept, om = rejection_mask(r, x["mask"], rs, threshold)
    theirs, vm = H.compute_rollout_rejection_mask(r, x["mask"], rs, threshold)
    assert torch.equal(kept, theirs.bool())
    assert 0 < kept.sum() < x["mask"].sum()  # some tokens kept, some rejected
    same_metrics(om, vm)
    assert set(om) == {PREFIX + k for k in vm}


# --- the whole correction, every name -------------------------------------------------------------
@pytest.mark.parametrize("name", list(ROLLOUT_CORRECTIONS))
def test_every_correction_equals_verls_correction_and_rejection(name):
    x = batch(seed=3, noise=0.02)
    rc = RolloutCorrection(name)
    c = rollout_correction(x["old"], x["rollout"], x["mask"], rc)
    threshold = None if rc.rollout_is is not None else DIAGNOSTIC_IS_THRESHOLD
    ours = {**sampler_mismatch(x["old"], x["rollout"], x["mask"], threshold), **c.metrics}
    w, mask, vm = H.compute_rollout_correction_and_rejection_mask(
        x["old"], x["rollout"], x["mask"], rc.rollout_is, rc.rollout_is_threshold,
        rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold)
    assert torch.equal(c.loss_mask, mask.bool())
    if w is None:
        assert c.weights is None
    else:
        torch.testing.assert_close(c.weights, torch.where(x["mask"], w.batch["rollout_is_weights"], 0.0),
                                   rtol=TOL, atol=TOL)
    same_metrics(ours, vm)


def test_offpolicy_metrics_equal_verls():
    x = batch(seed=4, noise=0.4)
    ours = sampler_mismatch(x["old"], x["rollout"], x["mask"])
    theirs = H.compute_offpolicy_metrics(x["old"], x["rollout"], x["mask"])
    same_metrics(ours, theirs)
    assert set(ours) == {PREFIX + k for k in theirs} | {K.ROLLOUT_CORR_ABS_DIFF_MEAN, K.ROLLOUT_CORR_ABS_DIFF_MAX}


# --- bypass mode's losses ---------------------------------------------------------------------------
def verl_bypass(x: dict, rc: RolloutCorrection, agg: str):
    """verl's `compute_policy_loss_bypass_mode` (old_log_prob = the sampler's) with its config."""
    mask = x["mask"]
    verl_rc = RolloutCorrectionConfig(**{f: getattr(rc, f) for f in FIELDS})
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                      clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=agg,
                      policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=verl_rc),
                      global_batch_info={"dp_size": 1, "batch_num_tokens": int(mask.sum()),
                                         "global_batch_size": int(x["mask"].any(dim=1).sum())})
    lp = x["lp"].clone().requires_grad_(True)
    loss, m = core.compute_policy_loss_bypass_mode(x["rollout"], lp, x["adv"], mask, agg, cfg)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, m


def stppo_bypass(x: dict, rc: RolloutCorrection, agg: str):
    """The own trainer's bypass mode: correction from π_θ against π_rollout, the loss over the
    kept tokens with the denominators of every agent token."""
    from stppo.algos import agg_denoms

    spec = LossSpec("grpo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, loss_agg=agg, advantage="grpo",
                    use_critic=False, rollout_correction=rc)
    mask = x["mask"]
    c = rollout_correction(x["lp"], x["rollout"], mask, rc)
    lp = x["lp"].clone().requires_grad_(True)
    out = policy_loss(lp, x["rollout"], x["adv"], c.loss_mask, torch.where(mask, 0, -1), spec,
                      global_denoms=agg_denoms(mask),
                      rollout_is_weights=c.weights if rc.applies_weights else None)
    (g,) = torch.autograd.grad(out.loss, lp)
    threshold = None if rc.rollout_is is not None else DIAGNOSTIC_IS_THRESHOLD
    return out.loss.detach(), g, {**out.metrics, **sampler_mismatch(x["lp"], x["rollout"], mask, threshold),
                                  **c.metrics}


@pytest.mark.parametrize("name", [n for n in ROLLOUT_CORRECTIONS if n.startswith("bypass_")])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_bypass_losses_equal_verls_bypass_mode(name, agg):
    x = batch(seed=5, noise=0.01)
    opts = {"rs_threshold": "0.99_1.01"} if "geo_rs" in name else {}
    rc = RolloutCorrection(name, opts)
    vl, vg, vm = verl_bypass(x, rc, agg)
    sl, sg, sm = stppo_bypass(x, rc, agg)
    # verl's masked means divide by n + 1e-8 (seq-mean-token-mean, ppo_kl): a relative 1e-8 / n
    rel = 5e-8 if agg == "seq-mean-token-mean" else TOL
    torch.testing.assert_close(sl, vl, rtol=rel, atol=rel)
    torch.testing.assert_close(sg, vg, rtol=rel, atol=rel)
    assert float(sm[K.PPO_KL]) == pytest.approx(vm["actor/ppo_kl"], rel=5e-8, abs=1e-12)
    same_metrics(sm, {k: v for k, v in vm.items() if k.startswith(PREFIX)})
    if "pg_clipfrac" in vm:
        assert float(sm[K.PG_CLIPFRAC]) == pytest.approx(vm["actor/pg_clipfrac"], rel=1e-7)
    if rc.rollout_rs is not None:
        assert 0 < vm["rollout_corr/rollout_rs_masked_fraction"] < 1


@pytest.mark.parametrize("name,options", [("bypass_pg_geo_rs_token_tis", {"rs_threshold": "0.98_1.02"}),
                                          ("bypass_ppo_clip_k3_rs", {"rs_threshold": 2e-4}),
                                          ("bypass_pg_is", {"threshold": 1.05})])
def test_the_stppo_loss_under_verls_ppo_loss_is_verls_bypass_mode(actor_config, name, options):
    """verl's v1 trainer in bypass mode passes the sampler's log-probs as old_log_prob and keeps the
    configured loss: `stppo_grpo` with the run's spec then corrects as verl's own `bypass_mode`
    loss does (weights and rejection from log_prob, REINFORCE for loss_type reinforce), through
    verl's `ppo_loss` on micro-batches of the multi-turn batch."""
    from verl_batch import floats, make_batch, run_ppo_loss

    rc = RolloutCorrection(name, options)
    spec = LossSpec("grpo", advantage="grpo", use_critic=False, loss_agg="token-mean", rollout_correction=rc)
    b = make_batch(seed=3, spread=0.02, garbage=-3.0)  # old_log_probs: the sampler's
    ours = actor_config("stppo_grpo", "token-mean", spec=spec.to_dict(), max_turns=0, clip_ratio_c=3.0)
    theirs = actor_config("bypass_mode", "token-mean", clip_ratio_c=3.0,
                          rollout_correction={f: getattr(rc, f) for f in FIELDS})
    sl, sm, sg = run_ppo_loss(ours, b, micro=4)
    vl, vm, vg = run_ppo_loss(theirs, b, micro=4)
    for a, v in zip(sl, vl):
        torch.testing.assert_close(a, v, rtol=TOL, atol=TOL)
    torch.testing.assert_close(sg, vg, rtol=TOL, atol=TOL)
    for a, v in zip(sm, vm):
        a, v = floats(a), floats(v)
        same_metrics(a, {k: x for k, x in v.items() if k.startswith(PREFIX)})
        assert a[K.PPO_KL] == pytest.approx(v["actor/ppo_kl"], rel=5e-8, abs=1e-12)
    assert rc.rollout_rs is None or any(0 < floats(v)[K.ROLLOUT_RS_MASKED_FRACTION] < 1 for v in vm)


# --- the clip fraction under IcePop ---------------------------------------------------------------
def test_clip_fractions_under_icepop_count_tokens_as_verl_does():
    """decoupled_token_icepop zeroes the weight of tokens whose π_old / π_rollout is outside
    [0.5, 5]. On some of them A > 0 and ρ = π_θ / π_old = e^0.5 > 1 + ε_high: verl's vanilla loss
    counts them clipped (its clip fraction comes before the weights), and so does stppo — in its
    own loss and in `stppo_ppo` under verl, with pg_clipfrac_lower of the dual clip — while the
    loss and its gradient stay verl's."""
    from stppo.integrations.verl.losses import make_verl_loss

    x = batch(seed=6, noise=0.8)
    mask = x["mask"]
    c = rollout_correction(x["old"], x["rollout"], mask, RolloutCorrection("decoupled_token_icepop"))
    w = c.weights
    zeroed = mask & (w == 0)  # (N, T)
    lp = torch.where(zeroed, x["old"] + 0.5, x["lp"])  # ρ = e^0.5 ≈ 1.65 there
    adv = torch.where(zeroed, x["adv"].abs() + 0.1, x["adv"])  # A > 0 there
    assert int(zeroed.sum()) >= 3 and bool((mask & (w > 0) & ((lp - x["old"]).exp() > 1.28)).any())
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                      clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                      policy_loss=PolicyLossConfig(loss_mode="vanilla"),
                      global_batch_info={"dp_size": 1, "batch_num_tokens": int(mask.sum()),
                                         "global_batch_size": int(mask.any(dim=1).sum())})
    results = {}
    for name, fn in (("verl", core.get_policy_loss_fn("vanilla")), ("stppo", make_verl_loss("ppo"))):
        g_lp = lp.clone().requires_grad_(True)
        loss, m = fn(old_log_prob=x["old"], log_prob=g_lp, advantages=adv, response_mask=mask,
                     loss_agg_mode="token-mean", config=cfg, rollout_is_weights=w)
        (g,) = torch.autograd.grad(loss, g_lp)
        results[name] = (loss.detach(), g, {k: float(v) for k, v in m.items()})
    (vl, vg, vm), (sl, sg, sm) = results["verl"], results["stppo"]
    for key in (K.PG_CLIPFRAC, K.PG_CLIPFRAC_LOWER):
        assert sm[key] == pytest.approx(vm[key], rel=1e-12, abs=1e-15), key
    torch.testing.assert_close(sl, vl, rtol=TOL, atol=TOL)
    torch.testing.assert_close(sg, vg, rtol=TOL, atol=TOL)
    # the zeroed tokens are in verl's count: without them it would be smaller
    n = int(mask.sum())
    assert vm[K.PG_CLIPFRAC] * n >= int(zeroed.sum())
    # the own trainer's loss reports the same clip fraction
    spec = LossSpec("ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, loss_agg="token-mean")
    own = policy_loss(lp, x["old"], adv, mask, torch.where(mask, 0, -1), spec, rollout_is_weights=w)
    assert float(own.metrics[K.PG_CLIPFRAC]) == pytest.approx(vm[K.PG_CLIPFRAC], rel=1e-12)
