"""Clipping bias: diagnostics and the clip-bias scale of S-PPO / ST-PPO / SO-PPO (docs/design.md §2).

The PPO gradient is the unclipped importance-sampling gradient minus the contribution of the
clipped tokens, C = ∇_θ agg(κ ρ A) (ST-PPO, arXiv 2511.20718 v1, §4). Diagnostics:
    clip_bias/norm     = sqrt(agg(κ (ρA)²))          token-space magnitude, free (Fig. 3d)
    actor/pg_loss_norm = sqrt(agg(s²))               the same for the surrogate (Fig. 3c)
    clip_bias/grad_norm = ‖C‖₂                       exact, one more backward over the same graph

The clip-bias scale (`algo.clip_bias`, `LossSpec.clip_bias`) multiplies the policy loss by a
detached λ, by its kind:
    none            λ = 1
    clip_bias_norm  λ = 1 / max(1, ‖C‖/τ)   (S-PPO, ST-PPO); ‖C‖ from the `token` estimator
                    (clip_bias/norm) or the `grad` estimator (exact ‖∇θ agg(κρA)‖₂); granularity
                    `batch` (one λ) or `sequence`: λ_i from ‖C_i‖ = sqrt(mean_{t∈i} κ(ρA)²) and
                    loss = agg(λ_i s_{i,t})
    clip_triggered  r = RMS(ρA | κ) / (RMS(ρA | ¬κ) + 1e-8), token-weighted over the agent tokens
                    (r = 0 when nothing is clipped); λ = 1/r if r > τ else 1   (SO-PPO, SO-GRPO)
Norms and λ use this call's own denominators (a per-minibatch / per-micro-batch quantity), or,
under data parallelism, the global ones: `policy_loss(..., global_denoms=..., reduce=all_reduce_sum)`
sums the partial norms (and for the `grad` estimator the partial gradients) over the shards, so
every shard computes the λ of the whole batch. A caller that computes ‖C‖ itself (the trainer's
micro-batches, whose parameter gradients no single call sees) passes it as
`clip_bias_grad_norm`.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, NamedTuple, Optional

import torch

from stppo.algos.aggregation import agg_weights, weighted_sum
from stppo.registry import Registry
from stppo.metric_names import CLIP_BIAS_GRAD_NORM

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]  # all-reduce sum over shards, or None
ESTIMATORS = ("token", "grad")
GRANULARITIES = ("batch", "sequence")
RMS_EPS = 1e-8


# --- diagnostics ---------------------------------------------------------------------------------
# `weights` (N, T) are `agg_weights(loss_mask, loss_agg)`; pass them to reuse one set per call.
def _w(weights: Optional[torch.Tensor], loss_mask: torch.Tensor, loss_agg: str,
       like: torch.Tensor) -> torch.Tensor:
    return weights if weights is not None else agg_weights(loss_mask, loss_agg, dtype=like.dtype)


def clip_bias_sq(ratio: torch.Tensor, advantages: torch.Tensor,
                 clipped: torch.Tensor) -> torch.Tensor:
    """κ (ρA)², detached; 0 off clipped tokens. (N, T)"""
    with torch.no_grad():
        return torch.where(clipped, (ratio * advantages).square(), 0.0)


def clip_bias_norm(ratio: torch.Tensor, advantages: torch.Tensor, clipped: torch.Tensor,
                   loss_mask: torch.Tensor, loss_agg: str, *,
                   weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """clip_bias/norm = sqrt(agg(κ (ρA)²)); detached 0-d tensor."""
    with torch.no_grad():
        sq = clip_bias_sq(ratio, advantages, clipped)
        return weighted_sum(sq, _w(weights, loss_mask, loss_agg, sq)).sqrt()


def pg_loss_norm(surrogate: torch.Tensor, loss_mask: torch.Tensor, loss_agg: str, *,
                 weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """actor/pg_loss_norm = sqrt(agg(s²)); detached 0-d tensor."""
    with torch.no_grad():
        s = torch.where(loss_mask, surrogate, 0.0)
        return weighted_sum(s.square(), _w(weights, loss_mask, loss_agg, s)).sqrt()


def clip_bias_term(ratio: torch.Tensor, advantages: torch.Tensor, clipped: torch.Tensor,
                   loss_mask: torch.Tensor, loss_agg: str, *,
                   weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """agg(κ ρ A), differentiable in ρ: its gradient is the clipping bias C."""
    adv = torch.where(clipped, advantages.detach(), 0.0).to(ratio.dtype)  # (N, T)
    return weighted_sum(ratio * adv, _w(weights, loss_mask, loss_agg, ratio))


def clip_bias_grad_norm(clip_bias_term: torch.Tensor, params: Iterable[torch.Tensor],
                        reduce: Reduce = None) -> torch.Tensor:
    """‖∇_θ clip_bias_term‖₂ over `params`, from the same forward graph (retain_graph=True).

    One extra backward pass, no second forward; the graph stays usable for the loss's backward.
    Parameters the term does not depend on contribute 0. With `reduce` (data parallelism, the
    term built with global weights) the shards' gradients are summed before the norm: every shard
    gets ‖C‖ of the whole batch. Detached 0-d tensor: float32, float64 when the gradients are.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return torch.zeros((), device=clip_bias_term.device)
    return grads_norm(term_grads(clip_bias_term, params), params, reduce)


