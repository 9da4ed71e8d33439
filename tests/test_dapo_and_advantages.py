"""RLOO and REINFORCE++ advantages, DAPO's group filter, overlong penalty and dynamic-sampling
refill (docs/design.md §2). Equality with verl: tests/verl/. The rollout correction's IS weights:
tests/test_algos_rollout_correction.py."""

from __future__ import annotations

import random

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import (compute_advantages, groups_with_signal, overlong_penalty,
                         reinforce_pp_advantages, rloo_advantages)
from stppo.batch import Batch
from stppo.config import DynamicSamplingConfig
from stppo.train.dapo import concat_batches, refill
from helpers.algos import make_inputs


# --- advantages ----------------------------------------------------------------------------------
def test_rloo_hand_computed_with_a_singleton_group():
    mask = torch.tensor([[True, True, False], [True, False, False], [False, True, True],
                         [True, True, True]])
    rewards = torch.zeros(4, 3)
    rewards[0, 1], rewards[1, 0], rewards[2, 2], rewards[3, 2] = 1.0, 0.0, 0.5, 2.0
    rewards[0, 2] = 99.0  # off agent tokens: ignored
    adv = rloo_advantages(rewards, torch.tensor([0, 0, 0, 7]), mask)
    # group 0: R = 1, 0, 0.5; A_i = R_i − mean of the others; group 7 (alone): A = R
    expect = [1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2.0]
    for i, a in enumerate(expect):
        assert torch.allclose(adv[i][mask[i]], torch.full((int(mask[i].sum()),), a))
    assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum())))


def test_reinforce_pp_is_the_whitened_discounted_return_skipping_observations():
    mask = torch.tensor([[True, False, True, True, False]])
    rewards = torch.tensor([[1.0, 50.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # agent tokens 0, 2, 3: G = 1 + .5·0 + .25·2 = 1.5, 0 + .5·2 = 1, 2 (the observation's 50 is
    # never summed)
    assert torch.allclose(ret, torch.tensor([[1.5, 0.0, 1.0, 2.0, 0.0]], dtype=torch.float64))
    g = torch.tensor([1.5, 1.0, 2.0], dtype=torch.float64)
    white = (g - g.mean()) / (g.var(unbiased=True) + 1e-8).sqrt()
    assert torch.allclose(adv[mask], white) and torch.equal(adv[~mask], torch.zeros(2).double())


def test_registry_dispatch_of_the_new_estimators():
    x = make_inputs(6, 8, seed=0)
    rewards = torch.zeros(6, 8)
    rewards[:, 3] = torch.arange(6.0)
    gids = torch.tensor([0, 0, 1, 1, 1, 2])
    adv, ret = compute_advantages("rloo", loss_mask=x["loss_mask"], rewards=rewards,
                                  group_ids=gids)
    assert torch.equal(adv, ret) and torch.equal(adv, rloo_advantages(rewards, gids, x["loss_mask"]))
    adv, ret = compute_advantages("reinforce_pp", loss_mask=x["loss_mask"], rewards=rewards,
                                  gamma=0.9)
    assert torch.allclose(adv, reinforce_pp_advantages(rewards, x["loss_mask"], 0.9)[0])
    with pytest.raises(ValueError, match="advantage='rloo' needs rewards"):
        compute_advantages("rloo", loss_mask=x["loss_mask"], group_ids=gids)


# --- DAPO: group filter and overlong penalty -----------------------------------------------------
def test_groups_with_signal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3])
    gids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert groups_with_signal(scores, gids).tolist() == [False, False, True, True, False, False,
                                                         True]  # all-1, mixed, all-0, alone


def test_overlong_penalty_is_dapo_eq_13():
    lengths = torch.tensor([10, 80, 90, 95, 100, 101])
    pen = overlong_penalty(lengths, max_len=100, buffer_len=20, penalty_factor=0.5)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.25, -0.375, -0.5, -0.5]))
    with pytest.raises(ValueError, match="buffer_len must be in"):
        overlong_penalty(lengths, max_len=100, buffer_len=0)


