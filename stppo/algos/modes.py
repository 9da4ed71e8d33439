"""The loss modes behind `policy_loss` (docs/design.md §2): one registry, `LOSS_MODES`.

clip (the clipped surrogate of `stppo.algos.loss.clip_policy_loss`, every ratio level and
correction), and the losses people compare against, one module each in `stppo.algos.baselines`:
cispo, gmpo, sapo, clip_cov, kl_cov, bapo, dppo_tv and dppo_kl (dppo), dro, sspo. A researcher's
own stabiliser joins the registry under its preset's name (`stppo.algos.plugins`). Unknown names
list the valid ones.

A built-in mode takes the tensors and keywords of `policy_loss`, the mode's `options` (named
floats; unknown names and bad values are one-line ValueErrors) and `rollout_is_weights`, and
returns `(loss, metrics)` with the clip path's metric keys. A mode with `segments=True` (sspo)
also takes `segment_ids` (N, T), the subsentence labels of the agent tokens, and fails in one
line without them. Rollout IS weights ω (N, T)
(the rollout correction's, `stppo.algos.rollout_corr`; ω ≥ 0) multiply the per-token loss, as
verl's. On the clip path they are applied as advantages ωA: the clipped surrogate is positively
homogeneous in A — clipping depends on the sign of A only and ω ≥ 0 — so s(ρ, ωA) = ω s(ρ, A)
exactly, and the clip path itself stays untouched. Its clip fractions are then counted from the
unweighted A (`clip_metrics.clip_fractions`), as verl counts them: a token whose weight is 0 but
whose ratio is outside the clip range is clipped there too.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from stppo.algos.baselines import bapo, cov, dppo, dro, sapo, sspo
from stppo.algos.baselines.bapo import bapo_loss
from stppo.algos.baselines.cispo import cispo_loss
from stppo.algos.baselines.cov import clip_cov_loss, kl_cov_loss
from stppo.algos.baselines.dppo import dppo_kl_loss, dppo_tv_loss
from stppo.algos.baselines.dro import dro_loss
from stppo.algos.baselines.gmpo import gmpo_loss
from stppo.algos.baselines.sapo import sapo_loss
from stppo.algos.baselines.sspo import sspo_loss
from stppo.algos.clip_metrics import clip_fractions
from stppo.algos.loss import check_token_tensors, clip_policy_loss
from stppo.registry import Registry


class LossMode(NamedTuple):
    fn: Optional[Callable[..., tuple]]  # None: the clip path of `policy_loss`
    defaults: Mapping[str, float]  # option name -> default
    ratio_levels: tuple[str, ...]  # the ratio levels the loss is defined at
    dual_clip: bool = False  # takes `dual_clip`
    check: Optional[Callable[[dict], None]] = None  # validates resolved options
    uses_clip: bool = True  # reads clip_low / clip_high
    source: str = ""
    # The loss of a batch is the sum of its parts' losses under the batch's denominators
    # (`global_denoms`): no statistic of the whole batch enters a token's term. False for the
    # losses that select tokens (Clip-/KL-Cov) or set bounds (BAPO) from the whole batch.
    separable: bool = True
    # A researcher's stabiliser (`stppo.algos.plugins`): `fn(inputs, spec) -> (loss, metrics)`
    # instead of the built-in modes' keywords.
    plugin: bool = False
    # Reads `segment_ids` (N, T): the subsentence labels of the agent tokens (SSPO), which the
    # caller derives from the token ids (stppo.train.prepare). verl passes a policy loss no token
    # ids: such a mode is own-backend only (stppo.integrations.verl.overrides).
    segments: bool = False


LOSS_MODES: Registry[LossMode] = Registry("loss_mode")
LOSS_MODES.register("clip", LossMode(None, {}, ("token", "turn", "sequence"), dual_clip=True,
                                     source="PPO clipped surrogate (arXiv 1707.06347)"))
LOSS_MODES.register("cispo", LossMode(cispo_loss, {}, ("token",),
                                      source="MiniMax-M1 (arXiv 2506.13585); verl 'cispo'"))
LOSS_MODES.register("gmpo", LossMode(gmpo_loss, {}, ("sequence",),
                                     source="GMPO (arXiv 2507.20673); verl 'geo_mean'"))
LOSS_MODES.register("sapo", LossMode(sapo_loss, sapo.DEFAULTS, ("token",), check=sapo.check,
                                     uses_clip=False, source="SAPO (arXiv 2511.20347); verl 'sapo'"))
LOSS_MODES.register("clip_cov", LossMode(clip_cov_loss, cov.CLIP_COV_DEFAULTS, ("token",),
                                         check=cov.check_clip_cov, separable=False,
                                         source="Clip-Cov (arXiv 2505.22617); verl 'clip_cov'"))
LOSS_MODES.register("kl_cov", LossMode(kl_cov_loss, cov.KL_COV_DEFAULTS, ("token",),
                                       check=cov.check_kl_cov, uses_clip=False, separable=False,
                                       source="KL-Cov (arXiv 2505.22617); verl 'kl_cov'"))
LOSS_MODES.register("bapo", LossMode(bapo_loss, bapo.DEFAULTS, ("token",), dual_clip=True,
                                     check=bapo.check, separable=False,
                                     source="BAPO (arXiv 2510.18927)"))
LOSS_MODES.register("dppo_tv", LossMode(dppo_tv_loss, dppo.DEFAULTS, ("token",), check=dppo.check,
                                        source="DPPO Binary-TV (arXiv 2602.04879); verl 'dppo_tv'"))
LOSS_MODES.register("dppo_kl", LossMode(dppo_kl_loss, dppo.DEFAULTS, ("token",), check=dppo.check,
                                        source="DPPO Binary-KL (arXiv 2602.04879); verl 'dppo_kl'"))
LOSS_MODES.register("dro", LossMode(dro_loss, dro.DEFAULTS, ("token",), check=dro.check,
                                    uses_clip=False, source="DRO (arXiv 2405.19107); verl 'dro'"))
LOSS_MODES.register("sspo", LossMode(sspo_loss, sspo.DEFAULTS, ("token",), dual_clip=True,
                                     check=sspo.check, segments=True,
                                     source="SSPO (arXiv 2511.04256)"))


def resolve_options(loss_mode: str, options: Optional[Mapping[str, Any]]) -> dict[str, float]:
    """The mode's defaults updated with `options`; unknown names or non-numbers: ValueError."""
    mode = LOSS_MODES[loss_mode]
    options = dict(options or {})
    unknown = sorted(set(options) - set(mode.defaults))
    if unknown:
        valid = ", ".join(mode.defaults) if mode.defaults else "none"
        raise ValueError(f"loss_mode={loss_mode!r} has no option(s) {', '.join(unknown)}; "
                         f"valid: {valid}")
    for k, x in options.items():
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise ValueError(f"loss_mode={loss_mode!r}: option {k} must be a number, got {x!r}")
    out = {k: float(options.get(k, d)) for k, d in mode.defaults.items()}
    if mode.check is not None:
        mode.check(out)
    return out


