"""Retrievers: `bm25` (in process, bm25s) and `http` (a Search-R1 retrieval server).

Both answer one call per turn for all queries of the turn: `retrieve(queries, topk)` →
list (one per query) of the top-k `Doc`s, best first.

bm25 scores (Lucene variant, bm25s): s(q, d) = Σ_{w∈q} idf(w) · tf(w,d)(k1+1) /
(tf(w,d) + k1(1 − b + b|d|/avgdl)). Text is lower-cased, split into words of ≥ 2 characters,
English stopwords dropped and each word reduced by Harman's S-stemmer (plural endings), for
queries and documents alike. Ties rank the earlier corpus document first. The index is cached
under `cache_dir("bm25", content_hash(corpus, settings))` and reloaded on the next build.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from stppo.cache import cache_dir, content_hash
from stppo.envs.actions import doc_from_contents
from stppo.envs.base import Doc, Retriever
from stppo.registry import Registry

logging.getLogger("bm25s").setLevel(logging.WARNING)  # its index-building DEBUG lines are noise

_INDEX_VERSION = 1  # bump when tokenisation or the index layout changes
_WORD = re.compile(r"(?u)\b\w\w+\b")
_COMPLETE = "stppo_index.json"  # written last: an entry without it is incomplete
INDEX_BUILDS = 0  # number of bm25 indexes built (not loaded) in this process


def import_bm25s():
    """bm25s, imported with JAX hidden. When JAX is installed, importing bm25s runs a JAX op
    (`bm25s.selection`), which starts JAX's GPU backend and preallocates 75% of the GPU's memory:
    measured on an H100, ~60 GiB held beside the trainer, which then ran out of memory. stppo
    ranks with its own numpy top-k (`_top_k`), so bm25s needs no JAX; where the process imported
    JAX before, it is left as it is."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hide = "jax" not in sys.modules
    if hide:
        sys.modules["jax"] = None  # `import jax...` raises ImportError: bm25s falls back to numpy
    try:
        import bm25s
    finally:
        if hide and sys.modules.get("jax", 0) is None:
            del sys.modules["jax"]
    return bm25s


def _stopwords() -> frozenset[str]:
    return frozenset(import_bm25s().stopwords.STOPWORDS_EN)


_STOP = _stopwords()


def s_stem(word: str) -> str:
    """Harman's S-stemmer: -ies → -y, -es → -e, -s → '' (except -aies/-eies, -aes/-ees/-oes,
    -us/-ss)."""
    if word.endswith("ies") and not word.endswith(("eies", "aies")):
        return word[:-3] + "y"
    if word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
        return word[:-1]
    if word.endswith("s") and not word.endswith(("us", "ss")):
        return word[:-1]
    return word


