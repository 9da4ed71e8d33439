"""Where stppo caches derived artefacts (bm25 indexes, tokenizers, converted checkpoints, warm
starts): `$STPPO_CACHE_DIR`, else `~/.cache/stppo`. Keys are content hashes, so a cache entry
is never stale; deleting the folder is always safe."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("STPPO_CACHE_DIR") or Path.home() / ".cache" / "stppo")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def content_hash(*items: Any, length: int = 16) -> str:
    """A stable hash of JSON-serialisable items, strings and bytes."""
    h = hashlib.sha256()
    for item in items:
        if isinstance(item, bytes):
            h.update(item)
        elif isinstance(item, str):
            h.update(item.encode())
        else:
            h.update(json.dumps(item, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:length]
