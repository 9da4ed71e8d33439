"""The PPO update: `ppo_epochs` × minibatches of the preset's policy loss, then the critic.

Per minibatch: the gradient of its loss (`stppo.train.microbatch`: one forward and backward, or
`trainer.micro_batch_size` rows at a time with the same loss and gradient; the loss itself is
`stppo.train.actor_loss`), then one optimizer step. A non-finite loss or gradient skips that step
(counted, never applied). Forwards run under the run's precision (autocast; heads in float32),
backward and the optimizer step on the float32 master weights. When the update is provably
on-policy (`old_log_probs_from_update`), the batch arrives without old log-probs and the
minibatch's own detached log-probs stand in for them.
"""

from __future__ import annotations

import torch

from stppo.algos import explained_variance
from stppo.algos.advantages import OLD_POLICY_ESTIMATORS
from stppo.batch import Batch
from stppo.config import Config
from stppo.metric_names import (CRITIC_GRAD_NORM, GRAD_NORM, GRAD_NORM_MAX, LR, SKIPPED_STEPS,
                            VF_EXPLAINED_VAR)
from stppo.train.context import UpdateContext
from stppo.train.distributed import Dist
from stppo.train.metrics import MetricAccumulator
from stppo.train.microbatch import actor_backward, critic_backward, whole_actor_loss
from stppo.train.offpolicy import sampler_class
from stppo.train.rollout_corr import correction_for


def old_log_probs_from_update(cfg: Config) -> bool:
    """True when the update is provably on-policy, so π_old = π_θ at its only forward and the
    old log-probs are that forward's detached log-probs (identical numbers): one epoch, one
    minibatch holding the whole rollout batch, nothing before the update that reads the old
    log-probs (the KL penalty in the reward does; so does `offpolicy/kl_to_current` of stale
    rollouts: the sampler is not `on_policy`; so does the optimal token baseline, which reads the old
    forward's Σπ² too), and a rollout correction that needs none: a decoupled one compares the
    recomputed π_old with the sampler's before the update, bypass mode takes the sampler's as
    π_old (`stppo.train.rollout_corr`)."""
    tr, algo = cfg.trainer, cfg.algo
    one_minibatch = tr.minibatch_size >= tr.questions_per_step * tr.group_size
    kl_reads_old = algo.kl.coef > 0 and algo.kl.in_reward
    advantage_reads_old = algo.advantage in OLD_POLICY_ESTIMATORS
    own_old = correction_for(algo.spec.rollout_correction).update_may_own_old
    return (tr.ppo_epochs == 1 and one_minibatch and not kl_reads_old and not advantage_reads_old
            and own_old and sampler_class(tr.offpolicy).on_policy)


def minibatches(n: int, size: int, epochs: int, generator: torch.Generator):
    """Yield index tensors: `epochs` shuffled passes over n rows in chunks of `size`."""
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n, size):
            yield perm[i:i + size]


def _exact_bias_due(ctx: UpdateContext) -> bool:
    """Whether this optimizer step reports the exact ‖C‖ (`trainer.exact_clip_bias_every`)."""
    every = ctx.trainer.exact_clip_bias_every
    return bool(every) and ctx.opt_steps % every == 0


def _actor_loss(policy, mb: Batch, ctx: UpdateContext) -> tuple[torch.Tensor, dict]:
    """The actor loss of minibatch `mb` in one forward, with its graph, and the metrics."""
    params = [p for p in policy.parameters() if p.requires_grad]
    return whole_actor_loss(policy, mb, ctx, params, _exact_bias_due(ctx))


def _apply(loss: torch.Tensor, params: list, optimizer, max_norm: float,
           d: Dist = Dist()) -> tuple[torch.Tensor, bool]:
    """(Sum the accumulated gradients over ranks,) clip, step. Returns (pre-clip grad norm,
    applied?). A non-finite loss on any rank skips the step on every rank."""
    bad = not bool(torch.isfinite(loss))
    if d.sync_grads(params, bad):
        optimizer.zero_grad(set_to_none=True)
        return torch.tensor(float("nan")), False
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    return norm, True


def actor_update(policy, optimizer, batch: Batch, ctx: UpdateContext) -> dict[str, float]:
    tr = ctx.trainer
    params = [p for p in policy.parameters() if p.requires_grad]
    acc, skipped = MetricAccumulator(), 0
    policy.train()
    if batch.old_log_probs is None and (tr.ppo_epochs > 1 or len(batch) > ctx.minibatch_rows):
        raise ValueError("the batch has no old log-probs, but the update is not on-policy "
                         f"({tr.ppo_epochs} epochs, {len(batch)} rows in minibatches of "
                         f"{ctx.minibatch_rows})")
    for i, idx in enumerate(minibatches(len(batch), ctx.minibatch_rows, tr.ppo_epochs, ctx.generator)):
        optimizer.zero_grad(set_to_none=True)
        loss, m = actor_backward(policy, batch.select(idx), ctx, params, _exact_bias_due(ctx))
        if i == 0 and ctx.nan_at_first_minibatch:
            loss = loss * float("nan")
        norm, applied = _apply(loss, params, optimizer, tr.max_grad_norm, ctx.dist)
        skipped += not applied
        ctx.opt_steps += 1
        m[GRAD_NORM] = m[GRAD_NORM_MAX] = norm
        acc.add(m)
    out = acc.reduce()
    out[SKIPPED_STEPS] = float(skipped)
    out[LR] = optimizer.param_groups[0]["lr"]
    return out


def critic_update(critic, optimizer, batch: Batch, ctx: UpdateContext) -> dict[str, float]:
    tr = ctx.trainer
    params = [p for p in critic.parameters() if p.requires_grad]
    acc = MetricAccumulator()
    critic.train()
    for idx in minibatches(len(batch), ctx.minibatch_rows, tr.ppo_epochs, ctx.generator):
        optimizer.zero_grad(set_to_none=True)
        loss, m = critic_backward(critic, batch.select(idx), ctx)
        norm, _ = _apply(loss, params, optimizer, tr.max_grad_norm, ctx.dist)
        m[CRITIC_GRAD_NORM] = norm
        acc.add(m)
    out = acc.reduce()
    out[VF_EXPLAINED_VAR] = float(explained_variance(batch.values, batch.returns, batch.loss_mask))
    return out

