"""Every baseline loss and advantage equals verl 0.9.1's function of the same name on the same
multi-turn tensors (padding, observation tokens between turns, finite garbage there), in float64:
loss, gradient w.r.t. log_prob, metrics. Run in .venv-verl (`make test`, or
`PYTHONPATH=$PWD .venv-verl/bin/python -m pytest tests/verl/test_baselines_vs_verl.py`).

Where verl differs, the relation is tested instead:
- verl's masked means divide by n + 1e-8 (agg 'seq-mean-token-mean', ppo_kl, GMPO's means): a
  relative 1e-8 / n per mean (n = 1 for a one-token turn), asserted as rel=5e-8
  after sums with cancellation (exact, rel=1e-12, elsewhere: token-mean and seq-mean-token-sum
  with the global batch info verl's caller fills);
- verl computes its fraction metrics in float32 (`.float()`): rel=1e-7;
- geo_mean averages over all rows (torch.mean), rows without response tokens included;
- geo_mean's clip fractions count tokens out of the log-space range whose clip does not bind;
- kl_cov reports mean |δ| as actor/ppo_kl (stppo: mean −δ, as every loss);
- DRO, clip_cov, kl_cov and geo_mean do not clamp δ to ±20 (stppo does; |δ| < 20 here);
- tir_optimal_token_baseline's returns also fill the observation positions between turns (the
  reverse cumsum over every position); stppo's are 0 off agent tokens, equal on them;
- rloo gives a group of one its raw score (so does stppo), rloo_vectorized gives 0;
- stppo's clip path forms its bound 1 ± ε of Python floats in float32 (`surrogate_parts`), so the
  vanilla comparison (TIS on the clip path) agrees to ~1e-8 where a clip binds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from stppo import metric_names as K
from stppo.algos import (agg_loss, compute_advantages, is_weights, reinforce_pp_advantages,
                         rloo_advantages)

from keyword_loss import policy_loss  # the spec's fields as keywords
from verl.trainer.config import AlgoConfig as VerlAlgoConfig
from verl.trainer.ppo import core_algos as core
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

EXACT, EPS, F32 = 1e-12, 5e-8, 1e-7  # identical math / verl's n + 1e-8 / verl's float32 metrics
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def multi_turn(n: int = 8, t: int = 28, seed: int = 0, empty_row: bool = False) -> dict:
    """verl's response view of multi-turn rollouts: 1–3 agent turns separated by observation
    tokens (mask 0), then padding; finite garbage on every masked position."""
    rng = random.Random(seed)
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n - 1 if empty_row else n):
        pos = 0
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(1, 5)
            mask[i, pos:pos + length] = True
            pos += length + rng.randint(1, 4)
    g = torch.Generator().manual_seed(seed)
    d = dict(dtype=torch.float64, generator=g)
    old = -torch.rand(n, t, **d) * 2.0 - 0.1
    lp = old + 0.4 * torch.randn(n, t, **d)
    adv = torch.randn(n, t, **d)
    rollout = old + 0.2 * torch.randn(n, t, **d)
    junk = lambda: 30.0 * torch.randn(n, t, **d)  # noqa: E731
    pick = lambda x: torch.where(mask, x, junk())  # noqa: E731
    return dict(log_prob=pick(lp), old_log_prob=pick(old), advantages=pick(adv),
                rollout_log_prob=pick(rollout), response_mask=mask)


def actor_config(x: dict, agg: str, loss_mode: str, clip_low=0.2, clip_high=0.2,
                 tau_pos=1.0, tau_neg=1.05, clip_ratio_c=3.0, **policy_loss_knobs) -> ActorConfig:
    """verl's real actor config, with the global batch info its `ppo_loss` fills (one rank)."""
    mask = x["response_mask"]
    return ActorConfig(
        strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio=clip_low,
        clip_ratio_low=clip_low, clip_ratio_high=clip_high, loss_agg_mode=agg,
        tau_pos=tau_pos, tau_neg=tau_neg, clip_ratio_c=clip_ratio_c,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy_loss_knobs),
        global_batch_info={"dp_size": 1, "batch_num_tokens": int(mask.sum()),
                           "global_batch_size": int(mask.any(dim=1).sum())})


def verl_loss(name: str, x: dict, agg: str, cfg: ActorConfig, weights=None, seed: int = 0):
    lp = x["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss, m = core.get_policy_loss_fn(name)(
        old_log_prob=x["old_log_prob"], log_prob=lp, advantages=x["advantages"],
        response_mask=x["response_mask"], loss_agg_mode=agg, config=cfg,
        rollout_is_weights=weights)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, m


