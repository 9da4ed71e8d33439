"""Data types shared by tasks, retrievers, the agent environment and the rollout engine.

The contract between `stppo.envs` and `stppo.rollout`:
  * a `Task` holds a corpus of `Doc`s and question splits;
  * a `Retriever` maps a batch of queries to ranked `Doc`s (one call per turn, all queries);
  * an `AgentEnv` turns a question into a prompt string and judges the text of one agent turn,
    returning a `StepResult` whose `observation` is the text appended after the turn (masked out
    of the loss). The engine keeps the sampled token ids; text is used only for parsing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

# The tool-use tags of Search-R1's format. Tokenizers trained by stppo make them special tokens.
TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
        "<information>", "</information>")
STOP_TAGS = ("</search>", "</answer>")  # a turn ends right after one of these (or EOS)


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """Search-R1's corpus form: '"Title"\\ntext'."""
        return f'"{self.title}"\n{self.text}'


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    golden_answers: tuple[str, ...]
    # Task-specific extras: data_source, hops, options (mcq), the oracle's plan (synthetic), …
    meta: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass
class Task:
    name: str
    corpus: list[Doc]
    splits: dict[str, list[Question]]  # 'sft' (warm start), 'train' (RL), 'val', 'test'
    reward: Literal["em", "mcq"] = "em"

    def split(self, name: str) -> list[Question]:
        if name not in self.splits:
            raise KeyError(f"task {self.name!r} has no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]


@dataclass(frozen=True)
class StepResult:
    kind: Literal["search", "answer", "invalid"]
    observation: str  # text appended after the turn ('' when the episode ends)
    done: bool
    query: str | None = None
    answer: str | None = None


class Retriever(Protocol):
    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Doc]]: ...


class AgentEnv(Protocol):
    max_turns: int

    def prompt(self, question: Question) -> str: ...

    def step_batch(self, questions: Sequence[Question], actions: Sequence[str],
                   turns: Sequence[int]) -> list[StepResult]: ...

    def score(self, question: Question, answer: str | None) -> float: ...
