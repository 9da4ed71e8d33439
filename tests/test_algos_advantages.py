"""Advantage estimators (docs/design.md §2, "Advantages")."""

import math

import pytest
import torch

from stppo.algos import (ADVANTAGE_ESTIMATORS, compute_advantages, gae, grpo_advantages,
                         masked_whiten, turn_gae)
from stppo.algos.advantages import tir_optimal_token_baseline
from helpers.algos import make_layout, with_garbage


def loop_gae(rewards, values, gamma, lam):
    """Textbook GAE on one contiguous sequence (Python lists)."""
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else 0.0
        last = rewards[t] + gamma * next_v - values[t] + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def test_gae_hand_computed_on_a_contiguous_sequence():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = gae(r, v, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, gae_lambda=0.8)
    assert torch.allclose(adv, torch.tensor([[0.21712, 0.246, 0.3]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0.71712, 0.846, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_skips_non_agent_positions_and_equals_the_loop_on_agent_tokens(gamma, lam):
    mask, _ = make_layout(5, 20, seed=3, empty_row=True)
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 20, generator=g, dtype=torch.float64)
    values = torch.randn(5, 20, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(5):
        idx = mask[i].nonzero().flatten().tolist()
        ref_a, ref_r = loop_gae([rewards[i, j].item() for j in idx],
                                [values[i, j].item() for j in idx], gamma, lam)
        assert torch.allclose(adv[i, idx], torch.tensor(ref_a, dtype=torch.float64))
        assert torch.allclose(ret[i, idx], torch.tensor(ref_r, dtype=torch.float64))
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # values and rewards on observation / prompt / pad positions have no effect, even garbage
    adv2, ret2 = gae(with_garbage(rewards, mask), with_garbage(values, mask, seed=2), mask,
                     gamma, lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_masked_whiten():
    mask, _ = make_layout(4, 12, seed=1)
    x = torch.randn(4, 12, dtype=torch.float64) * 3 + 2
    w = masked_whiten(with_garbage(x, mask), mask)
    assert w[mask].mean().item() == pytest.approx(0.0, abs=1e-9)
    assert w[mask].std().item() == pytest.approx(1.0, rel=1e-6)  # unbiased variance
    assert (w[~mask] == 0).all()
    kept = masked_whiten(x, mask, shift_mean=False)
    assert kept[mask].mean().item() == pytest.approx(x[mask].mean().item())


def test_grpo_known_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([7, 7, 7, 7, 3, 9, 9])
    mask = torch.ones(7, 3, dtype=torch.bool)
    mask[:, 0] = False
    adv = grpo_advantages(scores, groups, mask)
    z = 0.5 / math.sqrt(1 / 3)  # group 7: mean 0.5, unbiased std sqrt(1/3)
    expected = torch.tensor([z, -z, z, -z, 0.0, 0.0, 0.0])  # size-1 group and zero-std group → 0
    assert torch.allclose(adv[:, 1:], expected.unsqueeze(1).expand(7, 2), atol=1e-5)
    assert (adv[:, 0] == 0).all()
    raw = grpo_advantages(scores, groups, mask, norm_by_std=False)
    assert torch.allclose(raw[:4, 1], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    with pytest.raises(ValueError, match="scores and group_ids must have shape"):
        grpo_advantages(scores[:3], groups, mask)


def test_turn_gae_hand_computed():
    # prompt | turn 0 at 1,2 | observation 3 | turn 1 at 4,5 | pad 6
    mask = torch.tensor([[False, True, True, False, True, True, False]])
    turns = torch.tensor([[-1, 0, 0, -1, 1, 1, -1]])
    nan = math.nan
    values = torch.tensor([[nan, 0.4, 9.0, nan, 0.7, 9.0, nan]], dtype=torch.float64)
    rewards = torch.tensor([[nan, 0.0, 0.0, nan, 0.0, 1.0, nan]], dtype=torch.float64)
    adv, ret = turn_gae(rewards, values, mask, turns, gamma=0.9, gae_lambda=0.5)
    # turn 1: δ = 1 - 0.7 = 0.3; turn 0: δ = 0.9·0.7 - 0.4 = 0.23, A = 0.23 + 0.45·0.3
    a0, a1 = 0.23 + 0.45 * 0.3, 0.3
    assert torch.allclose(adv, torch.tensor([[0, a0, a0, 0, a1, a1, 0]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0, a0 + 0.4, a0 + 0.4, 0, 1.0, 1.0, 0]],
                                            dtype=torch.float64))


def test_registry_dispatch_whitening_and_errors():
    mask, turns = make_layout(4, 12, seed=2)
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)
    adv, ret = compute_advantages("gae", loss_mask=mask, rewards=rewards, values=values,
                                  gamma=0.9, gae_lambda=0.9)
    raw, raw_ret = gae(rewards, values, mask, 0.9, 0.9)
    assert torch.allclose(adv, masked_whiten(raw, mask)) and torch.equal(ret, raw_ret)
    adv, _ = compute_advantages("grpo", loss_mask=mask, scores=torch.tensor([1.0, 0, 1, 0]),
                                group_ids=torch.tensor([0, 0, 1, 1]))
    assert adv[mask].abs().min() > 0
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "turn_gae", "rloo", "reinforce_pp",
                                         "tir_optimal_token_baseline"}
    with pytest.raises(ValueError, match="valid: gae, grpo, turn_gae, rloo, reinforce_pp"):
        compute_advantages("vtrace", loss_mask=mask)
    with pytest.raises(ValueError, match="advantage='gae' needs values"):
        compute_advantages("gae", loss_mask=mask, rewards=rewards)
    with pytest.raises(ValueError, match="advantage='turn_gae' needs turn_ids"):
        compute_advantages("turn_gae", loss_mask=mask, rewards=rewards, values=values)


# --- the TIR optimal token baseline (verl's tir_optimal_token_baseline) -------------------------
def loop_otb(rewards, mask, groups, old, s2, omega=None, zero_tail=True, eps=1e-8):
    """verl's algorithm, one row and one group at a time, on Python floats."""
    n = mask.shape[0]
    seq = {}
    for i in range(n):
        idx = mask[i].nonzero().flatten().tolist()
        r = [float(rewards[i, j]) for j in idx]
        w = [(1 - 2 * math.exp(float(old[i, j])) + float(s2[i, j]))
             * (1.0 if omega is None else float(omega[i, j]) ** 2) for j in idx]
        seq[i] = (idx, [sum(r[k:]) for k in range(len(r))],
                  [sum(w[:k + 1]) for k in range(len(w))])
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for g in set(groups.tolist()):
        rows = [i for i in range(n) if int(groups[i]) == g and seq[i][0]]
        lengths = sorted(len(seq[i][0]) for i in rows)
        for i in rows:
            idx, ret, energy = seq[i]
            for k, j in enumerate(idx):
                b = 0.0
                if len(rows) > 1:
                    num = sum(seq[o][1][k] * seq[o][2][k] for o in rows if len(seq[o][0]) > k)
                    den = sum(seq[o][2][k] for o in rows if len(seq[o][0]) > k)
                    b = num / (den + eps)
                    unique_longest = lengths.count(lengths[-1]) == 1 and len(idx) == lengths[-1]
                    if zero_tail and unique_longest and k >= lengths[-2]:
                        b = 0.0
                adv[i, j] = ret[k] - b
    return adv


def otb_inputs(seed, n=9, t=22):
    mask, _ = make_layout(n, t, seed=seed, max_turns=3, empty_row=True)
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2.0
    s2 = old.exp() ** 2 + 0.3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    rewards = torch.where(mask, 0.05 * torch.randn(n, t, generator=g, dtype=torch.float64), 0.0)
    last = torch.where(mask, torch.arange(t), -1).max(dim=1).values
    for i in range(n):
        if last[i] >= 0:
            rewards[i, last[i]] += float(torch.rand(1, generator=g))
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3])[:n]  # group 2: one member; row n-1 empty
    return rewards, mask, groups, old, s2