def stppo_loss(mode: str, x: dict, agg: str, weights=None, seed: int = 0, ratio_level="token",
               **kw):
    lp = x["log_prob"].clone().requires_grad_(True)
    mask = x["response_mask"]
    kw = {"clip_low": 0.2, "clip_high": 0.2, **kw}
    torch.manual_seed(seed)
    loss, m = policy_loss(lp, x["old_log_prob"], x["advantages"], mask,
                          torch.where(mask, 0, -1), ratio_level=ratio_level, loss_agg=agg,
                          loss_mode=mode, rollout_is_weights=weights, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, m


def close(a, b, rel: float, scale: float = 1e-3) -> None:
    """|a − b| ≤ rel (|b| + scale) elementwise; `scale`: the size of the terms a sum cancels."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert torch.allclose(a, b, rtol=rel, atol=rel * scale), (a - b).abs().max().item()


def tis(x: dict) -> torch.Tensor:
    """Token TIS weights min(π_old / π_rollout, 1.5) (stppo.algos.rollout_corr; equal to verl's
    in tests/verl/test_rollout_correction_vs_verl.py)."""
    return is_weights(x["old_log_prob"] - x["rollout_log_prob"], x["response_mask"], "token", 1.5)[0]


def rel_for(agg: str) -> float:
    return EPS if agg == "seq-mean-token-mean" else EXACT


# --- losses ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("with_is", [False, True])
def test_cispo_equals_verl(agg, with_is):
    x = multi_turn(seed=1)
    w = tis(x) if with_is else None
    cfg = actor_config(x, agg, "cispo", clip_low=0.2, clip_high=0.28)
    vl, vg, vm = verl_loss("cispo", x, agg, cfg, w)
    sl, sg, sm = stppo_loss("cispo", x, agg, w, clip_low=0.2, clip_high=0.28)
    close(sl, vl, rel_for(agg))
    close(sg, vg, rel_for(agg))
    close(sm[K.PG_CLIPFRAC], vm["actor/pg_clipfrac"], F32)
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)
    assert vm["actor/pg_clipfrac_lower"] == 0.0 and sm[K.PG_CLIPFRAC].item() > 0


@pytest.mark.parametrize("with_is", [False, True])
def test_sapo_equals_verl(with_is):
    agg = "seq-mean-token-mean"  # verl's SAPO always aggregates so
    x = multi_turn(seed=2)
    w = tis(x) if with_is else None
    cfg = actor_config(x, "token-mean", "sapo", tau_pos=1.3, tau_neg=2.1)
    vl, vg, vm = verl_loss("sapo", x, "token-mean", cfg, w)
    sl, sg, sm = stppo_loss("sapo", x, agg, w, options={"tau_pos": 1.3, "tau_neg": 2.1})
    close(sl, vl, EPS)
    close(sg, vg, EPS)
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)
    assert vm["actor/pg_clipfrac"] == sm[K.PG_CLIPFRAC].item() == 0.0


@pytest.mark.parametrize("with_is", [False, True])
def test_gmpo_equals_verl_geo_mean(with_is):
    x = multi_turn(seed=3)
    mask = x["response_mask"]
    w = tis(x) if with_is else None
    cfg = actor_config(x, "token-mean", "geo_mean", clip_low=0.3, clip_high=0.25)
    vl, vg, vm = verl_loss("geo_mean", x, "token-mean", cfg, w)
    sl, sg, sm = stppo_loss("gmpo", x, "seq-mean-token-mean", w, ratio_level="sequence",
                            clip_low=0.3, clip_high=0.25)
    close(sl, vl, EPS)
    close(sg, vg, EPS)
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)
    # verl counts out-of-range tokens whatever the side; stppo only the binding ones
    d = (x["log_prob"] - x["old_log_prob"])
    a = x["advantages"]
    n = mask.sum()
    loose_pos = ((a > 0) & (d < -0.3) & mask).sum() / n
    loose_neg = ((a < 0) & (d > 0.25) & mask).sum() / n
    close(sm[K.PG_CLIPFRAC_HIGH] + loose_pos, vm["actor/pg_clipfrac"], F32)
    close(sm[K.PG_CLIPFRAC_LOW] + loose_neg, vm["actor/pg_clipfrac_lower"], F32)


def test_gmpo_relation_to_verl_with_a_row_without_response_tokens():
    x = multi_turn(seed=4, empty_row=True)
    n_rows, n_seq = x["response_mask"].shape[0], int(x["response_mask"].any(dim=1).sum())
    cfg = actor_config(x, "token-mean", "geo_mean", clip_low=0.4, clip_high=0.4)
    vl, vg, _ = verl_loss("geo_mean", x, "token-mean", cfg)
    sl, sg, _ = stppo_loss("gmpo", x, "seq-mean-token-mean", ratio_level="sequence",
                           clip_low=0.4, clip_high=0.4)
    close(sl * n_seq / n_rows, vl, EPS)  # verl: torch.mean over all rows
    close(sg * n_seq / n_rows, vg, EPS)


@pytest.mark.parametrize("agg", ("token-mean", "seq-mean-token-mean"))
@pytest.mark.parametrize("seed", [5, 6])
def test_clip_cov_equals_verl(agg, seed):
    x = multi_turn(seed=seed)
    knobs = dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0)
    cfg = actor_config(x, agg, "clip_cov", clip_low=0.2, clip_high=0.25, **knobs)
    vl, vg, vm = verl_loss("clip_cov", x, agg, cfg, seed=seed)
    sl, sg, sm = stppo_loss("clip_cov", x, agg, options=knobs, seed=seed, clip_low=0.2,
                            clip_high=0.25)
    close(sl, vl, rel_for(agg))
    close(sg, vg, rel_for(agg))
    close(sm[K.COV_SELECTED_FRAC], vm["actor/pg_clipfrac"], F32)
    assert sm[K.COV_SELECTED_FRAC].item() > 0  # the draw is exercised
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("with_is", [False, True])
def test_kl_cov_equals_verl(agg, with_is):
    x = multi_turn(seed=7)
    mask = x["response_mask"]
    w = tis(x) if with_is else None
    knobs = dict(kl_cov_ratio=0.1, ppo_kl_coef=0.5)
    cfg = actor_config(x, agg, "kl_cov", **knobs)
    vl, vg, vm = verl_loss("kl_cov", x, agg, cfg, w)
    sl, sg, sm = stppo_loss("kl_cov", x, agg, w, options=knobs)
    close(sl, vl, rel_for(agg))
    close(sg, vg, rel_for(agg))
    abs_kl = torch.where(mask, (x["log_prob"] - x["old_log_prob"]).abs(), 0.0).sum() / mask.sum()
    close(abs_kl, vm["actor/ppo_kl"], EPS)  # verl's actor/ppo_kl here is mean |δ|
    assert sm[K.COV_SELECTED_FRAC].item() == max(1, int(0.1 * int(mask.sum()))) / mask.sum()


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("with_is", [False, True])
def test_dppo_equals_verl(mode, agg, with_is):
    """Thresholds δ_low ≠ δ_high and a truncation C that binds: loss, gradient and verl's three
    metrics (pg_clipfrac = the tokens out of the region, pg_clipfrac_lower = ρ > C inside it)."""
    x = multi_turn(seed=12)
    x["log_prob"] = torch.where(x["response_mask"], x["log_prob"].clamp(max=-0.01), x["log_prob"])
    w = tis(x) if with_is else None
    low, high = (0.15, 0.1) if mode == "dppo_tv" else (0.05, 0.03)
    cfg = actor_config(x, agg, mode, clip_low=low, clip_high=high, clip_ratio_c=1.1)
    vl, vg, vm = verl_loss(mode, x, agg, cfg, w)
    sl, sg, sm = stppo_loss(mode, x, agg, w, clip_low=low, clip_high=high,
                            options={"clip_ratio_c": 1.1})
    close(sl, vl, rel_for(agg))
    close(sg, vg, rel_for(agg))
    close(sm[K.PG_CLIPFRAC], vm["actor/pg_clipfrac"], F32)
    close(sm[K.PG_CLIPFRAC_LOWER], vm["actor/pg_clipfrac_lower"], F32)
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)
    assert 0 < sm[K.PG_CLIPFRAC].item() < 1 and sm[K.PG_CLIPFRAC_LOWER].item() > 0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("with_is", [False, True])
def test_dro_equals_verl(agg, with_is):
    x = multi_turn(seed=13)
    w = tis(x) if with_is else None
    cfg = actor_config(x, agg, "dro", dro_beta=0.3)
    vl, vg, vm = verl_loss("dro", x, agg, cfg, w)
    sl, sg, sm = stppo_loss("dro", x, agg, w, options={"beta": 0.3})
    close(sl, vl, rel_for(agg))
    close(sg, vg, rel_for(agg))
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)
    assert set(vm) == {"actor/ppo_kl"}  # verl's DRO returns nothing else


@pytest.mark.parametrize("agg", AGGS)
def test_tis_on_the_clip_path_equals_verl_vanilla(agg):
    x = multi_turn(seed=8)
    w = tis(x)
    cfg = actor_config(x, agg, "vanilla", clip_low=0.2, clip_high=0.28)
    vl, vg, vm = verl_loss("vanilla", x, agg, cfg, w)
    sl, sg, sm = stppo_loss("clip", x, agg, w, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    scale = agg_loss(x["advantages"].abs() * w, x["response_mask"], agg).item()  # Σ w |A| ω
    close(sl, vl, F32, scale)  # the clip path's float32 bound (module docstring)
    close(sg, vg, rel_for(agg))
    close(sm[K.PG_CLIPFRAC], vm["actor/pg_clipfrac"], F32)
    close(sm[K.PPO_KL], vm["actor/ppo_kl"], EPS)


# --- advantages -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_is", [False, True])
def test_tir_optimal_token_baseline_equals_verl(seed, with_is):
    """Multi-turn rows (observation tokens inside the response mask's gaps), a group of one, an
    empty row, a unique longest member (the zero tail), finite garbage off the mask."""
    x = multi_turn(n=12, seed=20 + seed, empty_row=True)
    mask = x["response_mask"]
    g = torch.Generator().manual_seed(seed)
    index = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])  # group 3: one row; row 11: empty
    rewards = outcome(x, torch.rand(12, dtype=torch.float64, generator=g))
    rewards = rewards + torch.where(mask, 0.01 * torch.randn(mask.shape, dtype=torch.float64,
                                                             generator=g), 0.0)
    s2 = x["old_log_prob"].exp() ** 2 + 0.5 * torch.rand(mask.shape, dtype=torch.float64, generator=g)
    w = torch.where(mask, 1.5 * torch.rand(mask.shape, dtype=torch.float64, generator=g),
                    0.0) if with_is else None
    v_adv, v_ret = core.get_adv_estimator_fn("tir_optimal_token_baseline")(
        token_level_rewards=rewards, response_mask=mask.to(torch.float64), index=index,
        old_log_probs=x["old_log_prob"], sum_pi_squared=s2, rollout_is_weights=w,
        config=VerlAlgoConfig())
    adv, ret = compute_advantages("tir_optimal_token_baseline", loss_mask=mask, rewards=rewards,
                                  group_ids=torch.as_tensor(index), old_log_probs=x["old_log_prob"],
                                  sum_pi_squared=s2, rollout_is_weights=w)
    close(adv, v_adv, EXACT)
    close(ret, torch.where(mask, v_ret, 0.0), EXACT)  # verl's returns also fill observation slots
    lengths = [int(mask[i].sum()) for i in range(4, 9) if index[i] == 2]
    assert sorted(lengths)[-1] > sorted(lengths)[-2] or seed != 0  # the zero tail is exercised


def outcome(x: dict, scores: torch.Tensor) -> torch.Tensor:
    """Token-level rewards: the score at each row's last response token."""
    mask = x["response_mask"]
    t = mask.shape[1]
    last = torch.where(mask, torch.arange(t), -1).max(dim=1).values
    r = torch.zeros(mask.shape, dtype=torch.float64)
    r[torch.arange(len(last)), last] = scores
    return r


def test_rloo_equals_verl():
    x = multi_turn(n=10, seed=10)
    mask = x["response_mask"]
    index = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])  # group 3 has one member
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.3, 1.0, 0.0, 0.5, 0.7], dtype=torch.float64)
    rewards = outcome(x, scores)
    ours = rloo_advantages(rewards, torch.as_tensor(index), mask)
    theirs, _ = core.compute_rloo_outcome_advantage(rewards, mask.to(torch.float64), index)
    close(ours, theirs, EXACT)
    vec, _ = core.compute_rloo_vectorized_outcome_advantage(rewards, mask.to(torch.float64), index)
    alone = torch.as_tensor(index == 3)
    close(ours[~alone], vec[~alone], EXACT)
    assert vec[alone].abs().max().item() == 0.0 and ours[alone][mask[alone]].eq(0.7).all()


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_equals_verl(gamma):
    x = multi_turn(n=10, seed=11)
    mask = x["response_mask"]
    rewards = outcome(x, torch.rand(10, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(1)))
    rewards = rewards + torch.where(mask, 0.01 * torch.randn(mask.shape, dtype=torch.float64,
                                                             generator=torch.Generator()
                                                             .manual_seed(2)), 0.0)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma)
    v_adv, v_ret = core.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask.to(torch.float64), config=VerlAlgoConfig(gamma=gamma))
    close(ret, v_ret, EXACT)
    close(adv, v_adv, EPS)
