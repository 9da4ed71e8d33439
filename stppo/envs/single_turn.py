"""A single-turn environment: plain RL on completions.

The prompt is the question's text as it is; the episode is one generation, which ends at EOS or
at the rollout's per-turn token limit (`stop_tags` is empty: the tool tags do not end it); the
whole completion text is the answer, scored by a reward function of (question, completion). This
is the setting of TRL's `GRPOTrainer` with plain-text prompts, so that the two trainers can run
the same workload (benchmarks/bench_vs_trl.py).

The rollout engine reads an env's optional `stop_tags` (default `STOP_TAGS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from stppo.envs.base import Question, StepResult

RewardFn = Callable[[Question, str], float]


@dataclass(frozen=True)
class SingleTurnEnv:
    """`AgentEnv` of one turn: the completion is the answer, `reward(question, text)` its score."""
    reward: RewardFn
    max_turns: int = 1
    stop_tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_turns != 1:
            raise ValueError(f"SingleTurnEnv.max_turns={self.max_turns!r}; a single-turn env has 1")
        if not callable(self.reward):
            raise ValueError("SingleTurnEnv.reward must be a function "
                             "(question, completion) -> float")

    def prompt(self, question: Question) -> str:
        return question.question

    def step_batch(self, questions: Sequence[Question], actions: Sequence[str],
                   turns: Sequence[int]) -> list[StepResult]:
        return [StepResult("answer", "", True, answer=a) for a in actions]

    def score(self, question: Question, answer: str | None) -> float:
        return 0.0 if answer is None else float(self.reward(question, answer))
