"""The field's sampler/trainer mismatch corrections by name: the presets of verl 0.9.1's
`RolloutCorrectionConfig` (verl/trainer/config/algorithm.py; Liu, Li, Fu, Wang, Liu, Shen 2025,
"When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch").
docs/design.md §2, "Rollout correction".

`algo.rollout_correction=<name>` picks one; `algo.rollout_correction_options` sets the arguments
of verl's classmethod of that name (`threshold`, `threshold_lower`, `is_threshold`,
`rs_threshold`), plus `batch_normalize` (verl's `rollout_is_batch_normalize`, no classmethod
argument) for the names with IS weights. `resolve(name, options)` gives verl's config fields:

    rollout_is                  None | 'token' | 'sequence'       the IS weights' level
    rollout_is_threshold        C (TIS: min(w, C)) or 'lower_upper' (IcePop: w·1[lower ≤ w ≤ upper])
    rollout_is_batch_normalize  weights / their batch mean
    rollout_rs                  None | rejection options (comma-separated; REJECTION_OPTIONS)
    rollout_rs_threshold        one threshold per option ('lower_upper' for the k1 ones)
    bypass_mode                 False: decoupled (π_rollout, π_old, π_θ); True: π_old := π_rollout
    loss_type                   bypass only: 'ppo_clip' (the preset's loss) | 'reinforce'

The same numbers as verl's classmethods (checked in tests/verl). Torch-free.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional

from stppo.registry import Registry

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp (verl's)
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
REJECTION_OPTIONS: tuple[str, ...] = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                                      "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                                      "seq_max_k2", "seq_max_k3")
TOKEN_REJECTION = ("token_k1", "token_k2", "token_k3")
FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
          "rollout_rs_threshold", "bypass_mode", "loss_type")
GEO = "0.999_1.001"  # verl's geometric-mean rejection band (±0.1%)


class CorrectionPreset(NamedTuple):
    """One name: its arguments (verl's classmethod's, with defaults) and the fields they build."""
    args: Mapping[str, Any]
    build: Callable[..., dict]


def fields(rollout_is: Optional[str] = None, rollout_is_threshold: Any = 2.0,
           rollout_rs: Optional[str] = None, rollout_rs_threshold: Any = None,
           bypass_mode: bool = False, loss_type: str = "ppo_clip") -> dict:
    """verl's RolloutCorrectionConfig fields (its defaults for the ones a classmethod leaves)."""
    return dict(rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
                rollout_is_batch_normalize=False, rollout_rs=rollout_rs,
                rollout_rs_threshold=rollout_rs_threshold, bypass_mode=bypass_mode,
                loss_type=loss_type)


def _is(level, **kw):
    return lambda threshold: fields(level, threshold, **kw)


def _icepop(**kw):
    return lambda threshold, threshold_lower: fields("token", f"{threshold_lower}_{threshold}", **kw)


def _rs(option, level=None, **kw):
    if level is None:
        return lambda rs_threshold: fields(None, rollout_rs=option, rollout_rs_threshold=rs_threshold, **kw)
    return lambda is_threshold, rs_threshold: fields(level, is_threshold, option, rs_threshold, **kw)


