"""`StppoPolicyLossConfig`: verl's `PolicyLossConfig` plus stppo's clip-bias knobs.

verl's `PolicyLossConfig` is a closed dataclass (`+…policy_loss.tau=…` fails at instantiation).
Name this subclass instead, with the knobs as new keys (PL = actor_rollout_ref.actor.policy_loss):

    PL._target_=stppo.integrations.verl.config.StppoPolicyLossConfig
    PL.loss_mode=stppo_st_ppo  +PL.tau=0.5  +PL.granularity=sequence  +PL.max_turns=4

Only what verl has no field for lives here: clip ranges stay verl's `actor.clip_ratio_low/high`,
the dual clip its `actor.clip_ratio_c`, the aggregation its `actor.loss_agg_mode`. stppo's
launcher sends the run's whole `LossSpec` instead of the knobs (`spec`, its `to_dict()`), and
for a researcher's preset from a package that is not installed the module that registers it
(`plugin`): the config then registers that preset's `stppo_<name>` loss in the process that
builds it (verl's driver and workers alike); installed plugins are loaded by the entry point.
Importing this module registers the built-in presets' losses (`plugin`), so the `_target_` alone
suffices where the entry point is disabled. Invalid knobs fail when verl instantiates the actor
config, with one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config import PolicyLossConfig

from stppo.integrations.verl import plugin  # noqa: F401 — first: registers, or warns and raises
from stppo.algos import PRESETS, ClipBias, LossSpec, resolve_options  # noqa: E402
from stppo.integrations.verl import LOSS_PREFIX, POLICY_LOSS_TARGET  # noqa: E402
from stppo.integrations.verl.losses import DEFAULT_MAX_TURNS, GRAD_ESTIMATOR_ERROR  # noqa: E402

TARGET = POLICY_LOSS_TARGET  # this class's dotted name (checked in tests/verl)


@dataclass
class StppoPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config with the clip-bias knobs of the stppo_* losses.

    tau: τ of the preset's clip-bias scale (None: the preset's, `stppo.algos.DEFAULT_TAU`).
    estimator: 'token' only — 'grad' needs the policy parameters, which verl's loss never sees.
    granularity: 'batch' (one λ per micro-batch under verl) or 'sequence' (λ_i per trajectory).
    options: the loss mode's options (e.g. sapo's tau_pos / tau_neg) over the preset's.
    max_turns: K of the per-turn metrics `turn/k{k}/*`, k < K (the launcher: task.max_turns, 0
        with diagnostics.per_turn=false); a diagnostic, so any loss mode accepts it.
    spec: the run's `LossSpec.to_dict()` (stppo's launcher sends it); over the knobs above.
    plugin: the module that registers the preset `spec` names (`algo.plugin`: a package that is
        not installed; installed ones are found by their entry point, `stppo.plugins`).
    """

    tau: Optional[float] = None
    estimator: str = "token"
    granularity: str = "batch"
    options: dict = field(default_factory=dict)
    max_turns: int = DEFAULT_MAX_TURNS
    spec: dict = field(default_factory=dict)
    plugin: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_turns, int) or self.max_turns < 0:
            raise ValueError(f"actor.policy_loss.max_turns must be an integer >= 0, got {self.max_turns!r}")
        if (self.spec or self.plugin) and self.loss_mode.startswith(LOSS_PREFIX):
            self._register_sent()  # (another loss mode — verl's own — ignores what stppo sent)
            return
        if self.estimator == "grad":
            raise ValueError(f"actor.policy_loss.estimator=grad: {GRAD_ESTIMATOR_ERROR}")
        if not self.loss_mode.startswith(LOSS_PREFIX):
            if (self.tau, self.estimator, self.granularity, dict(self.options)) != (None, "token", "batch", {}):
                raise ValueError(f"actor.policy_loss.tau/estimator/granularity act on the stppo_* "
                                 f"loss modes only, got loss_mode={self.loss_mode!r}")
            return
        name = self.loss_mode[len(LOSS_PREFIX):]
        if name not in PRESETS:
            raise ValueError(f"actor.policy_loss.loss_mode={self.loss_mode!r} is not an stppo "
                             f"loss; allowed: {', '.join(LOSS_PREFIX + p for p in PRESETS)}")
        p = PRESETS[name]
        try:
            if p.clip_bias != "none":
                ClipBias(p.clip_bias, p.tau if self.tau is None else self.tau, self.estimator,
                           self.granularity)
            resolve_options(p.loss_mode, {**p.options, **dict(self.options)})
        except ValueError as exc:
            raise ValueError(f"actor.policy_loss ({self.loss_mode}): {exc}") from None

    def _register_sent(self) -> None:
        """A spec (and plugin module) sent by stppo's launcher: validated, and its loss registered."""
        from stppo.integrations.verl.plugin import register
        from stppo.plugins import import_plugin

        spec = dict(self.spec)
        name = spec.get("name") or self.loss_mode[len(LOSS_PREFIX):]
        try:
            if self.plugin:
                import_plugin(self.plugin, f"actor.policy_loss.plugin={self.plugin!r}")
            loss = LossSpec.from_dict({**spec, "name": name})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"actor.policy_loss ({self.loss_mode}): {exc}") from None
        if loss.clip_bias is not None and loss.clip_bias.estimator == "grad":
            raise ValueError(f"actor.policy_loss.spec: {GRAD_ESTIMATOR_ERROR}")
        if self.loss_mode != LOSS_PREFIX + name:
            raise ValueError(f"actor.policy_loss.loss_mode={self.loss_mode!r} does not name the "
                             f"spec's preset {name!r} ({LOSS_PREFIX + name})")
        register([name])
