"""The two checks every config schema uses: a value among the allowed ones, a condition; each
failure is one `ValueError` line that names the field."""

from __future__ import annotations

from typing import Any


def one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)
