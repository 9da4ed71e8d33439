"""KV caches for the rollout engine.

`GrowingLayer` is a full-attention cache layer whose appends are amortised O(1): keys and values
live in buffers with spare capacity (doubled when full) and are exposed as views, so a decoding
step no longer copies the whole cache the way `torch.cat` does (that copy dominates a step once
a multi-turn context holds a few hundred tokens).

Across turns a trajectory keeps the keys/values of its real tokens (`row_cache`: views of the
turn's buffers where they are contiguous, so a finished row costs no copy); the next turn stacks
them right-aligned into a fresh cache whose buffers already hold room for that turn's tokens
(`stack_row_caches`), so only the new tokens (the last sampled one and the observation) are
encoded and nothing is copied twice. Models with sliding-window layers fall back to re-encoding
the whole sequence each turn (`supports_row_caches` is False for them).
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

RowCache = Optional[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer: K, V (H, n, D)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` appending into preallocated buffers (views of their first L positions).
    `reserve`: the capacity the first allocation makes room for (positions)."""

    _kbuf: Optional[torch.Tensor] = None
    _vbuf: Optional[torch.Tensor] = None

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve

    @classmethod
    def over(cls, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> "GrowingLayer":
        """A layer holding the first `length` positions of the (B, H, capacity, D) buffers."""
        layer = cls(reserve=kbuf.shape[-2])
        layer.dtype, layer.device, layer.is_initialized = kbuf.dtype, kbuf.device, True
        layer._kbuf, layer._vbuf = kbuf, vbuf
        layer.keys, layer.values = kbuf[:, :, :length], vbuf[:, :, :length]
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, n = self.get_seq_length(), key_states.shape[-2]
        stale = (self._kbuf is None or self.keys.data_ptr() != self._kbuf.data_ptr()
                 or self._kbuf.shape[0] != key_states.shape[0])  # replaced by another method
        if stale or length + n > self._kbuf.shape[-2]:
            self._grow(key_states, length, length + n)
        self._kbuf[:, :, length:length + n] = key_states
        self._vbuf[:, :, length:length + n] = value_states
        self.keys = self._kbuf[:, :, :length + n]  # (B, H, L+n, D) view
        self.values = self._vbuf[:, :, :length + n]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`: one gather of the buffers (their spare capacity comes along)."""
        if self._kbuf is None or self.keys.data_ptr() != self._kbuf.data_ptr():
            return super().batch_select_indices(indices)
        length = self.get_seq_length()
        keep = min(self._kbuf.shape[-2], max(length + 64, self.reserve))  # room for this turn
        self._kbuf = self._kbuf[indices, :, :keep]
        self._vbuf = self._vbuf[indices, :, :keep]
        self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]

    def _grow(self, like: torch.Tensor, length: int, needed: int) -> None:
        b, h, _, d = like.shape
        cap = max(64, 2 * needed, self.reserve)
        kbuf = like.new_empty(b, h, cap, d)
        vbuf = like.new_empty(b, h, cap, d)
        if length:
            kbuf[:, :, :length] = self.keys
            vbuf[:, :, :length] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s (full attention in every layer)."""

    def __init__(self, num_layers: int = 0, reserve: int = 0, *,
                 layers: Optional[list[GrowingLayer]] = None):
        Cache.__init__(self, layers=layers or [GrowingLayer(reserve) for _ in range(num_layers)])


@functools.lru_cache(maxsize=64)
def cache_kwarg(fn) -> str:
    """The keyword under which `fn` (a model class's `forward`, a masking function) takes the KV
    cache: `cache` from transformers 5.24 on, which deprecates `past_key_values` (its removal is
    announced for 5.40), else `past_key_values`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def supports_row_caches(model) -> bool:
    """True when every layer of the model's default cache is plain full attention."""
    probe = DynamicCache(config=model.config)
    return bool(probe.layers) and all(type(layer) is DynamicLayer for layer in probe.layers)


def stack_row_caches(model, caches: Sequence[RowCache], device: torch.device, *, room: int = 0,
                     ) -> tuple[Cache, torch.Tensor]:
    """Per-row keys/values, right-aligned (left padding zeroed, masked out) → (cache, (B, C) bool
    mask). Rows without a cache (None) contribute only padding. The cache's buffers have `room`
    free positions after the C stacked ones, so the turn's appends copy nothing."""
    lengths = torch.tensor([0 if c is None else c[0][0].shape[1] for c in caches])  # (B,)
    width = int(lengths.max()) if len(caches) else 0
    attn = (torch.arange(width) >= width - lengths[:, None]).to(device)  # (B, C)
    if not supports_row_caches(model):
        if width:
            raise ValueError("row caches given for a model with sliding-window layers")
        return DynamicCache(config=model.config), attn
    num_layers = len(DynamicCache(config=model.config).layers)
    if width == 0:
        return GrowingCache(num_layers, reserve=room), attn
    some = next(c for c in caches if c is not None)
    layers = []
    for layer in range(num_layers):
        h, _, d = some[layer][0].shape
        k = some[layer][0].new_empty(len(caches), h, width + room, d)  # (B, H, C+room, D)
        v = torch.empty_like(k)
        k[:, :, :width].zero_()  # the holes are masked out, but must be finite
        v[:, :, :width].zero_()
        for r, c in enumerate(caches):
            if c is not None:
                k[r, :, width - c[layer][0].shape[1]:width] = c[layer][0]
                v[r, :, width - c[layer][1].shape[1]:width] = c[layer][1]
        layers.append(GrowingLayer.over(k, v, width))
    return GrowingCache(layers=layers), attn


def row_cache(past: Cache, slot: int, spans: Sequence[tuple[int, int]]) -> RowCache:
    """Keys/values of batch row `slot` at the positions of `spans` ([(start, end), ...] in order),
    per layer (H, n, D) each: a view of the cache's buffer for one span (later appends never
    write below the cache's current length), a copy for several."""
    spans = [(a, b) for a, b in spans if b > a]

    def take(x: torch.Tensor) -> torch.Tensor:  # (H, L, D) → (H, n, D)
        parts = [x[:, a:b] for a, b in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    return [(take(layer.keys[slot]), take(layer.values[slot])) for layer in past.layers]
