"""verl's metric names → stppo's: the one table (also in docs/design.md, "verl backend").

verl's MLflow logger (`verl.utils.tracking._MlflowLoggingAdapter`) writes verl's keys into the
run, sanitised ('@' → '_at_'); the run monitor (`monitor.py`) copies the ones stppo reads under
stppo's names (`stppo.tracking` constants), step by step, so that sweeps, the collapse rule, the
analysis and the dashboard read a verl run exactly like an own run. Keys with the same name and
meaning in both (actor/pg_loss, actor/pg_clipfrac, …) need no copy and are listed in SAME_NAME.
Torch-free and verl-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from stppo import tracking as K


@dataclass(frozen=True)
class Copy:
    verl: str  # key in the run, as verl's MLflow logger writes it
    stppo: str  # stppo.tracking constant
    scale: float = 1.0  # stppo value = scale × verl value
    why: str = ""


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
# val/success_rate from val_key().
DERIVED: tuple[str, ...] = (K.SKIPPED_STEPS, K.COLLAPSE_DETECTED, K.COLLAPSE_STEP, K.VAL_SUCCESS_RATE)


def table_markdown(data_source: str = "<task>") -> str:
    """The mapping as a Markdown table (docs/design.md carries this output)."""
    rows = ["| verl key (in the run) | stppo key | value |", "|---|---|---|"]
    rows += [f"| `{c.verl}` | `{c.stppo}` | {'× ' + format(c.scale, 'g') if c.scale != 1 else 'same'}"
             f"{' — ' + c.why if c.why else ''} |" for c in TRAIN_COPIES]
    rows.append(f"| `{val_key(data_source)}` | `{K.VAL_SUCCESS_RATE}` | same — greedy validation EM |")
    rows.append(f"| `{'` or `'.join(NONFINITE_KEYS)}` non-finite | `{K.SKIPPED_STEPS}` | 1.0, else 0.0 |")
    return "\n".join(rows)
