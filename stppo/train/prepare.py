"""From a rollout to a training batch: π_old / π_ref log-probs, values, rewards, advantages.

    rollout (π_old) → old_log_probs, ref_log_probs, values → rewards (+ KL if in reward)
                    → rollout correction (decoupled mode) → advantages and returns of the preset

The rollout correction (`algo.rollout_correction`, `stppo.train.rollout_corr`) acts here in
decoupled mode, as verl's does before its advantages: the rejected tokens leave the loss mask and
the IS weights join the batch. In bypass mode π_old is the sampler's π_rollout (no forward).

Every forward computes the agent tokens only (the LM and value heads run on those positions)
under the run's precision (autocast). When the update is provably on-policy (`skip_old`: see
`stppo.train.update.old_log_probs_from_update`) the old log-probs are not computed here: the
update takes the detached log-probs of its own forward, the same numbers, one forward less.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from stppo.algos import compute_advantages, kl_in_reward
from stppo.batch import Batch
from stppo.config import AlgoConfig
from stppo.models import Precision, policy_log_probs
from stppo.train.rollout_corr import Gather, sampler_log_probs, step_correction
from stppo.metric_names import (ADV_MAX, ADV_MEAN, ADV_MIN, ADV_STD, RETURNS_MEAN, VALUES_MEAN)


FORWARD_CHUNK = 64  # rows per no-grad forward, unless trainer.micro_batch_size says otherwise


@torch.no_grad()
def forward_in_chunks(fn, batch: Batch, chunk: int) -> torch.Tensor:
    """fn(input_ids, attention_mask, positions) → (n, T) over row chunks of the batch,
    concatenated; `positions` is the chunk's loss mask (the agent tokens)."""
    outs = [fn(batch.input_ids[i:i + chunk], batch.attention_mask[i:i + chunk],
               batch.loss_mask[i:i + chunk]) for i in range(0, len(batch), chunk)]
    return torch.cat(outs, dim=0)


def _log_probs(model):
    return lambda ids, mask, pos: policy_log_probs(model, ids, mask, positions=pos)


def outcome_rewards(batch: Batch) -> torch.Tensor:
    """(N, T): the trajectory's score at its last agent token, 0 elsewhere (docs/design.md §1)."""
    n, t = batch.input_ids.shape
    pos = torch.arange(t, device=batch.input_ids.device).expand(n, t)  # (N, T)
    last = torch.where(batch.loss_mask, pos, -1).max(dim=1).values  # (N,) -1: no agent token
    rewards = torch.zeros(n, t, dtype=torch.float32, device=batch.input_ids.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = batch.scores[rows].float()
    return rewards


def masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float, float]:
    v = x[mask]
    if v.numel() == 0:
        return 0.0, 0.0, 0.0, 0.0
    return float(v.mean()), float(v.std(unbiased=False)), float(v.max()), float(v.min())


@torch.no_grad()
def prepare_batch(batch: Batch, policy, critic, ref, algo: AlgoConfig, *,
                  chunk: int = FORWARD_CHUNK, reduce=None, precision: Precision = Precision(),
                  skip_old: bool = False, gather: Gather = None) -> tuple[Batch, dict[str, float]]:
    """Fill old/ref log-probs, values, rewards, advantages and returns; return advantage stats
    (and the decoupled rollout correction's metrics). `chunk`: rows per forward (the run's
    `trainer.micro_batch_size` when set). `reduce` (data parallelism: an all-reduce sum over
    ranks) makes advantage whitening global, `gather` (`Dist.gather_rows`) the rollout
    correction's statistics. `skip_old`: leave old_log_probs None for the update to fill (an
    on-policy update)."""
    rc = algo.spec.rollout_correction
    with precision.autocast():
        old = None
        if rc.bypass_mode:  # π_old := π_rollout
            old = sampler_log_probs(batch, rc)
        elif not skip_old:
            was_training = policy.training
            policy.eval()
            old = forward_in_chunks(_log_probs(policy), batch, chunk)
            policy.train(was_training)
        ref_lp = forward_in_chunks(_log_probs(ref), batch, chunk) if ref is not None else None
        values = (forward_in_chunks(lambda i, m, p: critic.values(i, m, positions=p), batch, chunk)
                  if critic is not None else None)

    metrics: dict[str, float] = {}
    rewards = outcome_rewards(batch)
    if ref_lp is not None and algo.kl.in_reward and algo.kl.coef > 0:
        if old is None:
            raise ValueError("the KL penalty in the reward needs the old log-probs: skip_old=False")
        rewards, kl_m = kl_in_reward(rewards, old, ref_lp, batch.loss_mask,
                                     beta=algo.kl.coef, kind=algo.kl.estimator)
        metrics.update({k: float(v) for k, v in kl_m.items()})
    if rc.decoupled:
        if old is None:
            raise ValueError("a decoupled rollout correction needs the old log-probs: skip_old=False")
        batch, corr_m = step_correction(batch, old, rc, gather)
        metrics.update(corr_m)
    adv, ret = compute_advantages(
        algo.advantage, loss_mask=batch.loss_mask, turn_ids=batch.turn_ids, rewards=rewards,
        values=values, scores=batch.scores.float(), group_ids=batch.group_ids, gamma=algo.gamma,
        gae_lambda=algo.gae_lambda, eps=algo.grpo_eps, whiten=algo.whiten_advantages, reduce=reduce)
    mean, std, mx, mn = masked_stats(adv, batch.loss_mask)
    metrics.update({ADV_MEAN: mean, ADV_STD: std, ADV_MAX: mx, ADV_MIN: mn,
                    RETURNS_MEAN: masked_stats(ret, batch.loss_mask)[0]})
    if values is not None:
        metrics[VALUES_MEAN] = masked_stats(values, batch.loss_mask)[0]
    out = replace(batch, old_log_probs=old, ref_log_probs=ref_lp, values=values, rewards=rewards,
                  advantages=adv, returns=ret)
    return out, metrics
