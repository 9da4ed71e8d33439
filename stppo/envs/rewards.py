"""Outcome rewards: exact match (Search-R1's `qa_em`) and multiple-choice option letters.

EM:  r = 1[ ∃ g ∈ golds : normalize(a) = normalize(g) ], with Search-R1's `normalize_answer`
     (SQuAD's): lower-case → drop ASCII punctuation → replace the articles a/an/the by spaces →
     collapse whitespace.
MCQ: r = 1[ letter(a) = gold letter ], where `letter` accepts 'C', '(C)', 'C. text', 'C) text',
     'C: text', 'C text' when the text is option C, and the text of an option on its own.
The answer passed in is the content of the agent's last <answer> tag; the environment only ever
sees agent text, so prompt or observation text can never be scored.
"""

from __future__ import annotations

import re
import string
from typing import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
# '(C)', 'C', 'C.', 'C)', 'C:', 'C. text' … — the letter, then end or a separator
_LETTER = re.compile(r"\(?\s*([A-Za-z])\s*(?:\)|\.|:|\]|$)\s*(.*)", re.DOTALL)


def normalize_answer(s: str) -> str:
    """Search-R1's `normalize_answer`: white_space_fix(remove_articles(remove_punc(lower(s))))."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def em_score(answer: str | None, golden_answers: Sequence[str]) -> float:
    """1.0 when the normalised answer equals any normalised gold answer, else 0.0."""
    if answer is None:
        return 0.0
    pred = normalize_answer(answer)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def option_letter(answer: str | None, options: Mapping[str, str]) -> str | None:
    """The option letter an answer designates, or None.

    The text of an option (after normalisation) wins first; then a leading letter among the
    option keys in the forms '(C)', 'C', 'C.', 'C)', 'C:', followed by anything; a bare
    'C text' (letter, space, text) counts only when the text is option C's.
    """
    if answer is None:
        return None
    text = answer.strip()
    norm = normalize_answer(text)
    for key, value in options.items():
        if norm and norm == normalize_answer(value):
            return key
    m = _LETTER.match(text)
    if m and m.group(1).upper() in options:
        return m.group(1).upper()
    head, _, rest = text.partition(" ")
    if len(head) == 1 and head.upper() in options and rest:
        if normalize_answer(rest) == normalize_answer(options[head.upper()]):
            return head.upper()
    return None


def mcq_score(answer: str | None, gold_letter: str, options: Mapping[str, str]) -> float:
    """1.0 when `option_letter(answer)` is the gold letter, else 0.0."""
    return float(option_letter(answer, options) == gold_letter.strip().upper())
