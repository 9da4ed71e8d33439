"""DAPO's batch-level pieces in the trainer (arXiv 2503.14476 §3.2, §3.4; docs/design.md §2, "DAPO"):
dynamic sampling with refill, then overlong reward shaping of the trajectory scores.

Dynamic sampling: the step's rollout of Q questions × G samples keeps the groups with reward
signal (`stppo.algos.groups_with_signal`); while fewer than Q groups are kept and at most
`max_rounds` times, ⌈missing × refill_factor⌉ more questions of the training pool are rolled out
(verl's replay buffer asks for twice the dropped count) and their groups with signal are added.
The batch is the first Q groups kept (surplus discarded, as verl). If the rounds run out first,
dropped groups fill the remaining places (`dynamic_sampling/filler_groups`) — verl's legacy
trainer raises instead; a fixed batch size keeps minibatches and data-parallel shards in step.
Every round is seeded from (seed, step, rank, round): a run stays reproducible.

Overlong shaping: score_i += `stppo.algos.overlong_penalty`(L_i) with L_i the trajectory's length
in tokens (prompt, turns and observations: what `trainer.rollout.max_total_tokens` limits) — the
multi-turn reading of DAPO's response length. Applied after dynamic sampling, which looks at the
raw scores (verl's DAPO recipe filters on accuracy).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Callable, Sequence

import torch

from stppo import metric_names as K
from stppo.algos import groups_with_signal, overlong_penalty
from stppo.batch import Batch, concat_batches, rows
from stppo.config import Config, DynamicSamplingConfig
from stppo.rollout.episodes import pad_token_id
from stppo.train.sampler import step_seed

def shape_batch(batch: Batch, cfg: Config, comps, step: int, salt: str,
                sample: Callable[[list, int], Batch]) -> tuple[Batch, dict[str, float]]:
    """The training batch from the step's rollout `batch` (the rollout itself when neither
    dynamic sampling nor overlong shaping is on) and their metrics. `comps`: the trainer's
    Components; `salt` tells data-parallel ranks apart; `sample(questions, round)` rolls out a
    refill, as the step's sampler does (`stppo.train.sampler`: the live policy or the step's
    older ones)."""
    a, metrics = cfg.algo, {}
    if a.dynamic_sampling.enabled:
        rng = random.Random(step_seed(cfg.seed, step, f"{salt}-refill-questions"))
        batch, metrics = refill(batch, sample, comps.task.split("train"), cfg.trainer.group_size,
                                a.dynamic_sampling, rng, pad_token_id(comps.tokenizer))
    if a.overlong.enabled:
        o = a.overlong
        pen = overlong_penalty(batch.attention_mask.sum(dim=1), cfg.trainer.rollout.max_total_tokens,
                               o.buffer_len, o.penalty_factor)  # (N,)
        batch = replace(batch, scores=batch.scores + pen.to(batch.scores.dtype))
        metrics.update({K.OVERLONG_PENALTY_MEAN: float(pen.mean()),
                        K.OVERLONG_FRAC: float((pen < 0).float().mean())})
    return batch, metrics


def refill(first: Batch, roll: Callable[[list, int], Batch], pool: Sequence, group_size: int,
           ds: DynamicSamplingConfig, rng: random.Random, pad_id: int) -> tuple[Batch, dict]:
    """Dynamic sampling (module docstring): `roll(questions, round)` rolls out a list of questions
    (each repeated `group_size` times); `pool` the questions to draw refills from."""
    need = len(group_order(first))
    keep = groups_with_signal(first.scores, first.group_ids)  # (N,)
    kept, dropped = [rows(first, keep)], [rows(first, ~keep)]
    n_kept, n_rolled, rounds = len(group_order(kept[0])), need, 0
    while n_kept < need and rounds < ds.max_rounds and pool:
        rounds += 1
        n_q = min(len(pool), math.ceil((need - n_kept) * ds.refill_factor))
        qs = [pool[i] for i in rng.sample(range(len(pool)), n_q)]
        b = roll([q for q in qs for _ in range(group_size)], rounds)
        keep = groups_with_signal(b.scores, b.group_ids)
        kept.append(rows(b, keep))
        dropped.append(rows(b, ~keep))
        n_kept += len(group_order(kept[-1]))
        n_rolled += n_q
    n_dropped = n_rolled - n_kept
    fill = max(0, need - n_kept)
    out = first_groups(concat_batches(kept + dropped, pad_id), need)
    return out, {K.DS_ROLLOUTS: float(1 + rounds), K.DS_GROUPS_ROLLED: float(n_rolled),
                 K.DS_GROUPS_DROPPED: float(n_dropped), K.DS_GROUPS_FILLED: float(fill)}


def group_order(batch: Batch) -> list[int]:
    """The batch's group ids in order of first appearance."""
    return list(dict.fromkeys(batch.group_ids.tolist()))


def first_groups(batch: Batch, n: int) -> Batch:
    """The rows of the first `n` groups (in order of appearance)."""
    chosen = torch.tensor(group_order(batch)[:n], dtype=batch.group_ids.dtype)
    return rows(batch, torch.isin(batch.group_ids, chosen))
