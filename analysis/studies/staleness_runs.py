"""The runs of study v3 (docs/results/staleness/README.md, "Design"), sorted into its parts, and
its cells.

Each run gets the axis columns of `analysis.axes` (lag, lag mode, preset label with the rollout
correction), a `machine` (cpu | gpu) and a `part`:

    1  experiment `frontier_l1f`, model tiny, CPU — the staleness frontier;
    2  experiment `frontier_l2`, runs that logged `trainer.offpolicy.lag` (study v2's runs of that
       experiment did not, and are no part of v3);
    3  model size: `frontier_l1f` runs of another model (small, base) and every run of the GPU
       experiment `staleness_size_gpu` (tiny too; and a tiny `frontier_l1f` run on a GPU). Part 3's
   tiny on the CPU is part 1's tiny.

machine = gpu for the experiment `staleness_size_gpu` or a run whose param `trainer.device` starts
with `cuda`, cpu otherwise (`auto` on this CPU study): models are compared within one machine.
Runs still running (or scheduled) are left out: their last success is not a final one; a seed of
a cell run twice counts once (its first run). A cell is (part, machine, model, level, lag, lag
mode, preset label).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from stppo.config import param_names as P

from ..axes import with_axes
from ..params import param_column, param_values
from ..collapse import collapse_table
from .frontier import cell_table
from ..load import Study
from ..tables import MISMATCH_MEANS, per_run_table, repeated_seeds

L1F, L2, SIZE_GPU = "frontier_l1f", "frontier_l2", "staleness_size_gpu"
CPU, GPU = "cpu", "gpu"
PART1_LAGS = (0, 1, 2, 4, 8, 16, 24)
PART2_LAGS = (0, 2, 8)
PART3_LAGS = (0, 2, 8)
GAE_PRESETS = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo")
CRITIC_FREE = ("grpo", "so_grpo", "dapo", "bapo", "cispo", "dppo_tv", "sspo")
PART1_PRESETS = GAE_PRESETS + CRITIC_FREE
CORRECTIONS = ("decoupled_token_is", "decoupled_seq_is_rs", "decoupled_geo_rs", "decoupled_token_icepop")
COUPLED = "bypass_ppo_clip"
SIZE_PRESETS = ("ppo", "st_ppo", "grpo", "so_grpo")  # part 3's presets, and the coupled runs' (C6)
PART2_PRESETS = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo", "grpo", "gspo", "so_grpo", "dapo")
MODELS = ("tiny", "small", "base")  # in order of size
UNFINISHED = ("RUNNING", "SCHEDULED")
CELL_X = ("part", "machine", "model", "experiment", "lag", "lag_mode")
PARTS = {"1": f"part 1 ({L1F}, tiny, CPU)", "2": f"part 2 ({L2} runs with {P.LAG.path})",
         "3": f"part 3 ({L1F} small/base, {SIZE_GPU})"}


def machine_column(runs: pd.DataFrame, params: pd.DataFrame) -> pd.Series:
    """cpu | gpu per run (module docstring)."""
    device = param_column(runs, params, P.DEVICE).astype(str).str.lower()
    gpu = runs["experiment"].astype(str).eq(SIZE_GPU) | device.str.startswith("cuda")
    return gpu.map({True: GPU, False: CPU})


def part_column(runs: pd.DataFrame, params: pd.DataFrame) -> pd.Series:
    """"1" | "2" | "3" per run, None for runs of no part (module docstring); `runs` has `machine`."""
    exp, model = runs["experiment"].astype(str), runs["model"].astype(str)
    has_lag = param_values(runs, params, P.LAG).notna()
    part = pd.Series(None, index=runs.index, dtype=object)
    part[exp.isin([L1F, SIZE_GPU])] = "3"
    part[exp.eq(L1F) & model.eq("tiny") & runs["machine"].eq(CPU)] = "1"
    part[exp.eq(L2) & has_lag] = "2"
    return part


@dataclass
class StudyRuns:
    runs: pd.DataFrame  # per-run table (`per_run_table` + axes + machine, part) of the parts' finished runs
    unfinished: int  # runs of the parts left out because they are still running
    other: tuple[str, ...]  # experiments of the data whose runs belong to no part
    repeats: int = 0  # runs left out as repeats of a cell's seed (the first run is kept)


def study_runs(study: Study, collapse: pd.DataFrame | None = None) -> StudyRuns:
    """The per-run table of the study's parts (module docstring)."""
    every = with_axes(per_run_table(study, collapse if collapse is not None else collapse_table(study)), study.params)
    every["machine"] = machine_column(every, study.params).to_numpy()
    every["part"] = part_column(every, study.params).to_numpy()
    mine = every[every["part"].notna()]
    running = mine["status"].astype(str).isin(UNFINISHED)
    other = tuple(sorted(set(every.loc[every["part"].isna(), "experiment"].astype(str))))
    done = mine[~running]
    repeat = repeated_seeds(done, study, [*CELL_X, "algo", "seed"])
    kept = done[~repeat]
    return StudyRuns(kept.reset_index(drop=True), int(running.sum()), other, int(repeat.sum()))


def study_cells(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (part, machine, model, level, lag, lag mode, preset label): runs, collapse
    count and probability with its Wilson interval, median onset, final success with its bootstrap
    interval, peak grad norm, mean clip fraction and PPO KL, and the mean of each mismatch metric
    (`tables.MISMATCH_MEANS`)."""
    return cell_table(runs, x=CELL_X, means=tuple(MISMATCH_MEANS))
