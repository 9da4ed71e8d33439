"""Prompt styles.

  search_r1  Search-R1's base-model prompt (`scripts/data_process/nq_search.py`, `make_prefix`,
             template 'base'); the question is stripped and gets a '?' when it has none, as
             Search-R1's data processing does.
  chat       the same text as the user message of the tokenizer's chat template
             (`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`), as
             Search-R1 does for instruct models.
  compact    'Question: {q}\\n' — for tiny random-init models, which learn the format from the
             warm start instead of from instructions.
Multiple-choice questions (meta['options']) list their options after the question, one per line.
"""

from __future__ import annotations

from typing import Any

from stppo.envs.base import Question

PROMPT_STYLES = ("search_r1", "chat", "compact")

SEARCH_R1_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> "
    "and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Question: {question}\n"
)

COMPACT_TEMPLATE = "Question: {question}\n"


def question_body(question: Question, *, search_r1_mark: bool = False) -> str:
    """The question text, with the options of a multiple-choice question on following lines."""
    text = question.question.strip()
    if search_r1_mark and text and not text.endswith("?"):
        text += "?"
    options = question.meta.get("options")
    if options:
        text += "".join(f"\n{key}. {value}" for key, value in options.items())
    return text


def build_prompt(question: Question, style: str = "search_r1", tokenizer: Any = None) -> str:
    """The prompt string of `question` in `style` (one of PROMPT_STYLES)."""
    if style == "compact":
        return COMPACT_TEMPLATE.format(question=question_body(question))
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style={style!r} is not valid; allowed: {', '.join(PROMPT_STYLES)}")
    text = SEARCH_R1_TEMPLATE.format(question=question_body(question, search_r1_mark=True))
    if style == "search_r1":
        return text
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt_style='chat' needs a tokenizer with a chat_template; use "
                         "prompt_style='search_r1' or 'compact' for base and random-init models")
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
