"""Checkpoints: everything a killed run needs to continue exactly where it stopped.

One file per save, written to a temporary name and renamed, so a kill mid-write leaves the
previous checkpoint intact. Sampling RNGs are derived from (seed, step), so model and optimizer
states, the step and the collapse detector are all the state there is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FILE = "checkpoint.pt"


def save(run_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run_dir / FILE)
    return run_dir / FILE


def load(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(run_dir) / FILE
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
