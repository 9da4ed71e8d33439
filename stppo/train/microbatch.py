"""The gradient of one minibatch's loss, accumulated over micro-batches (`trainer.micro_batch_size`
rows at a time, per rank): the same loss, gradient and metrics as the whole minibatch in one
forward, with the activations of one micro-batch alive at a time (docs/design.md §5.1).

Two ways, chosen by the loss (`LossSpec.separable`):

  shares      the loss is a sum over trajectories once its denominators are the minibatch's
              (D_tok, D_seq over ranks, `global_denoms`): each part backwards its own share.
              One forward + backward per part, as without micro-batches.
  linearised  a statistic of the whole minibatch enters every token's term (a batch λ of S-, ST-,
              SO-PPO; Clip-/KL-Cov's token selection; BAPO's bounds). The loss L is computed once
              on the minibatch's detached log-probs ℓ and entropies H (a no-grad forward per part),
              exactly as in the whole-minibatch update, giving g = ∂L/∂ℓ and h = ∂L/∂H (N, T); each
              part then backwards Σ g ℓ_θ + Σ h H_θ, so Σ_parts ∇θ = J_ℓᵀ g + J_Hᵀ h = ∇θ L (the
              chain rule). One extra no-grad forward per part. The `grad` estimator needs ‖C‖,
              C = ∇θ agg(κρA), before that: a first pass backwards each part's agg(κρA) into
              `.grad` instead (its forward also gives ℓ), ‖C‖ is read and `.grad` cleared.

Metrics come from one loss call on the concatenated detached log-probs: the whole minibatch's.
`trainer.exact_clip_bias_every`'s ‖C‖ sums each part's ∇θ agg(κρA) (`GradSum`) in the passes
that have the graph.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from stppo.algos import agg_denoms, clip_bias_grad_norm, value_loss
from stppo.algos.aggregation import weighted_sum
from stppo.algos.clip_bias import Reduce, grads_norm, term_grads
from stppo.batch import Batch
from stppo.models import policy_log_probs
from stppo.metric_names import CLIP_BIAS_GRAD_NORM, VF_LOSS
from stppo.train.actor_loss import actor_loss, clip_bias_of, grad_estimator, loss_clipped, share, whole
from stppo.train.context import UpdateContext
from stppo.train.distributed import Dist


Outputs = tuple[torch.Tensor, ...]


def split(mb: Batch, rows: int) -> list[Batch]:
    """Consecutive parts of `rows` rows (the last may be shorter)."""
    return [mb.select(slice(i, i + rows)) for i in range(0, len(mb), rows)]


def minibatch_denoms(loss_mask: torch.Tensor, d: Dist):
    """(D_tok, D_seq) of the whole minibatch: summed over ranks, or this process's own."""
    g = d.global_denoms(loss_mask)
    return g if g is not None else agg_denoms(loss_mask)


def backward_parts(parts: Sequence[Batch], forward: Callable[[Batch], Outputs],
                   objective: Callable[[int, Batch, Outputs], torch.Tensor],
                   ctx: UpdateContext) -> Outputs:
    """For each part k: outputs = forward(part) with graph, objective(k, part, outputs).backward()
    (gradients accumulate in `.grad`). Returns the detached outputs, concatenated over parts."""
    outs = []
    for k, part in enumerate(parts):
        with ctx.precision.autocast():
            out = forward(part)
            obj = objective(k, part, out)
        obj.backward()
        outs.append(tuple(x.detach() for x in out))
    return tuple(torch.cat(xs) for xs in zip(*outs))


