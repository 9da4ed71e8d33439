"""Importance ratios (docs/design.md §2, "Ratio level")."""

import math

import pytest
import torch

from stppo.algos import (RATIO_LEVELS, importance_ratio, log_ratio, sequence_ratio, token_ratio,
                         turn_ratio)
from helpers.algos import loop_ratio, make_inputs, with_garbage

LEVELS = ("token", "turn", "sequence")


def test_log_ratio_is_masked_and_clamped():
    lp = torch.tensor([[0.1, 30.0, math.nan, -40.0]])
    old = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False, True]])
    delta = log_ratio(lp, old, mask)
    assert torch.allclose(delta, torch.tensor([[0.1, 20.0, 0.0, -20.0]]))


def test_turn_ratio_hand_computed_including_a_split_turn():
    # turn 0 = positions 0,1; turn 1 = positions 2 and 4 (split by an observation at 3)
    delta = torch.tensor([[0.1, 0.3, -0.2, 0.0, 0.4, 0.0]])
    mask = torch.tensor([[True, True, True, False, True, False]])
    turns = torch.tensor([[0, 0, 1, -1, 1, -1]])
    rho = turn_ratio(delta, mask, turns)
    e = math.exp
    expected = torch.tensor([[e(0.2), e(0.2), e(0.1), 1.0, e(0.1), 1.0]])
    assert torch.allclose(rho, expected)


def test_sequence_and_token_ratio_hand_computed():
    delta = torch.tensor([[0.1, 0.3, 0.0, -0.1], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False, True], [False, False, False, False]])
    turns = torch.where(mask, 0, -1)
    seq = sequence_ratio(delta, mask, turns)
    m = math.exp(0.3 / 3)
    assert torch.allclose(seq, torch.tensor([[m, m, 1.0, m], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.allclose(token_ratio(delta, mask), delta.exp())


def test_one_token_turns_make_turn_ratio_equal_token_ratio():
    x = make_inputs(5, 16, seed=3)
    mask = x["loss_mask"]
    turns = torch.where(mask, torch.cumsum(mask.long(), dim=1) - 1, -1)  # every token its own turn
    r_tok, _ = importance_ratio(x["log_probs"], x["old_log_probs"], mask, turns, "token")
    r_turn, _ = importance_ratio(x["log_probs"], x["old_log_probs"], mask, turns, "turn")
    assert torch.allclose(r_tok, r_turn, rtol=1e-6)


def test_one_turn_per_trajectory_makes_turn_ratio_equal_sequence_ratio():
    x = make_inputs(5, 16, seed=4)
    mask = x["loss_mask"]
    turns = torch.where(mask, 0, -1)
    r_seq, _ = importance_ratio(x["log_probs"], x["old_log_probs"], mask, turns, "sequence")
    r_turn, _ = importance_ratio(x["log_probs"], x["old_log_probs"], mask, turns, "turn")
    assert torch.allclose(r_seq, r_turn, rtol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_vectorised_ratio_and_gradient_equal_loop_reference(level):
    x = make_inputs(4, 14, seed=5, max_turns=4, empty_row=True)
    x["turn_ids"] = torch.where(x["loss_mask"], 3 - x["turn_ids"], -1)  # ids need not increase
    coef = torch.randn(4, 14, generator=torch.Generator().manual_seed(0))
    lp1 = x["log_probs"].clone().requires_grad_(True)
    lp2 = x["log_probs"].clone().requires_grad_(True)
    r_vec, _ = importance_ratio(lp1, x["old_log_probs"], x["loss_mask"], x["turn_ids"], level)
    r_loop = loop_ratio(lp2, x["old_log_probs"], x["loss_mask"], x["turn_ids"], level)
    assert torch.allclose(r_vec, r_loop, rtol=1e-5)
    (r_vec * coef).sum().backward()
    (r_loop * coef).sum().backward()
    assert torch.allclose(lp1.grad, lp2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_garbage_on_masked_positions_reaches_neither_ratio_nor_gradient(level):
    x = make_inputs(4, 12, seed=6)
    mask = x["loss_mask"]
    coef = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    grads, ratios = [], []
    for garbage in (False, True):
        lp = with_garbage(x["log_probs"], mask) if garbage else x["log_probs"].clone()
        old = with_garbage(x["old_log_probs"], mask, seed=2) if garbage else x["old_log_probs"]
        turns = torch.where(mask, x["turn_ids"], torch.randint(-1, 30, mask.shape)) if garbage \
            else x["turn_ids"]
        lp.requires_grad_(True)
        rho, _ = importance_ratio(lp, old, mask, turns, level)
        (torch.where(mask, rho, 0.0) * coef).sum().backward()
        ratios.append(torch.where(mask, rho, 0.0))
        grads.append(lp.grad)
    assert torch.isfinite(ratios[1]).all() and torch.isfinite(grads[1]).all()
    assert torch.equal(ratios[0], ratios[1])
    assert torch.equal(grads[0], grads[1])
    assert (grads[1][~mask] == 0).all()


@pytest.mark.parametrize("level", LEVELS)
def test_non_agent_positions_have_ratio_one_and_empty_rows_are_finite(level):
    x = make_inputs(3, 10, seed=7, empty_row=True)
    rho, delta = importance_ratio(x["log_probs"], x["old_log_probs"], x["loss_mask"],
                                  x["turn_ids"], level)
    assert torch.all(rho[~x["loss_mask"]] == 1.0)
    assert torch.all(delta[~x["loss_mask"]] == 0.0)
    assert torch.all(rho[-1] == 1.0)


def test_unknown_ratio_level_lists_valid_levels():
    x = make_inputs(2, 6)
    with pytest.raises(ValueError, match="token, turn, sequence"):
        importance_ratio(x["log_probs"], x["old_log_probs"], x["loss_mask"], x["turn_ids"], "word")
    assert tuple(RATIO_LEVELS) == LEVELS
