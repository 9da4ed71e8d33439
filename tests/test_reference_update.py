"""The reference actor update (`stppo.train.reference`, token PPO written top to bottom) is the
trainer's update: the same loss and the same gradients before every optimizer step, in float64,
over two epochs of two minibatches (the minibatch order from one generator seed)."""

from __future__ import annotations

import copy

import pytest
import torch

import stppo.train.update as update
from helpers.updates import tiny_policy, update_batch
from numerics import RecordingSGD, assert_close_to_scale
from stppo.config import AlgoConfig, TrainerConfig
from stppo.train.reference import ppo_actor_update
from stppo.train.update import UpdateContext, actor_update

RTOL = 1e-10  # float64: the trainer sums s = aρ + b as one dot product, the reference row by row


@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_the_reference_update_is_the_trainers(monkeypatch, clip_high):
    policy = tiny_policy()
    batch = update_batch(policy)
    twin = copy.deepcopy(policy)
    algo = AlgoConfig(name="ppo", clip_high=clip_high)
    trainer = TrainerConfig(questions_per_step=6, group_size=2, ppo_epochs=2, minibatch_size=6,
                            max_grad_norm=0.5)  # binds: clipping is part of the comparison
    losses = []
    real_apply = update._apply
    monkeypatch.setattr(update, "_apply", lambda loss, *a, **k: losses.append(float(loss))
                        or real_apply(loss, *a, **k))
    opt = RecordingSGD(policy.parameters(), lr=0.05)
    actor_update(policy, opt, batch, UpdateContext(algo, trainer, torch.Generator().manual_seed(3)))

    ref_opt = RecordingSGD(twin.parameters(), lr=0.05)
    ref_losses = ppo_actor_update(twin, ref_opt, batch, epochs=2, minibatch_size=6,
                                  generator=torch.Generator().manual_seed(3), clip_high=clip_high,
                                  max_grad_norm=0.5)
    assert len(losses) == len(ref_losses) == len(opt.grads) == len(ref_opt.grads) == 4
    for step, (got, want) in enumerate(zip(ref_losses, losses)):
        assert got == pytest.approx(want, rel=RTOL, abs=RTOL), f"loss of step {step}"
    for step, (got, want) in enumerate(zip(ref_opt.grads, opt.grads)):
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_to_scale(g, w, RTOL, f"step {step}, gradient {i}")
    # the comparison is not blind: the clip binds, the steps move the policy and differ
    norms = [float(torch.cat([g.reshape(-1) for g in step]).norm()) for step in opt.grads]
    assert all(n == pytest.approx(0.5, rel=1e-5) for n in norms), norms  # clip_grad_norm_: 0.5/(‖g‖ + 1e-6)
    assert not torch.equal(opt.grads[0][0], opt.grads[1][0])
    assert any(abs(a - b) > 1e-6 for a, b in zip(losses, losses[1:]))
