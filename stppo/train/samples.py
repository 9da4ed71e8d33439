"""Sampled trajectories as MLflow tables (docs/design.md §4, "Sampled trajectories").

Every `diagnostics.samples_every` steps, and at the detected collapse, M trajectories of the
step's batch are logged as the table artifact `samples/step_{step:06d}.json`: one row per
segment (prompt, each agent turn, each observation) with its text, the parsed action of agent
turns, the trajectory's reward, and per agent turn the importance ratio of the updated policy to
π_old (mean and max over the turn's tokens) and the mean advantage.

The M trajectories are the first row of each of the first M groups (M different questions). A
collapse is detected `collapse.patience` steps after its onset, so the recorder keeps the tables
of the last `patience` steps in memory and, when the detector fires, writes those from the onset
on (with `collapse_step` set): the samples of the moment things went wrong, not only the ones
after. Capturing costs one no-grad forward of M rows and their decoding per step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pandas as pd
import torch

from stppo import metric_names as K
from stppo.batch import Batch
from stppo.envs.actions import parse_action
from stppo.models import Precision, policy_log_probs


def sample_rows(batch: Batch, count: int) -> list[int]:
    """The first row of each of the first `count` groups (in batch order)."""
    first: dict[int, int] = {}
    for i, g in enumerate(batch.group_ids.tolist()):
        if g not in first:
            first[g] = i
            if len(first) == count:
                break
    return list(first.values())


def segments(loss_mask: torch.Tensor, turn_ids: torch.Tensor, length: int) -> list[tuple[str, int, int, int]]:
    """(role, turn, start, end) runs of one trajectory's first `length` positions: the prompt
    (before the first agent token), agent turns (turn id k) and observations (between turns)."""
    runs: list[tuple[str, int, int, int]] = []
    seen_agent = False
    mask, turns = loss_mask[:length].tolist(), turn_ids[:length].tolist()
    for t, (agent, k) in enumerate(zip(mask, turns)):
        role = "agent" if agent else ("observation" if seen_agent else "prompt")
        seen_agent |= bool(agent)
        turn = int(k) if agent else -1
        if runs and runs[-1][0] == role and runs[-1][1] == turn:
            runs[-1] = (role, turn, runs[-1][2], t + 1)
        else:
            runs.append((role, turn, t, t + 1))
    return runs


def sample_table(batch: Batch, rows: list[int], new_log_probs: torch.Tensor,
                 old_log_probs: torch.Tensor, tokenizer, questions: dict[str, Any], step: int,
                 collapse_step: int = -1) -> pd.DataFrame:
    """The table of the module docstring for `rows` of `batch`; `new_log_probs`, `old_log_probs`
    (len(rows), T): log-probs of those rows under the updated policy and under π_old."""
    out = []
    for j, i in enumerate(rows):
        length = int(batch.attention_mask[i].sum())
        qid = batch.meta.get("question_ids", [None] * len(batch))[i]
        q = questions.get(qid)
        head = (step, j, q.question if q else "", " | ".join(q.golden_answers) if q else "",
                float(batch.scores[i]))
        agent = batch.turn_ids[i] >= 0  # the agent tokens (a rollout correction may reject some from the loss)
        for seg, (role, turn, a, b) in enumerate(segments(agent, batch.turn_ids[i], length)):
            text = tokenizer.decode(batch.input_ids[i, a:b].tolist(), skip_special_tokens=False)
            ratio_mean = ratio_max = adv = float("nan")
            action = ""
            if role == "agent":
                action = parse_action(text)[0]
                rho = (new_log_probs[j, a:b] - old_log_probs[j, a:b]).double().exp()
                ratio_mean, ratio_max = float(rho.mean()), float(rho.max())
                if batch.advantages is not None:
                    adv = float(batch.advantages[i, a:b].double().mean())
            out.append((*head, seg, role, turn, text, action, ratio_mean, ratio_max, adv, collapse_step))
    return pd.DataFrame(out, columns=list(K.SAMPLE_COLUMNS))


class SampleRecorder:
    """Captures the sample table of every step, keeps the last `keep`, and says which to write."""

    def __init__(self, every: int, count: int, keep: int, tokenizer, questions: dict[str, Any],
                 precision: Precision = Precision()) -> None:
        self.every, self.count, self.tokenizer, self.questions = every, count, tokenizer, questions
        self.precision = precision
        self.recent: deque[tuple[int, pd.DataFrame]] = deque(maxlen=max(1, keep))
        self.written: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.count > 0

    @torch.no_grad()
    def capture(self, step: int, batch: Batch, policy) -> None:
        """After the step's update: the table of its sample rows under the updated policy."""
        if not self.enabled:
            return
        rows = sample_rows(batch, self.count)
        idx = torch.tensor(rows, dtype=torch.long)
        mb = batch.select(idx)
        was = policy.training
        policy.eval()
        with self.precision.autocast():
            new = policy_log_probs(policy, mb.input_ids, mb.attention_mask, positions=mb.turn_ids >= 0)
        policy.train(was)
        # π_old: the recomputed log-probs, or — when the update took them from its own forward
        # (on-policy) — the sampler's, which are π_old's up to numerics.
        old = mb.old_log_probs if mb.old_log_probs is not None else mb.rollout_log_probs
        table = sample_table(batch, rows, new, old if old is not None else new, self.tokenizer,
                             self.questions, step)
        self.recent.append((step, table))

    def due(self, step: int, collapse_step: int | None, detected_now: bool) -> list[tuple[int, pd.DataFrame]]:
        """The tables to write after `step`: this step's when it is a sampling step; at the step
        the collapse is detected, every kept table from the onset on (collapse_step set)."""
        if not self.enabled or not self.recent:
            return []
        chosen = []
        if detected_now and collapse_step is not None:
            chosen = [(s, t) for s, t in self.recent if s >= collapse_step]
        elif step % self.every == 0 and self.recent[-1][0] == step:
            chosen = [self.recent[-1]]
        chosen = [(s, t) for s, t in chosen if s not in self.written]
        for _, t in chosen:
            t["collapse_step"] = -1 if collapse_step is None else int(collapse_step)
        self.written += [s for s, _ in chosen]
        return chosen