def test_otb_hand_computed_two_trajectories_with_an_observation_gap():
    # row 0: agent tokens at 0, 1, (observation), 3; row 1: agent tokens at 0, 1
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 9.0, 1.0], [0.0, 0.5, 0.0, 0.0]], dtype=torch.float64)
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.25, 0.5, 0.5]], dtype=torch.float64))
    s2 = torch.full((2, 4), 0.5, dtype=torch.float64)  # w = 1 − 2π + 0.5: 0.5, 0.5, ·, 0.5 / 0.5, 1.0
    adv, ret = tir_optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, s2)
    # G: row 0 [1, 1, ·, 1], row 1 [0.5, 0.5]; W: row 0 [0.5, 1, ·, 1.5], row 1 [0.5, 1.5]
    b0 = (1 * 0.5 + 0.5 * 0.5) / (0.5 + 0.5 + 1e-8)
    b1 = (1 * 1.0 + 0.5 * 1.5) / (1.0 + 1.5 + 1e-8)
    # position 2 (the third agent token) exists in row 0 only, the unique longest: B = 0 there
    assert torch.allclose(adv, torch.tensor([[1 - b0, 1 - b1, 0, 1.0], [0.5 - b0, 0.5 - b1, 0, 0]],
                                            dtype=torch.float64))
    assert torch.equal(ret, torch.tensor([[1.0, 1.0, 0, 1.0], [0.5, 0.5, 0, 0]], dtype=torch.float64))
    assert torch.equal(tir_optimal_token_baseline(rewards, mask, torch.tensor([0, 1]), old, s2)[0],
                       torch.where(mask, ret, 0.0))  # groups of one: A = G


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_is", [False, True])
def test_otb_equals_verls_algorithm_written_as_loops(seed, with_is):
    rewards, mask, groups, old, s2 = otb_inputs(seed)
    omega = (0.5 + torch.rand(mask.shape, dtype=torch.float64,
                              generator=torch.Generator().manual_seed(9))) if with_is else None
    adv, ret = compute_advantages("tir_optimal_token_baseline", loss_mask=mask, rewards=rewards,
                                  group_ids=groups, old_log_probs=old, sum_pi_squared=s2,
                                  rollout_is_weights=omega, gamma=0.5)  # γ: unused (verl's 1)
    assert torch.allclose(adv, loop_otb(rewards, mask, groups, old, s2, omega), atol=1e-13)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_otb_zero_tail_only_for_a_unique_longest_member():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    rewards = torch.where(mask, 0.25, 0.0).to(torch.float64)
    old, s2 = torch.full((4, 4), -1.0, dtype=torch.float64), torch.full((4, 4), 0.2, dtype=torch.float64)
    unique, _ = tir_optimal_token_baseline(rewards, mask, torch.tensor([0, 0, 1, 1]), old, s2)
    assert torch.allclose(unique[0, 2:], torch.tensor([0.5, 0.25], dtype=torch.float64))  # A = G
    tied, _ = tir_optimal_token_baseline(rewards, mask, torch.tensor([0, 0, 0, 0]), old, s2)
    assert tied[0, 2:].abs().max() < 1e-7  # two longest: B = their own G-weighted mean = G
    kept, _ = tir_optimal_token_baseline(rewards, mask, torch.tensor([0, 0, 1, 1]), old, s2,
                                         handle_zero_tail=False)
    assert kept[0, 2:].abs().max() < 1e-7


def test_otb_ignores_garbage_off_agent_tokens_and_needs_the_old_forward():
    rewards, mask, groups, old, s2 = otb_inputs(5)
    clean, _ = tir_optimal_token_baseline(rewards, mask, groups, old, s2)
    dirty, _ = tir_optimal_token_baseline(with_garbage(rewards, mask, 1), mask, groups,
                                          with_garbage(old, mask, 2), with_garbage(s2, mask, 3))
    assert torch.equal(clean, dirty)
    with pytest.raises(ValueError, match="needs old_log_probs, sum_pi_squared"):
        compute_advantages("tir_optimal_token_baseline", loss_mask=mask, rewards=rewards,
                           group_ids=groups)
