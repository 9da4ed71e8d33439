"""Token layout of a trajectory, shared by the rollout engine and given-text episodes.

A trajectory is prompt, then per turn k: the agent's action tokens (in the loss, turn id k) and
the observation tokens (masked out, turn id −1). The observation after the last turn is not
appended (nothing is generated after it). `encode_episode` builds that layout from texts — the
oracle's demonstrations for the SFT warm start, hand-built episodes in tests; `collate_episodes`
right-pads encoded episodes into a `Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from stppo.batch import Batch
from stppo.envs.base import StepResult


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def encode_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """`encode_text` of each text, with one tokenizer call for all of them."""
    nonempty = [t for t in texts if t]
    encoded = iter(tokenizer(nonempty, add_special_tokens=False)["input_ids"] if nonempty else [])
    return [list(next(encoded)) if t else [] for t in texts]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids: the text without special tokens, plus BOS when the tokenizer defines one and
    its default encoding adds it (so a pretrained model sees the start it was trained with)."""
    ids = encode_text(tokenizer, text)
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        probe = tokenizer.encode("a", add_special_tokens=True)
        if probe and probe[0] == bos:
            ids = [bos] + ids
    return ids


@dataclass
class Trajectory:
    """One trajectory being built: token lists plus per-trajectory counters."""
    ids: list[int]
    loss: list[bool] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    num_turns: int = 0
    num_searches: int = 0
    num_valid: int = 0
    num_invalid: int = 0
    finished: bool = False
    truncated: bool = False
    answer: Optional[str] = None

    def __post_init__(self) -> None:
        n = len(self.ids) - len(self.loss)
        self.loss += [False] * n
        self.turn += [-1] * n
        self.logp += [0.0] * n

    def add_action(self, ids: Sequence[int], turn: int, logp: Optional[Sequence[float]] = None) -> None:
        self.ids += ids
        self.loss += [True] * len(ids)
        self.turn += [turn] * len(ids)
        self.logp += list(logp) if logp is not None else [0.0] * len(ids)
        self.num_turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.loss += [False] * len(ids)
        self.turn += [-1] * len(ids)
        self.logp += [0.0] * len(ids)

    def record(self, result: StepResult) -> None:
        """Count one judged turn (search / answer / invalid)."""
        self.num_searches += result.kind == "search"
        self.num_valid += result.kind != "invalid"
        self.num_invalid += result.kind == "invalid"
        if result.kind == "answer":
            self.answer = result.answer
            self.finished = bool(result.done)

    def cut(self, length: int) -> None:
        for name in ("ids", "loss", "turn", "logp"):
            setattr(self, name, getattr(self, name)[:length])


def encode_episode(tokenizer, prompt: str,
                   turns: Sequence[tuple[str, StepResult | str | None]]) -> dict[str, torch.Tensor]:
    """Texts → 1-D tensors `input_ids` (L,), `loss_mask` (L,) bool, `turn_ids` (L,) long.

    `turns` holds (action_text, result) pairs; result is a StepResult or an observation string.
    """
    traj = _encode(tokenizer, prompt, turns)
    return {"input_ids": torch.tensor(traj.ids, dtype=torch.long),
            "loss_mask": torch.tensor(traj.loss, dtype=torch.bool),
            "turn_ids": torch.tensor(traj.turn, dtype=torch.long)}


def _encode(tokenizer, prompt: str, turns: Sequence[tuple[str, Any]]) -> Trajectory:
    traj = Trajectory(encode_prompt(tokenizer, prompt))
    for k, (action, result) in enumerate(turns):
        traj.add_action(encode_text(tokenizer, action), k)
        traj.actions.append(action)
        obs = result.observation if isinstance(result, StepResult) else (result or "")
        if isinstance(result, StepResult):
            traj.record(result)
        if k < len(turns) - 1:
            traj.add_observation(encode_text(tokenizer, obs))
    return traj


def collate_episodes(tokenizer, episodes: Sequence[Any], *, group_ids: Optional[Sequence[int]] = None,
                     scores: Optional[Sequence[float]] = None) -> Batch:
    """Episodes (objects with `.prompt` and `.turns`, optional `.question`; or (prompt, turns)
    pairs) → a right-padded `Batch`, laid out exactly as `rollout` lays out its output."""
    trajs, questions = [], []
    for ep in episodes:
        prompt, turns = (ep.prompt, ep.turns) if hasattr(ep, "turns") else ep
        trajs.append(_encode(tokenizer, prompt, turns))
        questions.append(getattr(ep, "question", None))
    return pack_batch(trajs, questions, pad_id=pad_token_id(tokenizer), group_ids=group_ids,
                      scores=scores, with_log_probs=False)


def pad_token_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def group_ids_by_question(questions: Sequence[Any]) -> list[int]:
    """Same question id ⇒ same group id, numbered in order of first appearance."""
    seen: dict[Any, int] = {}
    out = []
    for i, q in enumerate(questions):
        key = q.id if q is not None else ("row", i)
        out.append(seen.setdefault(key, len(seen)))
    return out


def pack_batch(trajs: Sequence[Trajectory], questions: Sequence[Any], *, pad_id: int,
               group_ids: Optional[Sequence[int]] = None, scores: Optional[Sequence[float]] = None,
               with_log_probs: bool = True) -> Batch:
    """Right-pad trajectories into a `Batch` (N, T)."""
    n, t = len(trajs), max((len(tr.ids) for tr in trajs), default=0)
    if n == 0:
        raise ValueError("pack_batch: no trajectories (questions/episodes is empty)")
    if group_ids is None:
        group_ids = group_ids_by_question(questions)
    if len(group_ids) != n or (scores is not None and len(scores) != n):
        raise ValueError(f"group_ids/scores must have one entry per trajectory ({n})")
    ids = torch.full((n, t), pad_id, dtype=torch.long)
    attn = torch.zeros(n, t, dtype=torch.bool)
    loss = torch.zeros(n, t, dtype=torch.bool)
    turn = torch.full((n, t), -1, dtype=torch.long)
    logp = torch.zeros(n, t, dtype=torch.float32)
    for i, tr in enumerate(trajs):
        m = len(tr.ids)
        ids[i, :m] = torch.tensor(tr.ids, dtype=torch.long)
        attn[i, :m] = True
        loss[i, :m] = torch.tensor(tr.loss, dtype=torch.bool)
        turn[i, :m] = torch.tensor(tr.turn, dtype=torch.long)
        logp[i, :m] = torch.tensor(tr.logp, dtype=torch.float32)

    def col(attr: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(tr, attr) for tr in trajs], dtype=dtype)

    return Batch(
        input_ids=ids, attention_mask=attn, loss_mask=loss, turn_ids=turn,
        group_ids=torch.tensor(list(group_ids), dtype=torch.long),
        scores=torch.tensor(list(scores) if scores is not None else [0.0] * n, dtype=torch.float32),
        rollout_log_probs=logp if with_log_probs else None,
        num_turns=col("num_turns", torch.long), num_searches=col("num_searches", torch.long),
        num_valid=col("num_valid", torch.long), num_invalid=col("num_invalid", torch.long),
        finished=col("finished", torch.bool), truncated=col("truncated", torch.bool),
        response_length=loss.sum(1),
        meta={"question_ids": [q.id if q is not None else None for q in questions],
              "answers": [tr.answer for tr in trajs],
              "actions": [list(tr.actions) for tr in trajs]},
    )
