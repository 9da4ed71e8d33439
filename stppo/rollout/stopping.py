"""When does a turn end: after `</search>`, `</answer>` or EOS.

Tokenizers trained by stppo make the tags single special tokens, so the check is a token-id test.
Pretrained tokenizers (SmolLM2, Qwen) spell a tag with several tokens; then the decoded text of
the last few ids of the row's current turn is searched for a stop tag. A tag of c characters
spans at most c tokens (each token contributes at least one of its ASCII characters), and the
check runs after every token, so a window of max_c ids finds a tag the step it completes.
That check only runs for a row whose new token's text holds a tag's last character (`>`): a tag
completes with the token that brings its last character, and every earlier window was checked
(a per-vocabulary table, built once per tokenizer, tells which ids can).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

import torch

from stppo.envs.base import STOP_TAGS


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """EOS ids of the tokenizer and, when set, of the model's generation config."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    if extra is not None:
        ids.update(int(i) for i in (extra if isinstance(extra, (list, tuple)) else [extra]))
    return sorted(ids)


class StopChecker:
    def __init__(self, tokenizer, eos_ids: Iterable[int], stop_tags: Sequence[str] = STOP_TAGS):
        self.tokenizer = tokenizer
        self.stop_tags = tuple(stop_tags)
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in self.stop_tags]
        self.by_token_id = all(len(e) == 1 for e in encoded)
        ids = set(int(i) for i in eos_ids)
        if self.by_token_id:
            ids.update(e[0] for e in encoded)
        self.stop_ids = torch.tensor(sorted(ids), dtype=torch.long)
        self.window = max((len(t) for t in self.stop_tags), default=0)
        self._ends = None  # (V,) bool: the id's text holds a tag's last character

    def hits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B,) sampled ids → (B,) bool: the id itself ends the turn (EOS or a single-token tag)."""
        if self.stop_ids.device != tokens.device:
            self.stop_ids = self.stop_ids.to(tokens.device)  # once, not every step
        return torch.isin(tokens, self.stop_ids)

    def may_end_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B,) sampled ids → (B,) bool: `text_hit` can newly be true after this id (its text holds
        a tag's last character; ids beyond the tokenizer's vocabulary count as possible)."""
        if self.by_token_id:
            return torch.zeros_like(tokens, dtype=torch.bool)
        if self._ends is None:
            last_chars = "".join(sorted({t[-1] for t in self.stop_tags}))
            self._ends = _ids_holding(self.tokenizer, last_chars)
        if self._ends.device != tokens.device:
            self._ends = self._ends.to(tokens.device)  # once, not every step
        ends = self._ends
        inside = tokens < len(ends)
        return torch.where(inside, ends[tokens.clamp(max=len(ends) - 1)], True)

    def text_hit(self, turn_ids: list[int]) -> bool:
        """Whether the decoded tail of the turn contains a stop tag (multi-token tags only)."""
        if self.by_token_id:
            return False
        tail = self.tokenizer.decode(turn_ids[-self.window:], skip_special_tokens=False)
        return any(tag in tail for tag in self.stop_tags)


@lru_cache(maxsize=8)
def _ids_holding(tokenizer, chars: str) -> torch.Tensor:
    """(V,) bool over the tokenizer's ids: the id decoded alone holds one of `chars`. (A tag
    character is ASCII: in byte-level and SentencePiece vocabularies it decodes the same alone as
    in context.)"""
    n = len(tokenizer)
    core = getattr(tokenizer, "backend_tokenizer", None)
    if core is not None:  # the Rust tokenizer decodes the whole vocabulary in one call
        texts = core.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
    return torch.tensor([any(c in t for c in chars) for t in texts], dtype=torch.bool)
