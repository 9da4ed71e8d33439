"""The PPO update: `ppo_epochs` × minibatches of the preset's policy loss, then the critic.

A non-finite loss or gradient skips that optimizer step (counted, never applied). Forwards run
under the run's precision (autocast; heads in float32), backward and the optimizer step on the
float32 master weights. When the update is provably on-policy (`old_log_probs_from_update`), the
batch arrives without old log-probs and the minibatch's own detached log-probs stand in for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stppo.algos import (agg_loss, agg_weights, clip_bias_grad_norm, clip_bias_term, clipped_surrogate,
                         explained_variance, importance_ratio, kl_loss, policy_loss,
                         sampler_mismatch, turn_breakdown, value_loss)
from stppo.batch import Batch
from stppo.config import AlgoConfig, Config, TrainerConfig
from stppo.models import Precision, policy_log_probs
from stppo.tracking import (CLIP_BIAS_GRAD_NORM, CRITIC_GRAD_NORM, ENTROPY, GRAD_NORM,
                            GRAD_NORM_MAX, LR, PG_LOSS, SKIPPED_STEPS, VF_EXPLAINED_VAR, VF_LOSS)
from stppo.train.baselines import loss_extras
from stppo.train.distributed import Dist
from stppo.train.metrics import MetricAccumulator


@dataclass
class UpdateContext:
    """What the update needs besides the batch; `opt_steps` counts optimizer steps over the run
    (it schedules the exact clip-bias diagnostic)."""
    algo: AlgoConfig
    trainer: TrainerConfig
    generator: torch.Generator
    opt_steps: int = 0
    nan_at_first_minibatch: bool = False  # fault injection for tests (trainer.debug_nan_steps)
    dist: Dist = Dist()  # data parallelism (stppo.train.distributed); one process by default
    precision: Precision = Precision()  # autocast for the forwards (stppo.models.precision)
    max_turns: int = 0  # > 0: log the per-turn breakdown of turns 0..max_turns-1

    @property
    def minibatch_rows(self) -> int:
        """Rows of this rank's share of one global minibatch of `trainer.minibatch_size`."""
        return self.trainer.minibatch_size // self.dist.world


def old_log_probs_from_update(cfg: Config) -> bool:
    """True when the update is provably on-policy, so π_old = π_θ at its only forward and the
    old log-probs are that forward's detached log-probs (identical numbers): one epoch, one
    minibatch holding the whole rollout batch, nothing before the update that reads the old
    log-probs (the KL penalty in the reward does), and no rollout correction that compares them
    with the sampler's (TIS)."""
    tr, algo = cfg.trainer, cfg.algo
    one_minibatch = tr.minibatch_size >= tr.questions_per_step * tr.group_size
    kl_reads_old = algo.kl.coef > 0 and algo.kl.in_reward
    corrects_rollout = algo.rollout_is.kind != "none"
    return tr.ppo_epochs == 1 and one_minibatch and not kl_reads_old and not corrects_rollout


def minibatches(n: int, size: int, epochs: int, generator: torch.Generator):
    """Yield index tensors: `epochs` shuffled passes over n rows in chunks of `size`."""
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n, size):
            yield perm[i:i + size]


def _correction(algo: AlgoConfig):
    c = algo.correction
    return None if c.kind == "none" else c


