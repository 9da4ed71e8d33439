"""stppo's policy losses with verl's policy-loss signature (docs/design.md, "verl backend: losses").

Torch and `stppo.algos` only — no verl import, so this module is what an engine-agnostic test or
a user's own verl environment (`pip install --no-deps stppo`) needs. `plugin.py` registers one
loss per preset in verl's registry; this module builds them.

verl 0.9.1 (`workers/utils/losses.py::ppo_loss`) calls a policy loss per micro-batch as

    fn(old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=, config=,
       rollout_is_weights=) -> (loss, metrics)

with `config` the actor config (`clip_ratio_low/high`, `clip_ratio_c`, `policy_loss`,
`global_batch_info` = dp_size, batch_num_tokens, global_batch_size, loss_scale_factor of the
mini-batch). The loss here is `stppo.algos.policy_loss` on that micro-batch with

- turn ids: the k-th contiguous run of 1s of `response_mask` is turn k (`turn_ids_from_mask`);
- clip ε_low, ε_high, dual clip c: verl's `clip_ratio_low/high` (`clip_ratio` where None),
  `clip_ratio_c` (verl's own losses always apply the dual clip; default 3.0);
- aggregation: verl's `loss_agg_mode` (same names as stppo's `loss_agg`) with the global
  denominators of `verl_global_denoms`, so the micro-batch losses sum like verl's own;
- the rest of the loss — ratio level, clip-bias scale, loss mode and options, … — from the run's
  `LossSpec` that the launcher sends (`config.policy_loss.spec`, `StppoPolicyLossConfig`), else
  from the preset with the config's knobs τ, estimator, granularity, options (`config.py`);
- per-turn metrics for turns 0..K−1, K = `config.policy_loss.max_turns` (`DEFAULT_MAX_TURNS`
  without it; 0 = none), in the token-weighted form of `verl_turn_metrics`;
- the rollout correction (`spec.rollout_correction`): in decoupled mode verl's driver computed the
  IS weights (`rollout_is_weights`, applied as by verl's own losses) and the rejection (in
  `response_mask`); in bypass mode verl's v1 trainer sets old_log_prob := the sampler's, and this
  loss corrects as verl's `compute_policy_loss_bypass_mode` does (`bypass_correction`): weights
  and rejection from the micro-batch's log_prob (detached) against it, the `rollout_corr/*`
  metrics of that comparison, `reinforce` in place of the preset's loss for loss_type reinforce.

A loss mode that reads subsentences (SSPO) cannot run here: verl passes no token ids to a policy
loss, so its `stppo_<preset>` loss is one clear error (and the launcher rejects it before Ray).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from stppo.algos import LOSS_MODES, PRESETS, ClipBias, LossSpec, policy_loss, sampler_mismatch
from stppo.algos.aggregation import agg_denoms
from stppo.algos.breakdown import turn_breakdown
from stppo.algos.rollout_corr import DIAGNOSTIC_IS_THRESHOLD, rollout_correction
from stppo.algos.segments import turn_ids_from_mask
from stppo.integrations.verl import loss_mode
from stppo.integrations.verl.metrics import TURN_WEIGHT, TURN_WEIGHTED
from stppo.metric_names import PG_CLIPFRAC_LOWER, turn_key

# verl's loss_agg_mode → stppo's loss_agg. verl's `token-sum` and `seq-mean-token-sum-norm` have
# no stppo counterpart (the clip-bias scale's τ is defined on stppo's three forms): rejected.
VERL_LOSS_AGGS = {m: m for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")}
DEFAULT_MAX_TURNS = 4  # per-turn metrics without StppoPolicyLossConfig.max_turns (task.max_turns' default)
GRAD_ESTIMATOR_ERROR = (
    "clip-bias estimator 'grad' needs the policy parameters, which verl does not pass to a "
    "policy loss; use estimator=token with the verl backend")
SEGMENTS_ERROR = ("reads subsentences from the token ids, which verl does not pass to a policy "
                  "loss; train it with stppo's own backend")


def verl_loss_agg(loss_agg_mode: str) -> str:
    """stppo's `loss_agg` for verl's `actor.loss_agg_mode`; one-line ValueError otherwise."""
    if loss_agg_mode not in VERL_LOSS_AGGS:
        raise ValueError(f"actor.loss_agg_mode={loss_agg_mode!r} is not supported by stppo's "
                         f"losses; allowed: {', '.join(VERL_LOSS_AGGS)}")
    return VERL_LOSS_AGGS[loss_agg_mode]


def verl_global_denoms(loss_mask: torch.Tensor, loss_agg: str, dp_size: Any = 1,
                       batch_num_tokens: Any = None, global_batch_size: Any = None,
                       **_: Any) -> tuple[Any, Any]:
    """(D_tok, D_seq) for `policy_loss(global_denoms=...)` from verl's `global_batch_info`, such
    that stppo's aggregation of a micro-batch equals verl's `core_algos.agg_loss` of it:

        token-mean:  Σ m v / batch_num_tokens · dp_size    ⇒  D_tok = batch_num_tokens / dp_size
        seq-mean-*:  Σ_i r_i / global_batch_size · dp_size  ⇒  D_seq = global_batch_size / dp_size

    (r_i the row's token mean or sum). verl's FSDP averages gradients over the dp ranks, hence
    the factor dp_size. `global_batch_size` counts every row of the mini-batch (ppo_mini_batch_size
    × rollout.n), rows without agent tokens included, whereas stppo's own D_seq counts only rows
    with ≥ 1 agent token: a mini-batch with e empty rows of B gets (B − e)/B times stppo's loss,
    as verl's own losses do. A count that verl leaves None falls back, as in `agg_loss`, to this
    micro-batch's own (agent tokens; rows with ≥ 1 agent token); with dp_size > 1 that raises.
    """
    dp = int(dp_size) if dp_size is not None else 1
    needed = batch_num_tokens if loss_agg == "token-mean" else global_batch_size
    if needed is None and dp > 1:
        name = "batch_num_tokens" if loss_agg == "token-mean" else "global_batch_size"
        raise ValueError(f"verl's global_batch_info has no {name} with dp_size={dp}: stppo's "
                         f"{loss_agg} loss needs the mini-batch's global count")
    d_tok, d_seq = agg_denoms(loss_mask)  # this micro-batch's own counts (the fallback)
    if batch_num_tokens is not None:
        d_tok = float(batch_num_tokens) / dp
    if global_batch_size is not None:
        d_seq = float(global_batch_size) / dp
    return d_tok, d_seq


def dual_clip_fraction(ratio: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                       dual_clip: float) -> torch.Tensor:
    """verl's `actor/pg_clipfrac_lower`: the share of agent tokens where the dual clip binds,

        Σ m 1[A < 0 ∧ ρ > c] / Σ m        (0 without agent tokens)

    — verl's 1[max(−Aρ, −A clip(ρ)) > −A c] · 1[A < 0] (`compute_policy_loss_vanilla`), which is
    A < 0 ∧ ρ > c since c > 1 > 1 − ε_low. `ratio`, `advantages`, `loss_mask` (N, T). Detached 0-d.
    """
    with torch.no_grad():
        hit = loss_mask & (advantages < 0) & (ratio > dual_clip)  # (N, T); nan compares False
        n = loss_mask.sum().clamp(min=1)
        return hit.sum().to(ratio.dtype) / n


def _knobs(config: Any) -> tuple[Optional[float], str, str, dict]:
    """(τ, estimator, granularity, loss-mode options) from `config.policy_loss`
    (StppoPolicyLossConfig), or the defaults when verl's plain PolicyLossConfig has none."""
    pl = getattr(config, "policy_loss", None)
    return (getattr(pl, "tau", None), getattr(pl, "estimator", "token"),
            getattr(pl, "granularity", "batch"), dict(getattr(pl, "options", None) or {}))


def _max_turns(config: Any) -> int:
    """K of the per-turn metrics: `config.policy_loss.max_turns`, else DEFAULT_MAX_TURNS."""
    return int(getattr(getattr(config, "policy_loss", None), "max_turns", DEFAULT_MAX_TURNS))


def _clip_ranges(config: Any) -> tuple[float, float, float]:
    """(ε_low, ε_high, c) as verl's `compute_policy_loss_vanilla` reads them."""
    clip = getattr(config, "clip_ratio", 0.2)
    low, high = getattr(config, "clip_ratio_low", None), getattr(config, "clip_ratio_high", None)
    return (float(clip if low is None else low), float(clip if high is None else high),
            float(getattr(config, "clip_ratio_c", 3.0)))


def verl_spec(name: str, loss_agg_mode: str, config: Any) -> LossSpec:
    """The `LossSpec` of one verl call of `stppo_<name>`: the run's spec sent by the launcher
    (`config.policy_loss.spec`), else the preset's with the config's knobs — in either case with
    verl's own clip ranges, dual clip (for the modes that have one) and aggregation."""
    if config is None:
        raise ValueError("stppo's verl losses need verl's actor config (config=None)")
    sent = getattr(getattr(config, "policy_loss", None), "spec", None)
    if sent:
        base = LossSpec.from_dict(sent)
    else:
        tau, estimator, granularity, options = _knobs(config)
        preset = PRESETS[name]
        clip_bias = (None if preset.clip_bias == "none" else
                      ClipBias(preset.clip_bias, preset.tau if tau is None else tau, estimator,
                                 granularity))
        base = preset.spec(clip_bias=clip_bias, options={**preset.options, **options})
    if base.clip_bias is not None and base.clip_bias.estimator == "grad":
        raise ValueError(GRAD_ESTIMATOR_ERROR)
    if LOSS_MODES[base.loss_mode].segments:
        raise ValueError(f"loss_mode={base.loss_mode!r} {SEGMENTS_ERROR}")
    clip_low, clip_high, dual_clip = _clip_ranges(config)
    if not LOSS_MODES[base.loss_mode].dual_clip:  # verl's c applies to the modes that have one
        dual_clip = None
    return base.replace(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                        loss_agg=verl_loss_agg(loss_agg_mode))


@torch.no_grad()
def verl_turn_metrics(ratio: torch.Tensor, clipped: torch.Tensor, log_prob: torch.Tensor,
                      old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      turn_ids: torch.Tensor, max_turns: int) -> dict[str, torch.Tensor]:
    """stppo's per-turn breakdown (`stppo.algos.breakdown.turn_breakdown`) of one micro-batch in
    the form verl can average: every key for every turn k < K, each value weighted by its turn's
    agent tokens per row,

        turn/k{k}/tokens = c_k / n,      turn/k{k}/{name} = v_k · c_k / n      (0 where c_k = 0)

    with c_k the micro-batch's agent tokens of turn k, n its rows and v_k the turn's value (κ, ρ
    at the spec's ratio level — the loss's own, `LossOutput` — A, −δ; ρ's max). Why: verl averages a loss metric over
    micro-batches, ranks and mini-batches, and `Metric.aggregate_dp` fails when ranks return a key
    a different number of times — a key present only where the turn has tokens would stop a
    data-parallel update. The ratio of the two averages is the turn's token mean over the
    mini-batch (micro-batches of equal rows); the run monitor divides (`metrics.turn_copies`).
    `turn/k{k}/entropy` and `rollout_kl` are left out (`metrics.TURN_UNAVAILABLE`). Tensors (N, T)."""
    if max_turns < 1:
        return {}
    zero = ratio.new_zeros(())
    adv = torch.where(mask, advantages, 0.0)  # (N, T) finite
    per = turn_breakdown(ratio, log_prob, old_log_prob, adv, torch.zeros_like(ratio), clipped,
                         mask, turn_ids, max_turns)
    out: dict[str, torch.Tensor] = {}
    for k in range(max_turns):
        w = per.get(turn_key(k, TURN_WEIGHT), zero)
        out[turn_key(k, TURN_WEIGHT)] = w
        for name in TURN_WEIGHTED:
            v = per.get(turn_key(k, name))
            out[turn_key(k, name)] = v * w if v is not None else zero
    return out


def metrics_to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Detached 0-d tensors → Python floats, as verl's own losses return them (one host sync)."""
    if not metrics:
        return {}
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().to(torch.float64) for k in keys]).tolist()
    return dict(zip(keys, values))


