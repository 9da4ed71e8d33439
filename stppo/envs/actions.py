"""The agent's action syntax and the observations it gets back, as in Search-R1.

Search-R1 (`search_r1/llm_agent/generation.py`) parses a turn with the regex
`<(search|answer)>(.*?)</\\1>` (DOTALL): the leftmost opening tag that has a matching closing
tag after it wins, its content is the text up to the *first* such closing tag, stripped.
`parse_action` computes exactly that with `str.find` — linear time, so unclosed or nested tags
and long junk can never make it backtrack.

Observations (Search-R1's `execute_predictions` / `_passages2string`):
  search  → '\\n\\n<information>' + strip(Σ_i 'Doc i(Title: {title}) {text}\\n')
            + '</information>\\n\\n'
            where title is the first line of the document's `contents` ('"Title"', quotes kept)
            and text the rest;
  answer  → '' (the episode ends);
  invalid → `INVALID_ACTION_OBSERVATION`.
"""

from __future__ import annotations

from typing import Literal, Sequence

from stppo.envs.base import Doc

ActionKind = Literal["search", "answer", "invalid"]

INVALID_ACTION_OBSERVATION = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

_ACTIONS = ("search", "answer")


def parse_action(text: str) -> tuple[ActionKind, str]:
    """(kind, content) of one agent turn; ('invalid', '') when no complete action tag pair.

    Equivalent to Search-R1's `re.search(r'<(search|answer)>(.*?)</\\1>', text, re.DOTALL)`:
    for each action, only its first opening tag matters (if that one has no closing tag after
    it, no later one does); the earliest valid opening tag wins.
    """
    if not isinstance(text, str):
        raise ValueError(f"action text must be a str, got {type(text).__name__}")
    best: tuple[int, ActionKind, str] | None = None
    for name in _ACTIONS:
        opening, closing = f"<{name}>", f"</{name}>"
        start = text.find(opening)
        if start < 0:
            continue
        body = start + len(opening)
        end = text.find(closing, body)
        if end < 0:
            continue
        if best is None or start < best[0]:
            best = (start, name, text[body:end].strip())  # type: ignore[assignment]
    if best is None:
        return "invalid", ""
    return best[1], best[2]


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's split of a corpus entry: (first line, remaining lines joined by '\\n')."""
    lines = contents.split("\n")
    return lines[0], "\n".join(lines[1:])


def format_passages(docs: Sequence[Doc]) -> str:
    """Search-R1's `_passages2string`: one 'Doc i(Title: {title}) {text}\\n' line per document."""
    out = []
    for i, doc in enumerate(docs):
        title, text = split_contents(doc.contents)
        out.append(f"Doc {i + 1}(Title: {title}) {text}\n")
    return "".join(out)


def format_information(docs: Sequence[Doc]) -> str:
    """The observation after a search: the passages inside <information> tags."""
    return f"\n\n<information>{format_passages(docs).strip()}</information>\n\n"


def doc_from_contents(doc_id: str, contents: str) -> Doc:
    """Inverse of `Doc.contents`: '"Title"\\ntext' → Doc(id, 'Title', 'text').

    A first line without surrounding quotes is taken as the title as is."""
    title, text = split_contents(contents)
    if len(title) >= 2 and title.startswith('"') and title.endswith('"'):
        title = title[1:-1]
    return Doc(id=str(doc_id), title=title, text=text)
