"""`SearchEnv`: the Search-R1 agent environment (implements `stppo.envs.base.AgentEnv`).

One call of `step_batch` judges one turn of many episodes:
  <search>q</search>   → the top-k documents for q inside <information> tags (done=False);
  <answer>a</answer>   → observation '', done=True;
  anything else        → Search-R1's corrective observation (done=False), an invalid action.
When the turn is the episode's last (turns[i] + 1 >= max_turns) a non-answer ends the episode
with observation '' and nothing is retrieved for it. All searches of the call go to the retriever
in ONE call. The reward `score(question, answer)` reads only the agent's answer text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from stppo.envs.actions import INVALID_ACTION_OBSERVATION, format_information, parse_action
from stppo.envs.base import Question, Retriever, StepResult, Task
from stppo.envs.prompts import PROMPT_STYLES, build_prompt
from stppo.envs.rewards import em_score, mcq_score

REWARDS = ("em", "mcq")


@dataclass
class SearchEnv:
    retriever: Retriever
    max_turns: int = 4
    topk: int = 3
    prompt_style: str = "search_r1"  # one of PROMPT_STYLES
    reward: str = "em"  # em | mcq
    tokenizer: Any = None  # needed by prompt_style='chat' (its chat template)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env max_turns must be >= 1, got {self.max_turns}")
        if self.topk < 1:
            raise ValueError(f"env topk must be >= 1, got {self.topk}")
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style={self.prompt_style!r} is not valid; allowed: "
                             f"{', '.join(PROMPT_STYLES)}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward={self.reward!r} is not valid; allowed: {', '.join(REWARDS)}")
        # prompt_style='chat' without a tokenizer is allowed here (a caller may build the env
        # before loading the model's tokenizer); `prompt` then raises a clear error.

    @classmethod
    def for_task(cls, task: Task, retriever: Retriever, **settings: Any) -> "SearchEnv":
        """An env scoring with the task's reward kind."""
        return cls(retriever=retriever, reward=task.reward, **settings)

    def prompt(self, question: Question) -> str:
        return build_prompt(question, self.prompt_style, self.tokenizer)

    def step_batch(self, questions: Sequence[Question], actions: Sequence[str],
                   turns: Sequence[int]) -> list[StepResult]:
        """StepResults of one turn; `turns[i]` is the number of turns episode i has completed."""
        if not len(questions) == len(actions) == len(turns):
            raise ValueError(f"step_batch: questions ({len(questions)}), actions ({len(actions)}) "
                             f"and turns ({len(turns)}) must have the same length")
        bad = [t for t in turns if not 0 <= t < self.max_turns]
        if bad:
            raise ValueError(f"step_batch: turns must be in [0, max_turns={self.max_turns}), got "
                             f"{bad[0]} (an episode past its last turn is already done)")
        parsed = [parse_action(a) for a in actions]
        last = [t + 1 >= self.max_turns for t in turns]
        searching = [i for i, (kind, _) in enumerate(parsed) if kind == "search" and not last[i]]
        queries = [parsed[i][1] for i in searching]
        docs = self.retriever.retrieve(queries, self.topk) if queries else []  # ONE call
        if len(docs) != len(queries):
            raise ValueError(f"retriever returned {len(docs)} result lists for {len(queries)} queries")
        observation = dict(zip(searching, (format_information(d) for d in docs)))
        results = []
        for i, (kind, content) in enumerate(parsed):
            if kind == "answer":
                results.append(StepResult("answer", "", True, answer=content))
            elif kind == "search":
                results.append(StepResult("search", observation.get(i, ""), last[i], query=content))
            else:
                results.append(StepResult("invalid", "" if last[i] else INVALID_ACTION_OBSERVATION,
                                          last[i]))
        return results

    def score(self, question: Question, answer: str | None) -> float:
        """Outcome reward of the episode's last answer (None: no answer → 0)."""
        if self.reward == "mcq":
            return 0.0 if answer is None else mcq_score(answer, question.golden_answers[0],
                                                        question.meta.get("options", {}))
        return em_score(answer, question.golden_answers)