class GradSum:
    """Σ over parts of ∇θ of one scalar term per part, kept apart from `.grad`; its norm."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.grads: list[Optional[torch.Tensor]] = [None] * len(params)

    def add(self, term: torch.Tensor) -> None:
        for i, g in enumerate(term_grads(term, self.params)):  # the graph stays for the loss
            if g is not None:
                self.grads[i] = g if self.grads[i] is None else self.grads[i].add_(g)

    def norm(self, reduce: Reduce) -> torch.Tensor:
        return grads_norm(self.grads, self.params, reduce)


# -- the actor -----------------------------------------------------------------------------------
def _forward(policy, ctx: UpdateContext, entropy: bool = True):
    """Part → (log-probs, entropies) (n, T), agent tokens only; the entropies carry a graph only
    when the loss has an entropy bonus."""
    def fn(mb: Batch) -> Outputs:
        out = policy_log_probs(policy, mb.input_ids, mb.attention_mask, positions=mb.loss_mask,
                               return_entropy=entropy, entropy_grad=bool(ctx.algo.entropy_coef))
        return out if entropy else (out,)
    return fn


def actor_backward(policy, mb: Batch, ctx: UpdateContext, params: list[torch.Tensor],
                   exact_bias: bool) -> tuple[torch.Tensor, dict]:
    """Accumulate ∇θ of minibatch `mb`'s actor loss in the parameters' `.grad` (none when that
    loss is not finite and `mb` is one part); return (loss, metrics) of the whole minibatch.
    `exact_bias`: also report ‖C‖ (`clip_bias/grad_norm`)."""
    parts = split(mb, ctx.micro_rows)
    if len(parts) == 1:
        return _actor_whole(policy, mb, ctx, params, exact_bias)
    denoms = minibatch_denoms(mb.loss_mask, ctx.dist)
    way = _actor_shares if ctx.algo.spec.separable else _actor_linearised
    return way(policy, mb, parts, denoms, ctx, params, exact_bias)


def whole_actor_loss(policy, mb: Batch, ctx: UpdateContext, params: list[torch.Tensor],
                     exact_bias: bool) -> tuple[torch.Tensor, dict]:
    """(loss with graph, metrics) of minibatch `mb` in one forward."""
    scope = whole(mb, ctx.dist)
    with ctx.precision.autocast():
        lp, ent = _forward(policy, ctx)(mb)
        loss, m, out = actor_loss(lp, ent, mb, ctx, scope, params)
        if exact_bias:  # exact ‖C‖ from the same forward graph
            term = clip_bias_of(lp, mb, ctx.algo.spec, scope.denoms, out.clipped)
            m[CLIP_BIAS_GRAD_NORM] = clip_bias_grad_norm(term, params, scope.reduce)
    return loss, m


def _actor_whole(policy, mb, ctx, params, exact_bias):
    loss, m = whole_actor_loss(policy, mb, ctx, params, exact_bias)
    if torch.isfinite(loss):
        loss.backward()
    return loss, m


def _actor_shares(policy, mb, parts, denoms, ctx, params, exact_bias):
    bias = GradSum(params) if exact_bias else None

    def objective(k: int, part: Batch, out: Outputs) -> torch.Tensor:
        loss, _, own = actor_loss(*out, part, ctx, share(denoms))
        if bias is not None:
            bias.add(clip_bias_of(out[0], part, ctx.algo.spec, denoms, own.clipped))
        return loss

    lp, ent = backward_parts(parts, _forward(policy, ctx), objective, ctx)
    with torch.no_grad(), ctx.precision.autocast():
        loss, m, _ = actor_loss(lp, ent, mb, ctx, whole(mb, ctx.dist))
    if bias is not None:
        m[CLIP_BIAS_GRAD_NORM] = bias.norm(ctx.dist.reduce)
    return loss, m


def _actor_linearised(policy, mb, parts, denoms, ctx, params, exact_bias):
    c_norm = None
    if grad_estimator(ctx.algo.spec):  # ‖C‖ of the minibatch first: C accumulates in .grad
        spec = ctx.algo.spec
        lp, ent = backward_parts(parts, _forward(policy, ctx), lambda k, part, out: clip_bias_of(
            out[0], part, spec, denoms, loss_clipped(out[0], part, spec, denoms), as_corrected=True), ctx)
        c_norm = grads_norm([p.grad for p in params], params, ctx.dist.reduce)
        for p in params:
            p.grad = None
    else:
        with torch.no_grad():
            lp, ent = (torch.cat(xs) for xs in zip(*(
                _no_grad_forward(policy, part, ctx) for part in parts)))
    leaves = (lp.requires_grad_(), ent.requires_grad_())
    with ctx.precision.autocast():
        loss, m, whole_out = actor_loss(*leaves, mb, ctx, whole(mb, ctx.dist, c_norm))
    g_lp, g_ent = (torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad
                   else (torch.zeros_like(lp), None))
    starts = [sum(len(p) for p in parts[:k]) for k in range(len(parts))]
    bias = GradSum(params) if exact_bias else None

    def objective(k: int, part: Batch, out: Outputs) -> torch.Tensor:
        rows = slice(starts[k], starts[k] + len(part))
        if bias is not None:  # κ of these rows, from the minibatch's loss call
            bias.add(clip_bias_of(out[0], part, ctx.algo.spec, denoms, whole_out.clipped[rows]))
        obj = weighted_sum(out[0], g_lp[rows])  # Σ g ℓ_θ
        return obj if g_ent is None else obj + weighted_sum(out[1], g_ent[rows])  # + Σ h H_θ

    backward_parts(parts, _forward(policy, ctx, entropy=g_ent is not None), objective, ctx)
    if bias is not None:
        m[CLIP_BIAS_GRAD_NORM] = bias.norm(ctx.dist.reduce)
    return loss.detach(), m


def _no_grad_forward(policy, part: Batch, ctx: UpdateContext) -> Outputs:
    with ctx.precision.autocast():
        return _forward(policy, ctx)(part)


# -- the critic ----------------------------------------------------------------------------------
def critic_backward(critic, mb: Batch, ctx: UpdateContext) -> tuple[torch.Tensor, dict]:
    """Accumulate ∇θ of minibatch `mb`'s value loss in `.grad`; return (loss, metrics). The value
    loss is a sum over tokens given its denominators: each part backwards its share."""
    algo, d = ctx.algo, ctx.dist

    def values(part: Batch) -> Outputs:
        return (critic.values(part.input_ids, part.attention_mask, positions=part.loss_mask),)

    def loss_of(v: torch.Tensor, part: Batch, denoms):
        return value_loss(v, part.values, part.returns, part.loss_mask, clip_range=algo.vf_clip,
                          global_denoms=denoms)

    parts = split(mb, ctx.micro_rows)
    if len(parts) == 1:
        with ctx.precision.autocast():
            (v,) = values(mb)
        loss, m = loss_of(v, mb, d.global_denoms(mb.loss_mask))
        if torch.isfinite(loss):
            loss.backward()
    else:
        denoms = minibatch_denoms(mb.loss_mask, d)
        (v,) = backward_parts(parts, values, lambda k, part, out: loss_of(*out, part, denoms)[0],
                              ctx)
        with torch.no_grad():
            loss, m = loss_of(v, mb, d.global_denoms(mb.loss_mask))
    m[VF_LOSS] = d.all_sum(m[VF_LOSS])  # this rank's share → the whole minibatch's
    return loss, m