def tokenize(text: str) -> list[str]:
    """Lower-case words of ≥ 2 characters, stopwords dropped, S-stemmed."""
    return [s_stem(w) for w in _WORD.findall(text.lower()) if w not in _STOP]


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first; equal scores rank the lower index first."""
    n = scores.shape[0]
    cand = np.arange(n) if n <= 4 * k + 1024 else np.argpartition(-scores, k - 1)[:k]
    order = np.lexsort((cand, -scores[cand]))  # primary key: score desc; then index asc
    return cand[order][:k]


class BM25Retriever:
    """In-process bm25 over `corpus`; the index is cached on disk and reloaded when present."""

    def __init__(self, corpus: Sequence[Doc], *, k1: float = 1.5, b: float = 0.75,
                 use_cache: bool = True) -> None:
        bm25s = import_bm25s()

        self.corpus = list(corpus)
        if not self.corpus:
            raise ValueError("bm25 retriever: the corpus is empty; give the task a corpus file "
                             "(e.g. task.options.corpus=PATH.jsonl) or use retriever kind=http")
        key = content_hash(_INDEX_VERSION, k1, b, *(f"{d.id}\x1f{d.contents}" for d in self.corpus))
        self.index_dir = cache_dir("bm25") / key
        self.from_cache = use_cache and (self.index_dir / _COMPLETE).is_file()
        if self.from_cache:
            self.model = bm25s.BM25.load(str(self.index_dir), show_progress=False)
        else:
            global INDEX_BUILDS
            INDEX_BUILDS += 1
            tokens = [tokenize(d.contents) for d in self.corpus]
            if not any(tokens):
                raise ValueError("bm25 retriever: no corpus document has an indexable word "
                                 "(words of >= 2 characters that are not stopwords)")
            self.model = bm25s.BM25(k1=k1, b=b)
            self.model.index(tokens, show_progress=False)
            if use_cache:
                self._save()
        self._vocab: dict[str, int] = self.model.vocab_dict

    def _save(self) -> None:
        """Write to a temporary sibling, then rename: readers never see a half-written index."""
        root = self.index_dir.parent
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        try:
            self.model.save(tmp, show_progress=False)
            with open(os.path.join(tmp, _COMPLETE), "w") as f:
                f.write(f'{{"version": {_INDEX_VERSION}, "docs": {len(self.corpus)}}}\n')
            if self.index_dir.exists() and not (self.index_dir / _COMPLETE).is_file():
                shutil.rmtree(self.index_dir, ignore_errors=True)
            os.rename(tmp, self.index_dir)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(tmp, ignore_errors=True)

    def scores(self, query: str) -> np.ndarray:
        """bm25 score of every corpus document for `query`."""  # (n_docs,)
        ids = [self._vocab[t] for t in tokenize(query) if t in self._vocab]
        if not ids:
            return np.zeros(len(self.corpus), dtype=np.float32)
        return np.asarray(self.model.get_scores_from_ids(ids), dtype=np.float32)

    def retrieve_scored(self, queries: Sequence[str], topk: int) -> list[list[tuple[Doc, float]]]:
        k = min(int(topk), len(self.corpus))
        out = []
        for q in queries:
            s = self.scores(q)  # (n_docs,)
            out.append([(self.corpus[i], float(s[i])) for i in _top_k(s, k)])
        return out

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Doc]]:
        return [[d for d, _ in hits] for hits in self.retrieve_scored(queries, topk)]


SERVER_HINT = ("start one with `python -m stppo.envs.retrieval_server --corpus CORPUS.jsonl "
               "--port PORT` or set task.retriever.url")


class HttpRetriever:
    """Client of a Search-R1 retrieval server: POST {url}/retrieve
    {"queries": [...], "topk": k, "return_scores": true} → {"result": [[hit, ...], ...]}, where a
    hit is {"document": {"id", "contents"}, "score": s} or {"id", "contents"}.

    One request per call; connection errors, timeouts and 5xx answers are retried `retries`
    times with exponential backoff (backoff_s · 2^i), then raise one ConnectionError naming the
    URL and how to start a server."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever url={url!r} must start with http:// or https://")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("http retriever: timeout_s must be > 0, retries and backoff_s >= 0")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)

    def _post(self, payload: dict) -> Any:
        import requests

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = requests.post(self.url, json=payload, timeout=self.timeout_s)
            except requests.Timeout:
                last = f"no answer within timeout_s={self.timeout_s}"
                continue
            except requests.ConnectionError as err:
                last = f"cannot connect ({type(err).__name__})"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code != 200:
                raise ValueError(f"retrieval server {self.url} rejected the request: "
                                 f"HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                return resp.json()
            except ValueError:
                raise ValueError(f"retrieval server {self.url} answered non-JSON: "
                                 f"{resp.text[:200]!r}") from None
        raise ConnectionError(f"retrieval server {self.url} failed after {self.retries + 1} "
                              f"attempts ({last}); {SERVER_HINT}")

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Doc]]:
        if not queries:
            return []
        data = self._post({"queries": list(queries), "topk": int(topk), "return_scores": True})
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise ValueError(f"retrieval server {self.url}: expected {{'result': [one list of hits "
                             f"per query]}} for {len(queries)} queries, got {str(data)[:200]}")
        return [[self._doc(hit) for hit in hits] for hits in result]

    def _doc(self, hit: Any) -> Doc:
        doc = hit.get("document", hit) if isinstance(hit, dict) else None
        if not isinstance(doc, dict) or "contents" not in doc:
            raise ValueError(f"retrieval server {self.url}: a hit must be {{'document': {{'id', "
                             f"'contents'}}, 'score'}} or {{'id', 'contents'}}, got {str(hit)[:200]}")
        return doc_from_contents(str(doc.get("id", "")), str(doc["contents"]))


RETRIEVERS: Registry[Callable[..., Retriever]] = Registry("retriever")


def register_retriever(kind: str):
    """Decorator adding a retriever builder `fn(*, corpus, **options) -> Retriever`."""
    return RETRIEVERS.register(kind)


@register_retriever("bm25")
def _bm25(*, corpus: Sequence[Doc] = (), k1: float = 1.5, b: float = 0.75,
          use_cache: bool = True) -> Retriever:
    return BM25Retriever(corpus, k1=k1, b=b, use_cache=use_cache)


@register_retriever("http")
def _http(*, corpus: Sequence[Doc] = (), url: str = "http://127.0.0.1:8000",
          timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5) -> Retriever:
    del corpus  # the server holds the corpus
    return HttpRetriever(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)


def _params(fn: Callable) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "corpus"]


def build_retriever(kind: str, *, corpus: Sequence[Doc] = (), **options: Any) -> Retriever:
    """A retriever by kind. bm25: corpus, k1, b, use_cache; http: url, timeout_s, retries,
    backoff_s. Options of the other kinds (e.g. `url` for bm25) are ignored, so one retriever
    config section serves every kind; an option no kind knows is an error."""
    if kind not in RETRIEVERS:
        raise ValueError(f"retriever kind={kind!r} is not valid; allowed: {', '.join(RETRIEVERS)}")
    known = sorted({p for fn in RETRIEVERS.values() for p in _params(fn)})
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"retriever option(s) {unknown} unknown; valid: {', '.join(known)}")
    mine = _params(RETRIEVERS[kind])
    return RETRIEVERS[kind](corpus=corpus, **{k: v for k, v in options.items() if k in mine})