def _dp_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over verl's data-parallel ranks (verl's `distributed_masked_mean` sums over the default
    process group)."""
    y = x.detach().clone()
    torch.distributed.all_reduce(y, op=torch.distributed.ReduceOp.SUM)
    return y


def bypass_correction(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
                      rc: Any) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """Bypass mode in one micro-batch, as verl's `compute_policy_loss_bypass_mode`: (the kept agent
    tokens, the IS weights the loss applies or None, the `rollout_corr/*` metrics) from the current
    log-probs (detached) against the sampler's. The IS batch normaliser is the micro-batch's over
    verl's ranks (`distributed_masked_mean`). Tensors (N, T)."""
    dist = torch.distributed
    reduce = _dp_sum if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None
    lp = log_prob.detach()
    c = rollout_correction(lp, rollout_log_prob, mask, rc, reduce=reduce)
    threshold = None if rc.rollout_is is not None else DIAGNOSTIC_IS_THRESHOLD
    metrics = {**sampler_mismatch(lp, rollout_log_prob, mask, threshold), **c.metrics}
    return c.loss_mask, c.weights if rc.applies_weights else None, metrics


def make_verl_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """verl's policy-loss function of preset `name`, to register as `loss_mode(name)`."""

    def loss_fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                config: Any = None, rollout_is_weights: Optional[torch.Tensor] = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0  # (N, T)
        spec = verl_spec(name, loss_agg_mode, config)
        info = getattr(config, "global_batch_info", None) or {}
        turn_ids = turn_ids_from_mask(mask)  # (N, T)
        denoms = verl_global_denoms(mask, spec.loss_agg, **dict(info))  # all agent tokens
        kept, weights, corr = mask, rollout_is_weights, {}
        if spec.rollout_correction.bypass_mode:  # old_log_prob is the sampler's
            kept, weights, corr = bypass_correction(log_prob, old_log_prob, mask, spec.rollout_correction)
        out = policy_loss(log_prob, old_log_prob, advantages, kept, turn_ids, spec,
                          global_denoms=denoms, rollout_is_weights=weights)
        metrics = {**out.metrics, **corr}
        with torch.no_grad():
            if PG_CLIPFRAC_LOWER not in metrics:  # DPPO returns its own (its truncation's share)
                metrics[PG_CLIPFRAC_LOWER] = (
                    dual_clip_fraction(out.ratio, advantages, kept, spec.dual_clip)
                    if spec.dual_clip is not None else out.ratio.new_zeros(()))
            metrics.update(verl_turn_metrics(out.ratio, out.clipped, log_prob, old_log_prob,
                                             advantages, kept, turn_ids, _max_turns(config)))
        return out.loss, metrics_to_floats(metrics)

    loss_fn.__name__ = loss_fn.__qualname__ = loss_mode(name)
    loss_fn.__doc__ = (f"verl policy loss '{loss_mode(name)}': stppo preset {name!r} "
                       "(stppo.integrations.verl.losses).")
    loss_fn.stppo_preset = name  # type: ignore[attr-defined]
    return loss_fn
