"""The pre-specified contrasts C1–C8 of study v3 (docs/results/staleness/README.md, "Pre-specified
contrasts"), as written before the main runs, evaluated by `analysis.contrasts` on the per-run
table of `analysis.studies.staleness_runs.study_runs`: one row per lag (the README's "at") and
pair of groups, final success as the outcome.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from .. import contrasts as engine
from ..contrasts import Contrast, ContrastResult, Group
from .staleness_runs import (CORRECTIONS, COUPLED, CPU, CRITIC_FREE, GAE_PRESETS, GPU, L1F, PART1_LAGS,
                             PART2_PRESETS, PART3_LAGS, PARTS, SIZE_GPU, SIZE_PRESETS)

__all__ = ["CONTRASTS", "CONTRAST_COLUMNS", "Contrast", "ContrastResult", "Group", "contrast_table",
           "contrasts_markdown"]


def _algos(presets: Sequence[str], label: str | None = None) -> Group:
    return Group(label or ", ".join(presets), {"algo": tuple(presets)})


PART1 = {"part": ("1",), "lag_mode": ("fixed",)}
STALE_LAGS = tuple(k for k in PART1_LAGS if k >= 1)
SIZE_CPU = {"experiment": (L1F,), "machine": (CPU,), "lag_mode": ("fixed",)}
SIZE_GPU_SCOPE = {"experiment": (SIZE_GPU,), "machine": (GPU,), "lag_mode": ("fixed",)}


def _size_pairs(a: str, b: str) -> tuple[tuple[Group, Group], ...]:
    return tuple((Group(f"{a} {p}", {"model": (a,), "algo": (p,)}), Group(f"{b} {p}", {"model": (b,), "algo": (p,)}))
                 for p in SIZE_PRESETS)


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("C1", "corrected GAE presets (s_ppo, st_ppo, so_ppo) vs uncorrected (ppo, turn_ppo)",
             "each lag ≥ 1, part 1", "no difference: at l1f their corrections see π_θ / π_old ≡ 1",
             PART1, PARTS["1"], STALE_LAGS, ((_algos(("s_ppo", "st_ppo", "so_ppo")), _algos(("ppo", "turn_ppo"))),)),
    Contrast("C2", "turn-level ratios (turn_ppo, st_ppo) vs token-level (ppo, s_ppo)",
             "each lag ≥ 1, part 1", "no difference (the same reason)",
             PART1, PARTS["1"], STALE_LAGS, ((_algos(("turn_ppo", "st_ppo")), _algos(("ppo", "s_ppo"))),)),
    Contrast("C3", "critic (the five GAE presets) vs critic-free (grpo, so_grpo, dapo, bapo, cispo, dppo_tv, sspo)",
             "each lag ≥ 1, part 1", "v2 found the critic set the frontier; open here",
             PART1, PARTS["1"], STALE_LAGS,
             ((_algos(GAE_PRESETS, "critic (GAE)"), _algos(CRITIC_FREE, "critic-free")),)),
    Contrast("C4", "grpo + each correction vs grpo", "each lag ≥ 1, part 1",
             "the corrections lower the collapse probability at large lags",
             PART1, PARTS["1"], STALE_LAGS, tuple((_algos((f"grpo+{c}",)), _algos(("grpo",))) for c in CORRECTIONS)),
    Contrast("C5", "bapo vs grpo; dppo_tv vs grpo", "each lag ≥ 1, part 1",
             "bapo: none at l1f (its bounds act on π_θ / π_old); dppo_tv: open",
             PART1, PARTS["1"], STALE_LAGS, ((_algos(("bapo",)), _algos(("grpo",))),
                                             (_algos(("dppo_tv",)), _algos(("grpo",))))),
    Contrast("C6", f"coupled ({COUPLED}) vs decoupled, per preset (ppo, st_ppo, grpo, so_grpo)", "lags 4, 16",
             "coupled collapses less",
             PART1, PARTS["1"], (4, 16), tuple((_algos((f"{p}+{COUPLED}",)), _algos((p,))) for p in SIZE_PRESETS)),
    Contrast("C7", "lag k vs lag 0, pooled over part 2's presets", "l2, k ∈ {2, 8}",
             "staleness adds to epochs: more collapse",
             {"part": ("2",), "lag_mode": ("fixed",), "algo": PART2_PRESETS}, PARTS["2"], (2, 8),
             ((Group("lag {lag}", {}), Group("lag 0", {"lag": (0,)})),), matched="algo"),
    Contrast("C8", "small vs tiny, per preset", "part 3's two lags", "open",
             SIZE_CPU, f"small runs of {L1F} on the CPU (part 3)", PART3_LAGS, _size_pairs("small", "tiny")),
    Contrast("C8-gpu", "base vs small and small vs tiny, per preset, within the GPU experiment", "part 3's lags",
             "open (added where GPU runs exist)", SIZE_GPU_SCOPE, f"GPU runs ({SIZE_GPU})", PART3_LAGS,
             _size_pairs("base", "small") + _size_pairs("small", "tiny"), conditional=True),
)
CONTRAST_COLUMNS = engine.contrast_columns("lag")


def contrast_table(runs: pd.DataFrame, contrasts: Sequence[Contrast] = CONTRASTS, *, n_boot: int = 10_000,
                   seed: int = 0) -> ContrastResult:
    """Every contrast of `contrasts` on the per-run table `runs` (`analysis.contrasts`)."""
    return engine.contrast_table(runs, contrasts, n_boot=n_boot, seed=seed)


def contrasts_markdown(table: pd.DataFrame, contrasts: Sequence[Contrast] = CONTRASTS) -> str:
    """`table` (CONTRAST_COLUMNS) as one Markdown table per contrast, in the README's layout."""
    return engine.contrasts_markdown(table, contrasts)
