"""KV caches for the rollout engine.

`GrowingLayer` is a full-attention cache layer whose appends are amortised O(1): keys and values
live in buffers with spare capacity (doubled when full) and are exposed as views, so a decoding
step no longer copies the whole cache the way `torch.cat` does (that copy dominates a step once
a multi-turn context holds a few hundred tokens).

Across turns a trajectory keeps the keys/values of its real tokens (`row_cache`); the next turn
stacks them right-aligned into a fresh cache (`stack_row_caches`), so only the new tokens (the
last sampled one and the observation) are encoded. Models with sliding-window layers fall back
to re-encoding the whole sequence each turn (`supports_row_caches` is False for them).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

RowCache = Optional[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer: K, V (H, n, D)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` appending into preallocated buffers (views of their first L positions)."""

    _kbuf: Optional[torch.Tensor] = None
    _vbuf: Optional[torch.Tensor] = None

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
        keep = min(self._kbuf.shape[-2], length + 64)  # spare room for this turn, not all of it
        self._kbuf = self._kbuf[indices, :, :keep]
        self._vbuf = self._vbuf[indices, :, :keep]
        self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]

    def _grow(self, like: torch.Tensor, length: int, needed: int) -> None:
        b, h, _, d = like.shape
        cap = max(64, 2 * needed)
        kbuf = like.new_empty(b, h, cap, d)
        vbuf = like.new_empty(b, h, cap, d)
        if length:
            kbuf[:, :, :length] = self.keys
            vbuf[:, :, :length] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s (full attention in every layer)."""

    def __init__(self, num_layers: int):
        Cache.__init__(self, layers=[GrowingLayer() for _ in range(num_layers)])


def supports_row_caches(model) -> bool:
    """True when every layer of the model's default cache is plain full attention."""
    probe = DynamicCache(config=model.config)
    return bool(probe.layers) and all(type(layer) is DynamicLayer for layer in probe.layers)


def stack_row_caches(model, caches: Sequence[RowCache], device: torch.device,
                     ) -> tuple[Cache, torch.Tensor]:
    """Per-row keys/values, right-aligned (left padding masked out) → (cache, (B, C) long mask).
    Rows without a cache (None) contribute only padding."""
    lengths = [0 if c is None else c[0][0].shape[1] for c in caches]
    width = max(lengths)
    attn = torch.zeros(len(caches), width, dtype=torch.long, device=device)
    if not supports_row_caches(model):
        if width:
            raise ValueError("row caches given for a model with sliding-window layers")
        return DynamicCache(config=model.config), attn
    num_layers = len(DynamicCache(config=model.config).layers)
    cache = GrowingCache(num_layers)
    if width == 0:
        return cache, attn
    some = next(c for c in caches if c is not None)
    for layer in range(num_layers):
        h, _, d = some[layer][0].shape
        k = some[layer][0].new_zeros(len(caches), h, width, d)  # (B, H, C, D)
        v = torch.zeros_like(k)
        for r, c in enumerate(caches):
            if c is not None:
                k[r, :, width - lengths[r]:] = c[layer][0]
                v[r, :, width - lengths[r]:] = c[layer][1]
        cache.layers[layer].update(k, v)
    for r, n in enumerate(lengths):
        attn[r, width - n:] = 1
    return cache, attn


def row_cache(past: Cache, mask_row: torch.Tensor, slot: int) -> RowCache:
    """Keys/values of one batch row's real (unmasked) positions, per layer: (H, n, D) each."""
    real = mask_row.nonzero().squeeze(-1)  # (n,)
    return [(layer.keys[slot][:, real], layer.values[slot][:, real]) for layer in past.layers]
