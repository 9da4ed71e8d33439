"""Name → object registries: one per component type, one signature per registry.

An unknown name raises `UnknownNameError` — both a `KeyError` (so the registry behaves like a
read-only dict) and a `ValueError` (a user-facing config error) — whose one-line message lists
the valid names. Registering a name twice raises `ValueError`.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """An unknown registry name; `str()` is the plain message (not KeyError's repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping filled once through `register`; `kind` names the field in errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> T | Callable[[T], T]:
        """`REG.register("x", obj)`, or as a decorator `@REG.register("x")`."""
        if obj is None:
            return lambda o: self.register(name, o)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        return obj

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid: {', '.join(self._items)}") from None

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._items
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"