BYPASS_CLIP = dict(bypass_mode=True, loss_type="ppo_clip")
BYPASS_PG = dict(bypass_mode=True, loss_type="reinforce")
ROLLOUT_CORRECTIONS: Registry[CorrectionPreset] = Registry("rollout_correction")
for _name, _args, _build in (
    ("none", {}, lambda: fields()),  # verl's disabled(): the mismatch metrics only
    ("decoupled_token_is", {"threshold": 2.0}, _is("token")),
    ("decoupled_seq_is", {"threshold": 2.0}, _is("sequence")),
    ("decoupled_token_icepop", {"threshold": 5.0, "threshold_lower": 0.5}, _icepop()),
    ("decoupled_seq_is_rs", {"is_threshold": 2.0, "rs_threshold": "0.5_2.0"}, _rs("seq_sum_k1", "sequence")),
    ("decoupled_geo_rs", {"rs_threshold": GEO}, _rs("seq_mean_k1")),
    ("decoupled_geo_rs_seq_tis", {"is_threshold": 2.0, "rs_threshold": GEO}, _rs("seq_mean_k1", "sequence")),
    ("decoupled_geo_rs_token_tis", {"is_threshold": 2.0, "rs_threshold": GEO}, _rs("seq_mean_k1", "token")),
    ("decoupled_k3_rs", {"rs_threshold": 0.01}, _rs("seq_mean_k3")),
    ("decoupled_k3_rs_seq_tis", {"is_threshold": 2.0, "rs_threshold": 0.01}, _rs("seq_mean_k3", "sequence")),
    ("decoupled_k3_rs_token_tis", {"is_threshold": 2.0, "rs_threshold": 0.01}, _rs("seq_mean_k3", "token")),
    ("bypass_ppo_clip", {}, lambda: fields(**BYPASS_CLIP)),
    ("bypass_ppo_clip_geo_rs", {"rs_threshold": GEO}, _rs("seq_mean_k1", **BYPASS_CLIP)),
    ("bypass_ppo_clip_k3_rs", {"rs_threshold": 0.01}, _rs("seq_mean_k3", **BYPASS_CLIP)),
    ("bypass_pg_is", {"threshold": 2.0}, _is("sequence", **BYPASS_PG)),
    ("bypass_pg_token_icepop", {"threshold": 5.0, "threshold_lower": 0.5}, _icepop(**BYPASS_PG)),
    ("bypass_pg_geo_rs", {"rs_threshold": GEO}, _rs("seq_mean_k1", **BYPASS_PG)),
    ("bypass_pg_geo_rs_seq_tis", {"is_threshold": 2.0, "rs_threshold": GEO}, _rs("seq_mean_k1", "sequence", **BYPASS_PG)),
    ("bypass_pg_geo_rs_token_tis", {"is_threshold": 2.0, "rs_threshold": GEO}, _rs("seq_mean_k1", "token", **BYPASS_PG)),
):
    ROLLOUT_CORRECTIONS.register(_name, CorrectionPreset(_args, _build))


# -- thresholds, parsed as verl parses them (rollout_corr_helper) -----------------------------------
def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def parse_is_threshold(spec: Any) -> tuple[float, Optional[float]]:
    """(upper, lower or None) of an IS threshold: a number C (truncation) or 'lower_upper'
    (IcePop); verl's `_parse_rollout_is_threshold`. ValueError (one line) otherwise."""
    if _is_number(spec):
        upper, lower = float(spec), None
    elif isinstance(spec, str) and spec.strip():
        text = spec.strip()
        try:
            if "_" in text:
                lo, hi = text.split("_", 1)
                lower, upper = float(lo), float(hi)
            else:
                upper, lower = float(text), None
        except ValueError:
            raise ValueError(f"{spec!r} is not a number or 'lower_upper'") from None
    else:
        raise ValueError(f"must be a number or a 'lower_upper' string, got {spec!r}")
    if not upper > 0:
        raise ValueError(f"upper bound must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"lower bound must be in (0, upper={upper}], got {lower}")
    return upper, lower


def rejection_options(rs: Optional[str]) -> list[str]:
    """The options of a comma-separated `rollout_rs`, duplicates removed (verl's order)."""
    out: list[str] = []
    for opt in (o.strip() for o in str(rs or "").split(",")):
        if not opt:
            continue
        if opt not in REJECTION_OPTIONS:
            raise ValueError(f"rejection option {opt!r} is not valid; allowed: {', '.join(REJECTION_OPTIONS)}")
        if opt not in out:
            out.append(opt)
    if not out:
        raise ValueError("rollout_rs names no rejection option")
    return out


def parse_rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[Optional[float], float]]:
    """{option: (lower or None, upper)} of `rollout_rs_threshold` (verl's
    `_parse_rollout_rs_thresholds`): one value per option (comma-separated) or one for all; a k1
    option reads 'lower_upper' (a single number u means [1/u, u]), the others one upper bound."""
    if _is_number(spec):
        raw = [str(spec)]
    elif isinstance(spec, str):
        raw = [p.strip() for p in spec.split(",") if p.strip()]
    else:
        raise ValueError(f"must be a number or a string, got {spec!r}")
    if len(raw) not in (1, len(options)):
        raise ValueError(f"needs one threshold for all options or one per option ({len(options)}), got {spec!r}")
    raw = raw * len(options) if len(raw) == 1 else raw
    out: dict[str, tuple[Optional[float], float]] = {}
    for opt, text in zip(options, raw):
        try:
            if opt.endswith("k1"):
                lo, hi = text.split("_", 1) if "_" in text else (str(1.0 / float(text)), text)
                lower, upper = float(lo), float(hi)
            elif "_" in text:
                raise ValueError(f"option {opt} takes one upper bound, not 'lower_upper' ({text!r})")
            else:
                lower, upper = None, float(text)
        except ZeroDivisionError:
            raise ValueError(f"option {opt}: threshold {text!r} must be > 0") from None
        except ValueError as e:
            if "takes one upper bound" in str(e):
                raise
            raise ValueError(f"option {opt}: threshold {text!r} is not a number or 'lower_upper'") from None
        if not upper > 0 or (lower is not None and not lower > 0):
            raise ValueError(f"option {opt}: thresholds must be > 0, got {text!r}")
        if lower is not None and lower > upper:
            raise ValueError(f"option {opt}: needs lower <= upper, got {text!r}")
        out[opt] = (lower, upper)
    return out