def check_loss_mode(loss_mode: str, *, ratio_level: str, correction_kind: str = "none",
                    dual_clip: Optional[float] = None,
                    options: Optional[Mapping[str, Any]] = None) -> dict[str, float]:
    """Validate a loss mode with the other settings it meets (one-line ValueErrors); returns the
    resolved options. Shared by `policy_loss` and `AlgoConfig`."""
    mode = LOSS_MODES[loss_mode]
    if ratio_level not in mode.ratio_levels:
        raise ValueError(f"loss_mode={loss_mode!r} is defined at ratio_level "
                         f"{' | '.join(mode.ratio_levels)}, got {ratio_level!r}")
    if loss_mode != "clip" and correction_kind != "none":
        raise ValueError(f"loss_mode={loss_mode!r} takes no correction (got "
                         f"{correction_kind!r}); corrections apply to loss_mode='clip'")
    if dual_clip is not None and not mode.dual_clip:
        raise ValueError(f"loss_mode={loss_mode!r} has no dual clip; set dual_clip to null")
    return resolve_options(loss_mode, options)


def _kind(correction: Any) -> str:
    if correction is None:
        return "none"
    if hasattr(correction, "keys"):
        return correction.get("kind", "none")
    return getattr(correction, "kind", "none")


def dispatch(log_probs, old_log_probs, advantages, loss_mask, turn_ids, *, loss_mode: str,
             options, rollout_is_weights, segment_ids=None, **kw):
    """`policy_loss` for loss_mode ≠ 'clip', options or rollout IS weights (see the docstring)."""
    check_token_tensors(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                        loss_mask=loss_mask, turn_ids=turn_ids)
    if LOSS_MODES[loss_mode].segments:
        if segment_ids is None:
            raise ValueError(f"loss_mode={loss_mode!r} needs segment_ids, the subsentence labels "
                             "of the agent tokens (stppo.algos.segments.subsentence_ids)")
        check_token_tensors(log_probs=log_probs, segment_ids=segment_ids)
        kw["segment_ids"] = segment_ids
    if rollout_is_weights is not None:
        check_token_tensors(log_probs=log_probs, rollout_is_weights=rollout_is_weights)
        rollout_is_weights = rollout_is_weights.detach()
    opts = check_loss_mode(loss_mode, ratio_level=kw["ratio_level"],
                           correction_kind=_kind(kw.get("correction")),
                           dual_clip=kw.get("dual_clip"), options=options)
    if loss_mode == "clip":  # ω A: see the module docstring
        if rollout_is_weights is None:
            return clip_policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, **kw)
        weighted = torch.where(loss_mask, advantages * rollout_is_weights, advantages)
        loss, metrics = clip_policy_loss(log_probs, old_log_probs, weighted, loss_mask, turn_ids, **kw)
        return loss, {**metrics, **clip_fractions(log_probs, old_log_probs, advantages, loss_mask, turn_ids,
                                                  ratio_level=kw["ratio_level"], clip_low=kw["clip_low"],
                                                  clip_high=kw["clip_high"])}
    _check_common(log_probs, loss_mask, kw)
    return LOSS_MODES[loss_mode].fn(log_probs, old_log_probs, advantages, loss_mask, turn_ids,
                                    opts=opts, rollout_is_weights=rollout_is_weights, **kw)


def _check_common(log_probs, loss_mask, kw) -> None:
    from stppo.algos.aggregation import LOSS_AGGS

    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be a floating tensor, got {log_probs.dtype}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if kw["loss_agg"] not in LOSS_AGGS:
        raise ValueError(f"loss_agg={kw['loss_agg']!r} is not valid; allowed: "
                         f"{', '.join(LOSS_AGGS)}")
    if not 0.0 <= kw["clip_low"] < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {kw['clip_low']}")
    if not kw["clip_high"] > 0.0:
        raise ValueError(f"clip_high must be > 0, got {kw['clip_high']}")
    if kw.get("reduce") is not None and kw.get("global_denoms") is None:
        raise ValueError("policy_loss: reduce (data parallelism) needs global_denoms")


def register_loss_mode(name: str, mode: LossMode) -> LossMode:
    """Add a loss mode (a plugin's); a name registered twice raises ValueError."""
    return LOSS_MODES.register(name, mode)


__all__ = ["LOSS_MODES", "LossMode", "check_loss_mode", "dispatch", "register_loss_mode",
           "resolve_options"]
