"""A byte-level BPE tokenizer trained locally for the random-init model presets.

The tool tags of `stppo.envs.base.TAGS` are special tokens: each is one id, so the rollout engine
stops a turn with a token-id check, and a tag never merges with the text around it (FEASIBILITY.md,
pitfalls). `<|endoftext|>` is the EOS token and `<|pad|>` the padding token. A trained tokenizer is
saved under `cache_dir("tokenizers", content_hash(texts, settings))` and reloaded from there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from stppo.cache import cache_dir, content_hash
from stppo.envs.base import TAGS

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, *TAGS)  # ids 0, 1, 2.. in this order
_FORMAT_VERSION = 1  # bump when the training recipe changes, so old cache entries are not reused


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1500, *, min_frequency: int = 2,
                    use_cache: bool = True) -> PreTrainedTokenizerFast:
    """Train (or load from the cache) a byte-level BPE over `texts`.

    The result has `vocab_size` ids at most (fewer when the texts have fewer merges to learn):
    the 256 byte symbols, the special tokens of `SPECIAL_TOKENS`, then merges by frequency.
    """
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("train_tokenizer: texts is empty; pass the task's corpus, prompts and actions")
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size} is too small; use >= {min_vocab}")
    settings = {"vocab_size": vocab_size, "min_frequency": min_frequency,
                "special": list(SPECIAL_TOKENS), "version": _FORMAT_VERSION}
    path = cache_dir("tokenizers") / content_hash(texts, settings)
    if use_cache and (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    tok = _train(texts, vocab_size, min_frequency)
    if use_cache:
        _save_atomic(tok, path)
    return tok


def _train(texts: list[str], vocab_size: int, min_frequency: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    return _wrap(core)


def _wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=list(TAGS), clean_up_tokenization_spaces=False)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `train_tokenizer` (or any `save_pretrained` directory)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}; expected a tokenizer saved by "
                                "train_tokenizer or save_pretrained")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _save_atomic(tok: PreTrainedTokenizerFast, path: Path) -> None:
    """Write to a temporary sibling, then rename: concurrent runs never read a half-written entry."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race; its entry is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tags_are_single_tokens(tokenizer, tags: Iterable[str] = TAGS) -> bool:
    """True when every tag encodes to exactly one id (so stopping can be a token-id check)."""
    return all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in tags)