# -- name + options → fields ----------------------------------------------------------------------
def resolve(name: str, options: Optional[Mapping[str, Any]] = None) -> tuple[dict, dict]:
    """(verl's fields, the resolved options) of correction `name` with `options` over its
    arguments' defaults. ValueError (one line, naming the option) for an unknown name or option,
    a value of the wrong type, or thresholds verl would reject."""
    preset = ROLLOUT_CORRECTIONS[name]
    options = dict(options or {})
    allowed = dict(preset.args)
    if preset.build(**allowed)["rollout_is"] is not None:
        allowed["batch_normalize"] = False
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown[0]} is not an option of {name}; valid: {', '.join(allowed) or 'none'}")
    resolved = {**allowed, **options}
    for key, value in resolved.items():
        if key == "batch_normalize":
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
        elif key == "rs_threshold":
            if not (_is_number(value) or isinstance(value, str)):
                raise ValueError(f"{key} must be a number or a 'lower_upper' string, got {value!r}")
            resolved[key] = _canonical(value)
        elif not (_is_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"{key} must be a number > 0, got {value!r}")
        else:
            resolved[key] = float(value)
    out = preset.build(**{k: v for k, v in resolved.items() if k != "batch_normalize"})
    out["rollout_is_batch_normalize"] = bool(resolved.get("batch_normalize", False))
    _check_fields(out)
    return out, resolved


def _canonical(value: Any) -> Any:
    """A number as a float, a string that is one number too ('0.01' → 0.01; not '0.5_2', which
    Python's float() would read as 0.52); else the string."""
    if _is_number(value):
        return float(value)
    text = value.strip()
    try:
        return text if "_" in text else float(text)
    except ValueError:
        return text


def _check_fields(f: Mapping[str, Any]) -> None:
    key = "threshold" if f["rollout_rs"] is None else "is_threshold"
    if f["rollout_is"] is not None:
        try:
            parse_is_threshold(f["rollout_is_threshold"])
        except ValueError as e:
            raise ValueError(f"{key}_lower: {e}" if "lower bound" in str(e) else f"{key}: {e}") from None
    if f["rollout_rs"] is not None:
        try:
            parse_rs_thresholds(rejection_options(f["rollout_rs"]), f["rollout_rs_threshold"])
        except ValueError as e:
            raise ValueError(f"rs_threshold: {e}") from None
