"""A researcher's own stabiliser: one function and one preset file (docs/extending.md).

The function (in the researcher's package):

    from stppo.algos.plugins import stabiliser

    @stabiliser(options={"beta": 0.5}, separable=False)
    def my_loss(x, spec):
        # x: LossInputs — log_probs (with graph), old_log_probs, advantages, loss_mask,
        #    turn_ids (N, T); global_denoms, reduce (a batch split over calls or ranks);
        #    rollout_is_weights (N, T) or None
        # spec: LossSpec — ratio_level, clip_low, clip_high, loss_agg, options (resolved), …
        return loss, {"my_loss/some_value": value}   # 0-d loss with graph; detached 0-d metrics

The preset file (the researcher's config folder, `algo/my_loss.yaml`, found through Hydra's search
path: `python run.py hydra.searchpath=[pkg://my_package.conf] algo=my_loss`):

    name: my_loss
    loss: my_package.losses:my_loss      # the function: module path, colon, attribute
    advantage: grpo
    use_critic: false
    loss_options: {beta: 0.3}            # over the declared defaults

Contract (checked when the preset is resolved, one line and exit 1 before any work): the module
imports; the attribute is a function decorated with `stabiliser`; it takes exactly two positional
parameters; `loss_options` names only declared options, each a number (a `check(options)` the
decorator was given may reject values). Metrics the function returns are named `<name>/<metric>`
(its own namespace: the preset's name) or are stppo's own keys (`stppo.metric_names`); the loss
itself is logged as `actor/pg_loss` by stppo. `separable=True` promises that the loss of a batch
is the sum of its parts' losses under the batch's denominators (`agg_loss(..., global_denoms)`),
so gradient accumulation may backward each micro-batch's share; otherwise (the default, always
exact) the trainer differentiates the whole minibatch's loss through its log-probs. The loss
mode is registered under the preset's name, in stppo's trainer and, as `stppo_<name>`, in verl.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
from typing import Any, Callable, Mapping, Optional

from stppo.algos.modes import LOSS_MODES, LossMode, register_loss_mode
from stppo.metric_names import known_metric

RATIO_LEVELS_ALL = ("token", "turn", "sequence")


def stabiliser(*, options: Optional[Mapping[str, float]] = None, separable: bool = False,
               ratio_levels: tuple[str, ...] = RATIO_LEVELS_ALL,
               check: Optional[Callable[[dict], None]] = None) -> Callable:
    """Declare a function `fn(x: LossInputs, spec: LossSpec) -> (loss, metrics)` a stabiliser:
    `options` its knobs with their defaults (numbers), `separable` whether micro-batches may each
    backward their share, `ratio_levels` the ratio levels it is defined at, `check` a validator
    of the resolved options (raise ValueError)."""
    opts = dict(options or {})
    for k, v in opts.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"stabiliser option {k!r}: a name and a number default, got {v!r}")

    def wrap(fn: Callable) -> Callable:
        _check_signature(fn)
        fn.stppo_stabiliser = dict(options=opts, separable=bool(separable),  # type: ignore[attr-defined]
                                   ratio_levels=tuple(ratio_levels), check=check)
        return fn
    return wrap


def _check_signature(fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"a stabiliser must be a function, got {type(fn).__name__}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ValueError(f"stabiliser {_name(fn)}: its signature cannot be read") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) != 2 or required_kw or any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ValueError(f"stabiliser {_name(fn)} must take exactly two arguments (inputs, spec), "
                         f"got ({', '.join(p.name for p in params)})")


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def load_function(path: str) -> Callable:
    """`module.path:attribute` → the decorated function; one-line ValueError otherwise."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"algo.loss={path!r}: expected 'module.path:function'")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure of the user's package is one line
        raise ValueError(f"algo.loss={path!r}: module {module!r} cannot be imported "
                         f"({type(e).__name__}: {e})") from None
    fn = mod
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"algo.loss={path!r}: {module!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not hasattr(fn, "stppo_stabiliser"):
        raise ValueError(f"algo.loss={path!r} is not a stabiliser: decorate it with "
                         "@stppo.algos.plugins.stabiliser(...)")
    try:
        _check_signature(fn)
    except ValueError as e:
        raise ValueError(f"algo.loss={path!r}: {e}") from None
    return fn


def register_stabiliser(name: str, path: str) -> LossMode:
    """The loss mode `name` of the stabiliser at `path` (registered once; the same path again is
    the same mode, another path under a taken name is an error)."""
    if name in LOSS_MODES:
        mode = LOSS_MODES[name]
        if mode.plugin and mode.source == path:
            return mode
        raise ValueError(f"algo.name={name!r}: a loss mode of that name exists already "
                         f"({mode.source or 'built in'}); name the preset otherwise")
    fn = load_function(path)
    meta = fn.stppo_stabiliser
    return register_loss_mode(name, LossMode(_metric_checked(name, fn), meta["options"],
                                             meta["ratio_levels"], check=meta["check"],
                                             source=path, separable=meta["separable"],
                                             plugin=True))


def _metric_checked(name: str, fn: Callable) -> Callable:
    """`fn` whose metric names are checked: `<name>/…` or stppo's own keys."""
    prefix = f"{name}/"

    def call(x, spec):
        out = fn(x, spec)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
            raise ValueError(f"stabiliser {name!r} must return (loss, metrics), got "
                             f"{type(out).__name__}")
        loss, metrics = out
        bad = [k for k in metrics if not (k.startswith(prefix) or known_metric(k))]
        if bad:
            raise ValueError(f"stabiliser {name!r} returned metric(s) {', '.join(map(repr, bad))}: "
                             f"name its own metrics '{prefix}…' (or use stppo.metric_names's keys)")
        return loss, dict(metrics)

    call.__name__ = getattr(fn, "__name__", name)
    return call
