"""The one contract of a policy loss (docs/design.md §2, docs/extending.md).

Every loss mode — the clip path, each baseline, a researcher's stabiliser — is one function

    @loss_mode("my_loss", options={"beta": 0.1}, separable=True, ratio_levels=("token",))
    def my_loss(x: LossInputs, spec: LossSpec) -> tuple[loss, metrics]

`x` holds the tensors (N, T) and what a call adds to the spec; `spec` (`stppo.algos.spec.LossSpec`)
is the run's validated loss: ratio level, clip range, dual clip, aggregation, the clip-bias scale
(`spec.clip_bias`), the mode's resolved options. The function returns the loss (0-d, with the
graph of `x.log_probs`) and its metrics (detached 0-d tensors: stppo's keys, `stppo.metric_names`,
or its own under `<namespace>/…`), and may return κ (N, T) bool — where the clip path's bounds
bind at the spec's ratio level — as a third element, which callers then read instead of
computing it (the clip path does; `stppo.algos.policy.LossOutput`).

The decorator declares what the mode can take, the same way for built-ins and plugins:
  options       its knobs and their defaults (numbers; `spec.options` holds them resolved)
  ratio_levels  the ratio levels it is defined at
  dual_clip     whether it reads `spec.dual_clip`
  separable     whether the loss of a batch is the sum of its parts' losses under the batch's
                denominators (`x.global_denoms`): micro-batches may then backward each part's
                share; otherwise the trainer differentiates the whole minibatch's loss
  segments      whether it reads `x.segment_ids` (SSPO's subsentences)
  clip_bias     whether it takes a clip-bias scale (`spec.clip_bias`: S-, ST-, SO-PPO's λ)
  check         a validator of the resolved options (raise ValueError)
  namespace     the prefix of its own metrics (default: its name)
Registering a name twice raises; the same function under the same name again is a no-op (a
module imported twice).
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

import torch

from stppo.algos.aggregation import GlobalDenoms
from stppo.algos.clip_bias import Reduce
from stppo.algos.ratios import RATIO_LEVELS
from stppo.metric_names import known_metric
from stppo.registry import Registry


class LossInputs(NamedTuple):
    """What a loss mode gets besides the spec: the tensors (N, T) and what a call adds to it."""

    log_probs: torch.Tensor  # log π_θ, with graph
    old_log_probs: torch.Tensor  # log π_old
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # bool: the agent tokens the loss aggregates over
    turn_ids: torch.Tensor  # long: turn of each agent token, -1 elsewhere
    global_denoms: GlobalDenoms = None  # (D_tok, D_seq) of the whole batch, or None: this call's
    reduce: Reduce = None  # sum over data-parallel shards, or None
    rollout_is_weights: Optional[torch.Tensor] = None  # ω (N, T), detached, or None
    segment_ids: Optional[torch.Tensor] = None  # (N, T) subsentence labels (modes with segments)
    params: Optional[Iterable[torch.Tensor]] = None  # the policy's, for the clip bias's `grad` estimator
    clip_bias_grad_norm: Optional[torch.Tensor] = None  # that estimator's ‖C‖, when the caller has it


class LossMode(NamedTuple):
    fn: Callable[[LossInputs, Any], tuple]
    options: Mapping[str, float]  # option name -> default
    ratio_levels: tuple[str, ...]
    dual_clip: bool = False
    separable: bool = False
    segments: bool = False
    clip_bias: bool = False
    check: Optional[Callable[[dict], None]] = None
    namespace: Optional[str] = None  # its own metrics: '<namespace>/…'
    source: str = ""  # where it comes from (paper, verl name, a package's function)


LOSS_MODES: Registry[LossMode] = Registry("loss_mode")


def loss_mode(name: Optional[str] = None, *, options: Optional[Mapping[str, float]] = None,
              ratio_levels: tuple[str, ...] = RATIO_LEVELS, dual_clip: bool = False,
              separable: bool = False, segments: bool = False, clip_bias: bool = False,
              check: Optional[Callable[[dict], None]] = None, namespace: Optional[str] = None,
              source: str = "") -> Callable:
    """Register `fn(x: LossInputs, spec: LossSpec) -> (loss, metrics[, clipped])` as the loss
    mode `name` (default: the function's name) with its declared capabilities (module
    docstring). Returns the function."""
    opts = dict(options or {})
    for k, v in opts.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"loss mode option {k!r}: a name and a number default, got {v!r}")
    bad = [lv for lv in ratio_levels if lv not in RATIO_LEVELS]
    if bad or not ratio_levels:
        raise ValueError(f"loss mode ratio_levels must be some of {', '.join(RATIO_LEVELS)}, got {ratio_levels}")

    def wrap(fn: Callable) -> Callable:
        _check_signature(fn)
        mode_name = name or fn.__name__
        source_ = source or f"{fn.__module__}:{fn.__qualname__}"
        if mode_name in LOSS_MODES:
            if LOSS_MODES[mode_name].source == source_:
                return fn
            raise ValueError(f"loss mode {mode_name!r} is registered already "
                             f"({LOSS_MODES[mode_name].source}); name it otherwise")
        LOSS_MODES.register(mode_name, LossMode(
            fn, {k: float(v) for k, v in opts.items()}, tuple(ratio_levels), bool(dual_clip),
            bool(separable), bool(segments), bool(clip_bias), check, namespace or mode_name, source_))
        fn.stppo_loss_mode = mode_name  # type: ignore[attr-defined]
        return fn
    return wrap


def _check_signature(fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"a loss mode must be a function, got {type(fn).__name__}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ValueError(f"loss mode {_name(fn)}: its signature cannot be read") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) != 2 or required_kw or any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ValueError(f"loss mode {_name(fn)} must take exactly two arguments (inputs, spec), "
                         f"got ({', '.join(p.name for p in params)})")


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def check_token_tensors(**tensors: torch.Tensor) -> None:
    """Every argument is a (N, T) tensor of the first one's shape; else one-line ValueError."""
    shape = None
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (N, T), got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape (N, T), got {tuple(x.shape)}")
        if shape is None:
            shape, first = x.shape, name
        elif x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                             f"(the shape of {first})")