# --- DAPO: dynamic sampling with refill ---------------------------------------------------------
def fake_batch(scores: list[float], group_size: int, width: int, tag: float) -> Batch:
    """A rolled-out batch: groups of `group_size` rows, `width` tokens, scores as given;
    rollout_log_probs hold `tag` so that tests can tell which rollout a row came from."""
    n = len(scores)
    loss = torch.zeros(n, width, dtype=torch.bool)
    loss[:, 1:] = True
    return Batch(input_ids=torch.arange(n * width).reshape(n, width) % 7 + 1,
                 attention_mask=torch.ones(n, width, dtype=torch.bool), loss_mask=loss,
                 turn_ids=torch.where(loss, 0, -1),
                 group_ids=torch.arange(n) // group_size, scores=torch.tensor(scores),
                 rollout_log_probs=torch.full((n, width), tag),
                 num_turns=torch.ones(n, dtype=torch.long),
                 response_length=loss.sum(1), meta={"answers": [f"{tag}-{i}" for i in range(n)]})


class Roller:
    """roll(questions, round) for `refill`: scripted scores per round, recorded calls."""

    def __init__(self, per_round: list[list[float]], group_size: int):
        self.per_round, self.g, self.calls = per_round, group_size, []

    def __call__(self, questions, r):
        self.calls.append((len(questions), r))
        scores = self.per_round[r - 1][: len(questions)]
        return fake_batch(scores, self.g, width=3 + r, tag=float(r))


def test_refill_keeps_groups_with_signal_and_tops_the_batch_up():
    g = 2
    first = fake_batch([1, 1, 0, 1, 0, 0, 1, 0], g, width=4, tag=0.0)  # groups 1 and 3 have signal
    roller = Roller([[1, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 1, 1, 0, 1]], g)
    out, m = refill(first, roller, pool=list(range(20)), group_size=g,
                    ds=DynamicSamplingConfig(enabled=True, max_rounds=4, refill_factor=2.0),
                    rng=random.Random(0), pad_id=0)
    # need 4 groups; 2 kept; round 1: ⌈2·2⌉ = 4 questions → 1 kept; round 2: ⌈1·2⌉ = 2 → 2 kept
    assert roller.calls == [(8, 1), (4, 2)]
    assert len(out) == 8 and out.input_ids.shape[1] == 5  # padded to the widest rollout
    assert groups_with_signal(out.scores, out.group_ids).all()
    assert len(set(out.group_ids.tolist())) == 4
    assert out.rollout_log_probs[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2]  # surplus discarded
    assert not out.attention_mask[:4, 4].any() and not out.loss_mask[:4, 4].any()
    assert (out.turn_ids[:4, 4] == -1).all() and out.meta["answers"][4] == "1.0-2"
    assert m == {K.DS_ROLLOUTS: 3.0, K.DS_GROUPS_ROLLED: 10.0, K.DS_GROUPS_DROPPED: 5.0,
                 K.DS_GROUPS_FILLED: 0.0}


def test_refill_fills_with_dropped_groups_when_the_rounds_run_out():
    g = 2
    first = fake_batch([1, 1, 0, 1, 0, 0], g, width=4, tag=0.0)
    roller = Roller([[1, 1] * 4], g)
    out, m = refill(first, roller, pool=list(range(20)), group_size=g,
                    ds=DynamicSamplingConfig(enabled=True, max_rounds=1), rng=random.Random(0),
                    pad_id=0)
    assert len(out) == 6 and len(set(out.group_ids.tolist())) == 3
    assert groups_with_signal(out.scores, out.group_ids).tolist() == [True, True, False, False,
                                                                      False, False]
    assert m[K.DS_GROUPS_FILLED] == 2.0 and m[K.DS_ROLLOUTS] == 2.0


def test_refill_with_nothing_to_drop_rolls_out_nothing():
    first = fake_batch([1, 0, 0, 1], 2, width=4, tag=0.0)
    roller = Roller([], 2)
    out, m = refill(first, roller, pool=list(range(5)), group_size=2,
                    ds=DynamicSamplingConfig(enabled=True), rng=random.Random(0), pad_id=0)
    assert roller.calls == [] and torch.equal(out.scores, first.scores)
    assert m[K.DS_ROLLOUTS] == 1.0 and m[K.DS_GROUPS_DROPPED] == 0.0


def test_concat_batches_refuses_fields_set_in_some_parts_only():
    a = fake_batch([1, 0], 2, 3, 0.0)
    b = fake_batch([1, 0], 2, 3, 1.0)
    b.rollout_log_probs = None
    with pytest.raises(ValueError, match="rollout_log_probs is set in some parts only"):
        concat_batches([a, b], pad_id=0)
