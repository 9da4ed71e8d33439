"""Prompt styles.

  search_r1  Search-R1's base-model prompt (`scripts/data_process/nq_search.py`, `make_prefix`,
             template 'base'); the question is stripped and gets a '?' when it has none, as
             Search-R1's data processing does.
  chat       the same text as the user message of the tokenizer's chat template
             (`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`), as
             Search-R1 does for instruct models.
  instruct   the chat template with a short instruction that names the tags as its system
             message and the question as the user message (INSTRUCT_SYSTEM): for small
             instruct models on a CPU, where every prompt token is paid for in each rollout and
             update (76 tokens for a 2-hop question in SmolLM2's template, 156 for `chat`).
  compact    'Question: {q}\\n' — for tiny random-init models, which learn the format from the
             warm start instead of from instructions.
Multiple-choice questions (meta['options']) list their options after the question, one per line.
"""

from __future__ import annotations

from typing import Any

from stppo.envs.base import Question

PROMPT_STYLES = ("search_r1", "chat", "instruct", "compact")
CHAT_STYLES = ("chat", "instruct")  # rendered with the tokenizer's chat template

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

# `instruct`: the instruction is the system message (it replaces a template's default system
# prompt) and the question the user message.
INSTRUCT_SYSTEM = (
    "Answer the question. To look something up, write <search> query </search>; the results come "
    "back between <information> and </information>. Search as often as you need, then give only "
    "the answer as <answer> answer </answer>."
)


def question_body(question: Question, *, search_r1_mark: bool = False) -> str:
    """The question text, with the options of a multiple-choice question on following lines."""
    text = question.question.strip()
    if search_r1_mark and text and not text.endswith("?"):
        text += "?"
    options = question.meta.get("options")
    if options:
        text += "".join(f"\n{key}. {value}" for key, value in options.items())
    return text


def chat_messages(question: Question, style: str) -> list[dict[str, str]]:
    """The chat messages of a chat style (CHAT_STYLES): what the tokenizer's template renders here,
    and what verl's rows carry (verl applies the template itself)."""
    if style == "instruct":
        return [{"role": "system", "content": INSTRUCT_SYSTEM},
                {"role": "user", "content": f"Question: {question_body(question)}"}]
    if style == "chat":
        return [{"role": "user", "content": SEARCH_R1_TEMPLATE.format(
            question=question_body(question, search_r1_mark=True))}]
    raise ValueError(f"prompt_style={style!r} is not a chat style; chat styles: {', '.join(CHAT_STYLES)}")


def build_prompt(question: Question, style: str = "search_r1", tokenizer: Any = None) -> str:
    """The prompt string of `question` in `style` (one of PROMPT_STYLES)."""
    if style == "compact":
        return COMPACT_TEMPLATE.format(question=question_body(question))
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style={style!r} is not valid; allowed: {', '.join(PROMPT_STYLES)}")
    if style == "search_r1":
        return SEARCH_R1_TEMPLATE.format(question=question_body(question, search_r1_mark=True))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt_style={style!r} needs a tokenizer with a chat_template; use "
                         "prompt_style='search_r1' or 'compact' for base and random-init models")
    messages = chat_messages(question, style)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
