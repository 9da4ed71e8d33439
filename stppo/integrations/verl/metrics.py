"""verl's metric names → stppo's: the one table (also in docs/design.md, "verl backend").

verl's MLflow logger (`verl.utils.tracking._MlflowLoggingAdapter`) writes verl's keys into the
run, sanitised ('@' → '_at_'); the run monitor (`monitor.py`) copies the ones stppo reads under
stppo's names (`stppo.metric_names` constants), step by step, so that sweeps, the collapse rule, the
alarms, the analysis and the dashboard read a verl run exactly like an own run. Three kinds:

- TRAIN_COPIES: verl's own trainer metrics (score, turns, advantages, timing), one by one;
- LOSS_COPIES: the metrics of stppo's policy loss outside `actor/`. verl's trainer logs the actor
  update's metrics through `rename_dict(metrics, "actor/")`, which prefixes every key not starting
  with `actor/` (`as_logged`): `clip_bias/norm` is in the run as `actor/clip_bias/norm`. The list
  is every `stppo.metric_names` key outside `actor/`, so a new loss metric needs no entry here; one
  that no loss returns is never in the run and costs nothing;
- `turn_copies(K)`: the per-turn keys, which the loss returns weighted by their turn's tokens
  (`losses.verl_turn_metrics`) and the monitor divides back.

Keys with the same name and meaning in both (actor/pg_loss, actor/pg_clipfrac, …) need no copy
and are listed in SAME_NAME. Torch-free and verl-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from stppo import metric_names as K


@dataclass(frozen=True)
class Copy:
    verl: str  # key in the run, as verl's MLflow logger writes it
    stppo: str  # stppo.metric_names constant
    scale: float = 1.0  # stppo value = scale × verl value
    why: str = ""
    per: str = ""  # divide by this key's value at the same step (no value where it is 0)


ACTOR_PREFIX = "actor/"


def as_logged(key: str) -> str:
    """An actor-update metric as verl's trainer logs it: `actor/` + key unless it starts with it
    (`verl.utils.py_functional.rename_dict(metrics, "actor/")` in `RayPPOTrainer._update_actor`)."""
    return key if key.startswith(ACTOR_PREFIX) else ACTOR_PREFIX + key


# The per-turn metrics stppo's verl loss returns: `tokens` as is, the others weighted by it; no
# entropy and no rollout_kl (verl passes a policy loss neither the entropy nor the sampler's
# log-probs beside π_old).
TURN_WEIGHT = "tokens"
TURN_UNAVAILABLE: tuple[str, ...] = ("entropy", "rollout_kl")
TURN_WEIGHTED: tuple[str, ...] = tuple(n for n in K.TURN_METRICS if n not in (TURN_WEIGHT, *TURN_UNAVAILABLE))


def val_key(data_source: str, n: int = 1) -> str:
    """verl's core validation metric for a float reward: `val-core/<data_source>/acc/mean@<n>`
    (`RayPPOTrainer._val_metrics_update`; the naive reward manager records a float score as
    'acc'), as MLflow stores it ('@' sanitised to '_at_')."""
    return f"val-core/{data_source}/acc/mean_at_{n}"


TRAIN_COPIES: tuple[Copy, ...] = (
    Copy("critic/score/mean", K.SUCCESS_RATE, why="mean outcome score (EM) of the step's trajectories, before any KL penalty"),
    Copy("num_turns/mean", K.NUM_TURNS_MEAN, 0.5,
         why="verl counts prompt + assistant + tool messages = 2 × agent turns in the tool agent loop"),
    Copy("critic/advantages/mean", K.ADV_MEAN), Copy("critic/advantages/max", K.ADV_MAX),
    Copy("critic/advantages/min", K.ADV_MIN), Copy("critic/returns/mean", K.RETURNS_MEAN),
    Copy("critic/values/mean", K.VALUES_MEAN),
    Copy("timing_s/step", K.STEP_TIME), Copy("timing_s/gen", K.ROLLOUT_TIME),
)

LOSS_COPIES: tuple[Copy, ...] = tuple(Copy(as_logged(k), k) for k in K.ALL_METRICS
                                      if not k.startswith(ACTOR_PREFIX))


def turn_copies(max_turns: int) -> tuple[Copy, ...]:
    """The per-turn copies for turns 0..max_turns−1 (see the module docstring)."""
    out = []
    for k in range(max_turns):
        weight = as_logged(K.turn_key(k, TURN_WEIGHT))
        out.append(Copy(weight, K.turn_key(k, TURN_WEIGHT)))
        out += [Copy(as_logged(K.turn_key(k, n)), K.turn_key(k, n), per=weight) for n in TURN_WEIGHTED]
    return tuple(out)


def namespace_copies(namespace: str, logged) -> tuple[Copy, ...]:
    """A researcher's stabiliser's own metrics (`<namespace>/…`, stppo.algos.plugins): every key
    of the run that verl logged as `actor/<namespace>/…`, back under its own name."""
    head = as_logged(f"{namespace}/")
    return tuple(Copy(k, k[len(ACTOR_PREFIX):]) for k in sorted(logged) if k.startswith(head))


def copy_values(copies: tuple[Copy, ...], verl: Mapping[str, float]) -> dict[str, float]:
    """stppo's values of one step from verl's (`verl`: key → value at that step)."""
    out = {}
    for c in copies:
        if c.verl not in verl:
            continue
        if not c.per:
            out[c.stppo] = c.scale * verl[c.verl]
        elif verl.get(c.per, 0.0) != 0.0:
            out[c.stppo] = c.scale * verl[c.verl] / verl[c.per]
    return out


# The step is ready once this key is in the run (verl logs a step's metrics in one call).
STEP_KEY = "critic/score/mean"
# A step whose update is non-finite: verl skips the optimizer step; stppo logs actor/skipped_steps.
NONFINITE_KEYS: tuple[str, ...] = ("actor/grad_norm", "actor/pg_loss")

SAME_NAME: tuple[str, ...] = (
    K.PG_LOSS, K.PG_CLIPFRAC, K.PPO_KL, K.ENTROPY, K.GRAD_NORM, K.LR, K.VF_LOSS, K.VF_CLIPFRAC,
    K.VF_EXPLAINED_VAR, K.CRITIC_GRAD_NORM,
    K.RESPONSE_LENGTH_MEAN,  # verl: agent + tool tokens of the response; own: agent tokens only
    K.RESPONSE_LENGTH_CLIP_RATIO,
)

# Logged by the monitor itself (as the own trainer does): actor/skipped_steps (1.0 at a step
# whose grad norm or loss is non-finite), collapse/detected every step, collapse/step once,
# alarm/<indicator> at the step an online alarm fires, val/success_rate from val_key().
DERIVED: tuple[str, ...] = (K.SKIPPED_STEPS, K.COLLAPSE_DETECTED, K.COLLAPSE_STEP, K.alarm_key("<indicator>"),
                            K.VAL_SUCCESS_RATE)


def table_markdown(data_source: str = "<task>") -> str:
    """The mapping as a Markdown table (docs/design.md carries this output)."""
    rows = ["| verl key (in the run) | stppo key | value |", "|---|---|---|"]
    rows += [f"| `{c.verl}` | `{c.stppo}` | {'× ' + format(c.scale, 'g') if c.scale != 1 else 'same'}"
             f"{' — ' + c.why if c.why else ''} |" for c in TRAIN_COPIES]
    rows.append(f"| `{as_logged('<key>')}`, for every §4 key `<key>` outside `{ACTOR_PREFIX}` "
                f"(`{LOSS_COPIES[0].verl}`, …) | `<key>` | same — a metric of stppo's policy loss; verl's "
                f"trainer prefixes `{ACTOR_PREFIX}` to every actor-update metric outside `{ACTOR_PREFIX}` |")
    weight = as_logged(K.turn_key(0, TURN_WEIGHT)).replace("k0", "k{k}")
    rows.append(f"| `{weight}` | `{K.TURN_PREFIX}{{k}}/{TURN_WEIGHT}` | same — k < `task.max_turns` |")
    rows.append(f"| `{as_logged(K.TURN_PREFIX)}{{k}}/<name>` ÷ `{weight}`, <name> ∈ {', '.join(TURN_WEIGHTED)} "
                f"| `{K.TURN_PREFIX}{{k}}/<name>` | the loss returns each per-turn value × its turn's agent tokens "
                f"per row; none where turn k has no token |")
    rows.append(f"| `{val_key(data_source)}` | `{K.VAL_SUCCESS_RATE}` | same — greedy validation EM |")
    rows.append(f"| `{'` or `'.join(NONFINITE_KEYS)}` non-finite | `{K.SKIPPED_STEPS}` | 1.0, else 0.0 |")
    return "\n".join(rows)
