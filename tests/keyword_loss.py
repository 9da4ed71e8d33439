"""`policy_loss` called with the spec's fields as keywords, as the algorithm tests write their
cases (`ratio_level=…, clip_low=…, clip_bias={…}`): the fields build a `LossSpec` (name 'test',
a critic-free estimator, so any loss mode is allowed), the rest are the call's own keywords
(`global_denoms`, `reduce`, `params`, `rollout_is_weights`, `clip_bias_grad_norm`)."""

from __future__ import annotations

from stppo.algos import LossSpec, resolve_clip_bias
from stppo.algos import policy_loss as _policy_loss

SPEC_FIELDS = ("ratio_level", "clip_low", "clip_high", "dual_clip", "loss_agg", "clip_bias",
               "loss_mode", "options")


def spec_of(**fields) -> LossSpec:
    """A LossSpec from `policy_loss`-style keywords (clip_bias: None, a mapping or ClipBias)."""
    fields = dict(fields)
    fields["clip_bias"] = resolve_clip_bias(fields.get("clip_bias"))
    if fields.get("options") is None:
        fields.pop("options", None)
    return LossSpec(name="test", advantage="grpo", use_critic=False, **fields)


def policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, **kw):
    """(loss, metrics) — and `.ratio`, `.clipped` — of `stppo.algos.policy_loss`."""
    spec = spec_of(**{k: kw.pop(k) for k in SPEC_FIELDS if k in kw})
    return _policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, spec, **kw)
