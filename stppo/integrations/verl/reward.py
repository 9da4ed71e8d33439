"""stppo's exact-match reward as verl's `custom_reward_function`
(`reward.custom_reward_function.path=pkg://stppo.integrations.verl.reward`, `.name=compute_score`).

verl's naive reward manager calls `compute_score(data_source, solution_str, ground_truth,
extra_info)` with `solution_str` = the decoded response: every agent turn *and* the tool
observations between them (no prompt). The score is stppo's (`stppo.envs.rewards.em_score`,
Search-R1's `qa_em`):

    r = 1[ normalize(a) ∈ { normalize(g) : g ∈ golds } ],   a = the episode's answer

where the answer is the content of the last `<answer>…</answer>` in the *agent's* text: the
observations the search tool returned (`<information>…</information>` blocks and the
invalid-action message, whose instructions quote '<answer> and </answer>') are removed first, so
that observation text can never be scored, as in the own trainer's environment. Search-R1's
`extract_solution` takes the last match too (it requires two because its string includes the
prompt's example answer; verl's does not include the prompt). No answer → 0.
Torch-free and verl-free.
"""

from __future__ import annotations

import re
from typing import Any

from stppo.envs.actions import INVALID_ACTION_OBSERVATION
from stppo.envs.rewards import em_score

_INFORMATION = re.compile(r"<information>.*?</information>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INVALID = INVALID_ACTION_OBSERVATION.strip()


def agent_text(solution_str: str) -> str:
    """The response with the tool's observations removed."""
    return _INFORMATION.sub(" ", solution_str).replace(_INVALID, " ")


def final_answer(solution_str: str) -> str | None:
    """Content of the last <answer>…</answer> of the agent's text (stripped), or None."""
    found = _ANSWER.findall(agent_text(solution_str))
    return found[-1].strip() if found else None


def golden_answers(ground_truth: Any) -> list[str]:
    """Gold answers from verl's `reward_model.ground_truth`: {'target': [...]}, a list or a str."""
    target = ground_truth.get("target", ground_truth) if isinstance(ground_truth, dict) else ground_truth
    if hasattr(target, "tolist"):  # numpy arrays from parquet
        target = target.tolist()
    if isinstance(target, str):
        return [target]
    if isinstance(target, (list, tuple)) and all(isinstance(g, str) for g in target):
        return list(target)
    raise ValueError(f"ground_truth must hold 'target': a string or a list of strings, got {ground_truth!r}")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> float:
    """1.0 when the episode's answer matches a gold answer (Search-R1's EM), else 0.0."""
    del data_source, extra_info, kwargs  # one reward for every source, as in the own trainer
    return em_score(final_answer(solution_str), golden_answers(ground_truth))
