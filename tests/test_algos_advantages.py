"""Advantage estimators (docs/design.md §2, "Advantages")."""

import math

import pytest
import torch

from stppo.algos import (ADVANTAGE_ESTIMATORS, compute_advantages, gae, grpo_advantages,
                         masked_whiten, turn_gae)
from test_algos_helpers import make_layout, with_garbage


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
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "turn_gae", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match="valid: gae, grpo, turn_gae, rloo, reinforce_pp"):
        compute_advantages("vtrace", loss_mask=mask)
    with pytest.raises(ValueError, match="advantage='gae' needs values"):
        compute_advantages("gae", loss_mask=mask, rewards=rewards)
    with pytest.raises(ValueError, match="advantage='turn_gae' needs turn_ids"):
        compute_advantages("turn_gae", loss_mask=mask, rewards=rewards, values=values)