def check_dtypes(log_probs: torch.Tensor, loss_mask: torch.Tensor, turn_ids: torch.Tensor) -> None:
    """log_probs floating, loss_mask bool, turn_ids integers; else one-line ValueError."""
    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be a floating tensor, got {log_probs.dtype}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if turn_ids.is_floating_point() or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_ids must be an integer tensor, got {turn_ids.dtype}")


def resolve_options(mode_name: str, options: Optional[Mapping[str, Any]]) -> dict[str, float]:
    """The mode's defaults updated with `options`; unknown names or non-numbers: ValueError."""
    mode = LOSS_MODES[mode_name]
    options = dict(options or {})
    unknown = sorted(set(options) - set(mode.options))
    if unknown:
        valid = ", ".join(mode.options) if mode.options else "none"
        raise ValueError(f"loss_mode={mode_name!r} has no option(s) {', '.join(unknown)}; valid: {valid}")
    for k, x in options.items():
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise ValueError(f"loss_mode={mode_name!r}: option {k} must be a number, got {x!r}")
    out = {k: float(options.get(k, d)) for k, d in mode.options.items()}
    if mode.check is not None:
        mode.check(out)
    return out


def check_metric_names(mode_name: str, metrics: Mapping[str, Any]) -> None:
    """A mode's metrics are stppo's keys or its own, '<namespace>/…'; else one-line ValueError."""
    prefix = f"{LOSS_MODES[mode_name].namespace}/"
    bad = [k for k in metrics if not (k.startswith(prefix) or known_metric(k))]
    if bad:
        raise ValueError(f"loss mode {mode_name!r} returned metric(s) {', '.join(map(repr, bad))}: "
                         f"name its own metrics '{prefix}…' (or use stppo.metric_names's keys)")