def _actor_loss(policy, mb: Batch, ctx: UpdateContext) -> tuple[torch.Tensor, dict]:
    algo, d = ctx.algo, ctx.dist
    params = [p for p in policy.parameters() if p.requires_grad]
    denoms = d.global_denoms(mb.loss_mask)  # None for one process: this minibatch's own
    lp, ent = policy_log_probs(policy, mb.input_ids, mb.attention_mask, return_entropy=True,
                               positions=mb.loss_mask)  # (n, T) each, agent tokens only
    old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()  # on-policy: π_old = π_θ
    corr = _correction(algo)
    extra = loss_extras(algo, mb, old)  # baselines: loss_mode, options, TIS weights
    loss, m = policy_loss(lp, old, mb.advantages, mb.loss_mask, mb.turn_ids,
                          ratio_level=algo.ratio_level, clip_low=algo.clip_low,
                          clip_high=algo.clip_high, loss_agg=algo.loss_agg, correction=corr,
                          dual_clip=algo.dual_clip, global_denoms=denoms, reduce=d.reduce,
                          params=params if corr is not None and corr.estimator == "grad" else None,
                          **extra)
    m[PG_LOSS] = d.all_sum(m[PG_LOSS])  # this rank's share of the minibatch's loss → the whole
    m.update(_diagnostics(lp, ent, old, mb, ctx))
    every = ctx.trainer.exact_clip_bias_every
    if every and ctx.opt_steps % every == 0:  # exact ‖C‖ from the same forward graph
        ratio, adv, clipped = _ratio_clipped(lp, old, mb, algo)
        w = agg_weights(mb.loss_mask, algo.loss_agg, denoms, ratio.dtype)
        term = clip_bias_term(ratio, adv, clipped, mb.loss_mask, algo.loss_agg, weights=w)
        m[CLIP_BIAS_GRAD_NORM] = clip_bias_grad_norm(term, params, d.reduce)
    entropy = agg_loss(ent, mb.loss_mask, algo.loss_agg, denoms)
    m[ENTROPY] = d.all_sum(entropy.detach())
    if algo.kl.coef > 0 and not algo.kl.in_reward and mb.ref_log_probs is not None:
        kl, km = kl_loss(lp, mb.ref_log_probs, mb.loss_mask, kind=algo.kl.estimator,
                         loss_agg=algo.loss_agg, global_denoms=denoms)
        loss = loss + algo.kl.coef * kl
        m.update({k: d.all_sum(v) for k, v in km.items()})
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * entropy
    return loss, m


def _ratio_clipped(lp: torch.Tensor, old: torch.Tensor, mb: Batch, algo: AlgoConfig):
    """(ρ at the preset's ratio level (with lp's graph), masked A, κ the clip-bound indicator)."""
    ratio, _ = importance_ratio(lp, old, mb.loss_mask, mb.turn_ids, algo.ratio_level)
    adv = torch.where(mb.loss_mask, mb.advantages, 0.0)
    clipped = clipped_surrogate(ratio, adv, algo.clip_low, algo.clip_high, algo.dual_clip).clipped
    return ratio, adv, clipped


def _diagnostics(lp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor, mb: Batch,
                 ctx: UpdateContext) -> dict[str, torch.Tensor]:
    """The minibatch's per-turn breakdown and sampler-vs-trainer mismatch (DESIGN.md §4)."""
    m: dict[str, torch.Tensor] = {}
    if ctx.max_turns:
        with torch.no_grad():
            ratio, _, clipped = _ratio_clipped(lp.detach(), old, mb, ctx.algo)
        m.update(turn_breakdown(ratio, lp, old, mb.advantages, ent, clipped, mb.loss_mask,
                                mb.turn_ids, ctx.max_turns))
    if mb.rollout_log_probs is not None:
        m.update(sampler_mismatch(old, mb.rollout_log_probs, mb.loss_mask,
                                  ctx.algo.rollout_is.threshold))
    return m


def _step(loss: torch.Tensor, params: list, optimizer, max_norm: float,
          d: Dist = Dist()) -> tuple[torch.Tensor, bool]:
    """Backward, (sum gradients over ranks,) clip, step. Returns (pre-clip grad norm, applied?).
    A non-finite loss on any rank skips the step on every rank."""
    optimizer.zero_grad(set_to_none=True)
    bad = not bool(torch.isfinite(loss))
    if not bad:
        loss.backward()
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
        with ctx.precision.autocast():
            loss, m = _actor_loss(policy, batch.select(idx), ctx)
        if i == 0 and ctx.nan_at_first_minibatch:
            loss = loss * float("nan")
        norm, applied = _step(loss, params, optimizer, tr.max_grad_norm, ctx.dist)
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
        mb = batch.select(idx)
        with ctx.precision.autocast():
            v = critic.values(mb.input_ids, mb.attention_mask, positions=mb.loss_mask)
        denoms = ctx.dist.global_denoms(mb.loss_mask)
        loss, m = value_loss(v, mb.values, mb.returns, mb.loss_mask, clip_range=ctx.algo.vf_clip,
                             global_denoms=denoms)
        m[VF_LOSS] = ctx.dist.all_sum(m[VF_LOSS])  # this rank's share → the whole minibatch's
        norm, _ = _step(loss, params, optimizer, tr.max_grad_norm, ctx.dist)
        m[CRITIC_GRAD_NORM] = norm
        acc.add(m)
    out = acc.reduce()
    out[VF_EXPLAINED_VAR] = float(explained_variance(batch.values, batch.returns, batch.loss_mask))
    return out

