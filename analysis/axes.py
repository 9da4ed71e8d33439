"""The axes of a stability study, read from the runs (docs/results/frontier/README.md):

* level — the run's MLflow experiment (`frontier_l1`, …): how far the update moves from the
  policy that sampled (actor lr × PPO epochs × minibatches, `conf/level/`);
* lag — the param `trainer.offpolicy.lag` (k ≥ 0: the batch of step t was sampled by the policy
  k updates older than the one it trains, θ_{t−1−k}; docs/design.md §8); a run logged before
  the setting existed has lag 0 (`stppo.config.param_names`). Its `trainer.offpolicy.lag_mode` (fixed |
  uniform) is kept as a dimension of its own: a lag-k cell of each mode is a cell;
* correction — the param `algo.rollout_correction` (`none`, also for runs logged before it existed): a preset run
  with a correction is a series of its own, labelled `preset+correction` (`grpo+decoupled_geo_rs`).

`with_axes` adds these as columns of a per-run table (`tables.per_run_table`); the frontier's
cells are (x, preset label) for x the columns of one axis of `AXES`.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from stppo.config import param_names as P

from .params import param_column

NO_CORRECTION = P.ROLLOUT_CORRECTION.legacy
DEFAULT_LAG_MODE = P.LAG_MODE.legacy
# axis -> the per-run columns that make the x of a cell (`experiment` is shown as `level`)
AXES: dict[str, tuple[str, ...]] = {"level": ("experiment",), "lag": ("lag", "lag_mode"),
                                    "both": ("experiment", "lag", "lag_mode")}
AXIS_COLUMNS = ("lag", "lag_mode", "correction", "base_algo", "critic_warmstart")


def preset_label(algo: str, correction: str | None = None) -> str:
    """`algo`, or `algo+correction` when a rollout correction is set."""
    c = str(correction or NO_CORRECTION)
    return str(algo) if c in ("", NO_CORRECTION, "None") else f"{algo}+{c}"


def base_preset(label: str) -> str:
    """The preset of a label of `preset_label` (`grpo+decoupled_geo_rs` -> `grpo`)."""
    return str(label).split("+", 1)[0]


def with_axes(runs: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """A copy of a per-run table with the axis columns: `lag` (int), `lag_mode`, `correction`,
    `critic_warmstart` (bool), `base_algo` (the run's preset tag) and `algo` set to the preset
    label (`preset_label`). Idempotent."""
    if "base_algo" in runs.columns:
        return runs
    out = runs.copy()
    out["lag"] = pd.to_numeric(param_column(out, params, P.LAG)).astype(int).to_numpy()
    out["lag_mode"] = param_column(out, params, P.LAG_MODE).to_numpy()
    out["correction"] = param_column(out, params, P.ROLLOUT_CORRECTION).to_numpy()
    warm = param_column(out, params, P.CRITIC_WARMSTART).str.lower().eq("true")
    out["critic_warmstart"] = warm.to_numpy() | out["experiment"].astype(str).str.startswith("critic_ws_").to_numpy()
    out["base_algo"] = out["algo"].astype(str)
    out["algo"] = [preset_label(a, c) for a, c in zip(out["base_algo"], out["correction"])]
    return out


def axis_columns(axis: str) -> tuple[str, ...]:
    if axis not in AXES:
        raise ValueError(f"unknown frontier axis {axis!r}; valid: {', '.join(AXES)}")
    return AXES[axis]


def axis_names(x: Sequence[str]) -> list[str]:
    """The names of a cell's x columns in the tables: the experiment is the level."""
    return ["level" if c == "experiment" else c for c in x]


def as_tuple(key) -> tuple:
    """A groupby key as a tuple (pandas gives a scalar for one column in some versions)."""
    return key if isinstance(key, tuple) else (key,)


def varies(runs: pd.DataFrame, column: str) -> bool:
    """Whether `column` takes more than one value among `runs` (False when it is absent)."""
    return column in runs.columns and runs[column].astype(str).nunique() > 1


def lag_order(values: Sequence) -> list[int]:
    """The distinct lags, ascending."""
    return sorted({int(v) for v in values if v == v})


def lag_label(lag: int, mode: str | None = None) -> str:
    """`lag k` (with the mode when it is not the default: `lag 4 uniform`)."""
    return f"lag {int(lag)}" + ("" if mode in (None, DEFAULT_LAG_MODE) else f" {mode}")


def split_label(runs: pd.DataFrame, columns: Sequence[str]) -> pd.Series:
    """Per run: its preset label with the values of `columns` that vary among `runs` appended
    (`grpo · lag 2`, `ppo · frontier_l3 · lag 4 uniform`); the preset label alone otherwise."""
    label = runs["algo"].astype(str)
    for col in columns:
        if col == "lag" and varies(runs, "lag"):  # with its mode where the modes vary and are asked for
            with_mode = "lag_mode" in columns and varies(runs, "lag_mode")
            modes = runs["lag_mode"] if with_mode else [None] * len(runs)
            label = label + " · " + pd.Series([lag_label(k, m) for k, m in zip(runs["lag"], modes)],
                                              index=runs.index)
        elif col not in ("lag", "lag_mode") or (col == "lag_mode" and "lag" not in columns):
            label = label + (" · " + runs[col].astype(str) if varies(runs, col) else "")
    return label