def term_grads(term: torch.Tensor, params: list[torch.Tensor], *,
               retain_graph: bool = True) -> list[Optional[torch.Tensor]]:
    """∇_θ term for each of `params` (None where the term does not depend on it), by
    `torch.autograd.grad`: the parameters' `.grad` are left alone."""
    if not term.requires_grad:
        return [None] * len(params)
    return list(torch.autograd.grad(term, params, retain_graph=retain_graph, allow_unused=True))


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or in its own dtype when that is wider (float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def grads_norm(grads: list[Optional[torch.Tensor]], params: list[torch.Tensor],
               reduce: Reduce = None) -> torch.Tensor:
    """‖(g_1, …, g_n)‖₂ (None = 0), the per-parameter gradients summed over the shards first when
    `reduce` is given (every shard joins the collective, even one with nothing clipped).
    Detached 0-d: float32, float64 when the gradients are (low-precision ones are summed in
    float32)."""
    device = params[0].device if params else torch.device("cpu")
    if reduce is not None and params:
        flat = torch.cat([at_least_fp32((torch.zeros_like(p) if g is None else g.detach()).reshape(-1))
                          for p, g in zip(params, grads)])
        return reduce(flat).square().sum().sqrt()
    sq = [at_least_fp32(g.detach()).square().sum() for g in grads if g is not None]
    if not sq:
        return torch.zeros((), device=device)
    return torch.stack(sq).sum().sqrt()


def sequence_clip_bias_norm(bias_sq: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """‖C_i‖ = sqrt(mean over trajectory i's agent tokens of κ(ρA)²). (N,)"""
    length = loss_mask.sum(dim=1).clamp(min=1).to(bias_sq.dtype)  # (N,)
    return (bias_sq.sum(dim=1) / length).sqrt()


def clip_rms_sums(ratio: torch.Tensor, advantages: torch.Tensor, clipped: torch.Tensor,
                  loss_mask: torch.Tensor) -> torch.Tensor:
    """(Σ κ(ρA)², Σ (ρA)², #κ, #agent tokens) over agent tokens, detached (4,): what
    `clip_triggered_ratio` needs, summable over shards."""
    with torch.no_grad():
        sq = torch.where(loss_mask, (ratio * advantages).square(), 0.0)  # (N, T)
        clipped = clipped & loss_mask
        return torch.stack([torch.where(clipped, sq, 0.0).sum(), sq.sum(),
                            clipped.sum().to(sq.dtype), loss_mask.sum().to(sq.dtype)])


def rms_ratio(sums: torch.Tensor, reduce: Reduce = None) -> torch.Tensor:
    """r = RMS(ρA | κ) / (RMS(ρA | ¬κ) + 1e-8) from `clip_rms_sums` (summed over the shards with
    `reduce`); 0 if nothing is clipped. Detached 0-d."""
    with torch.no_grad():
        if reduce is not None:
            sums = reduce(sums)
        sq_c, sq_all, n_c, n = sums.unbind()
        n_u = n - n_c
        rms_c = (sq_c / n_c.clamp(min=1)).sqrt()
        rms_u = ((sq_all - sq_c).clamp(min=0.0) / n_u.clamp(min=1)).sqrt()
        return rms_c / (rms_u + RMS_EPS)


def clip_triggered_ratio(ratio: torch.Tensor, advantages: torch.Tensor, clipped: torch.Tensor,
                         loss_mask: torch.Tensor, reduce: Reduce = None) -> torch.Tensor:
    """r = RMS(ρA | κ) / (RMS(ρA | ¬κ) + 1e-8) over agent tokens (0 if none is clipped); with
    `reduce`, over the agent tokens of every shard. Detached 0-d."""
    return rms_ratio(clip_rms_sums(ratio, advantages, clipped, loss_mask), reduce)


# --- the clip-bias scale: its spec -----------------------------------------------------------------------------
@dataclass
class ClipContext:
    """What a clip-bias scale may look at; built once per `policy_loss` call, token by token
    (`stppo.algos.loss`) or from turn statistics (`stppo.algos.turn_clip`)."""

    bias_norm: torch.Tensor  # 0-d detached clip_bias/norm (of the whole batch under `reduce`)
    bias_rows: torch.Tensor  # (N,) detached Σ_{t∈i} κ(ρA)² per trajectory
    lengths: torch.Tensor  # (N,) agent tokens per trajectory
    rms_sums: Callable[[], torch.Tensor]  # → this shard's `clip_rms_sums` (4,), on demand
    bias_term: Callable[[], torch.Tensor]  # → agg(κρA) with graph (its gradient is C), on demand
    params: Optional[list[torch.Tensor]] = None
    reduce: Reduce = None  # all-reduce sum over data-parallel shards
    grad_norm: Optional[torch.Tensor] = None  # the `grad` estimator's ‖C‖, computed by the caller


class ClipBiasKind(NamedTuple):
    """`apply(ctx, spec) -> (λ, extra metrics)`: λ detached, 0-d (batch) or (N,) (sequence)."""

    apply: Callable[[ClipContext, "ClipBias"], tuple[torch.Tensor, dict]]
    default_tau: Optional[float]
    estimators: tuple[str, ...]
    granularities: tuple[str, ...]


CLIP_BIAS_KINDS: Registry[ClipBiasKind] = Registry("clip_bias.kind")


@dataclass(frozen=True)
class ClipBias:
    """A validated clip-bias scale: kind ∈ CLIP_BIAS_KINDS, τ > 0 (kind's default if None)."""

    kind: str = "none"
    tau: Optional[float] = None
    estimator: str = "token"
    granularity: str = "batch"

    def __post_init__(self) -> None:
        k = CLIP_BIAS_KINDS[self.kind]
        if self.tau is None:
            object.__setattr__(self, "tau", k.default_tau)
        number = isinstance(self.tau, numbers.Real) and not isinstance(self.tau, bool)
        if self.tau is not None and not (number and self.tau > 0):
            raise ValueError(f"clip_bias.tau must be a number > 0, got {self.tau!r}")
        if self.estimator not in k.estimators:
            raise ValueError(f"clip_bias.estimator={self.estimator!r} is not valid for kind "
                             f"{self.kind!r}; allowed: {', '.join(k.estimators)}")
        if self.granularity not in k.granularities:
            raise ValueError(f"clip_bias.granularity={self.granularity!r} is not valid for kind "
                             f"{self.kind!r}; allowed: {', '.join(k.granularities)}")
        if self.estimator == "grad" and self.granularity != "batch":
            raise ValueError("clip_bias.estimator='grad' supports granularity='batch' only")


_FIELDS = tuple(f.name for f in fields(ClipBias))
_FIELD_SET = frozenset(_FIELDS)


@functools.lru_cache(maxsize=64)
def _cached_clip_bias(key: tuple) -> ClipBias:
    return ClipBias(**{name: value for name, _, value in key})


def _clip_bias(values: dict) -> ClipBias:
    """ClipBias(**values), validated once per distinct spec: a trainer passes the same spec on
    every call, and building and validating it costs as much as the scale it computes. The key
    holds each value's type, so True never reuses the entry of 1."""
    key = tuple((name, type(value), value) for name, value in values.items())
    try:
        return _cached_clip_bias(key)
    except TypeError:  # an unhashable value: build (and fail validation) uncached
        return ClipBias(**values)


def resolve_clip_bias(spec: Any) -> Optional[ClipBias]:
    """None, a mapping or an object with fields kind, tau[, estimator, granularity] → ClipBias
    (None for kind 'none'). Unknown mapping keys raise a ValueError naming the expected fields."""
    if spec is None:
        return None
    if isinstance(spec, ClipBias):
        out = spec
    elif hasattr(spec, "keys"):
        if not _FIELD_SET.issuperset(spec.keys()):
            extra = sorted(set(spec.keys()) - _FIELD_SET)
            raise ValueError(f"clip_bias has unknown fields {extra}; "
                             f"expected: {', '.join(_FIELDS)}")
        out = _clip_bias({k: spec[k] for k in spec.keys()})
    elif hasattr(spec, "kind"):
        out = _clip_bias({k: getattr(spec, k) for k in _FIELDS if hasattr(spec, k)})
    else:
        raise ValueError(f"clip_bias must be None, a mapping or an object with fields "
                         f"{', '.join(_FIELDS)}; got {type(spec).__name__}")
    return None if out.kind == "none" else out


# --- the scales -----------------------------------------------------------------------------
def _scale(norm: torch.Tensor, tau: float) -> torch.Tensor:
    """λ = 1 / max(1, ‖C‖/τ)."""
    return (norm / tau).clamp_min_(1.0).reciprocal_()


def _none(ctx: ClipContext, spec: ClipBias) -> tuple[torch.Tensor, dict]:
    return torch.ones((), device=ctx.bias_norm.device), {}


def _clip_bias_norm(ctx: ClipContext, spec: ClipBias) -> tuple[torch.Tensor, dict]:
    if spec.estimator == "grad":
        if ctx.grad_norm is not None:  # computed by the caller (micro-batches: stppo.train)
            g = at_least_fp32(ctx.grad_norm.detach())
        elif ctx.params is None:
            raise ValueError("clip_bias.estimator='grad' needs the policy parameters: pass "
                             "params=model.parameters() (or clip_bias_grad_norm=‖C‖) to "
                             "policy_loss")
        else:
            g = clip_bias_grad_norm(ctx.bias_term(), ctx.params, ctx.reduce)
        return _scale(g, spec.tau), {CLIP_BIAS_GRAD_NORM: g}
    if spec.granularity == "sequence":
        return _scale((ctx.bias_rows / ctx.lengths.clamp(min=1)).sqrt(), spec.tau), {}
    return _scale(ctx.bias_norm, spec.tau), {}


def _clip_triggered(ctx: ClipContext, spec: ClipBias) -> tuple[torch.Tensor, dict]:
    r = rms_ratio(ctx.rms_sums(), ctx.reduce)
    return torch.where(r > spec.tau, 1.0 / r.clamp(min=RMS_EPS), torch.ones_like(r)), {}


# Default τ (this suite's choice; the paper's values are not public). With whitened advantages
# (|A| ≈ 1) and ρ ≈ 1, clip_bias/norm ≈ sqrt(clip fraction): 0.5 leaves healthy runs (clip
# fractions of a few %) untouched and acts once ~25% of the tokens are clipped or the clipped
# ρA grow. For clip_triggered, r ≈ 1 when clipped and unclipped tokens have similar magnitude;
# τ = 2 acts once the clipped tokens' RMS(ρA) is twice the rest's.
DEFAULT_TAU = {"none": None, "clip_bias_norm": 0.5, "clip_triggered": 2.0}
CLIP_BIAS_KINDS.register("none", ClipBiasKind(_none, None, ESTIMATORS, GRANULARITIES))
CLIP_BIAS_KINDS.register("clip_bias_norm", ClipBiasKind(
    _clip_bias_norm, DEFAULT_TAU["clip_bias_norm"], ESTIMATORS, GRANULARITIES))
CLIP_BIAS_KINDS.register("clip_triggered", ClipBiasKind(
    _clip_triggered, DEFAULT_TAU["clip_triggered"], ("token",), ("batch",)))
