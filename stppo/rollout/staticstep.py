"""The static decoding path's model code: a fixed-size KV cache and the model's forward over it.

`StaticKV` holds every layer's keys and values in buffers of a fixed shape
(capacity rows, KV heads, L columns, head dim), allocated once: a row keeps its slot across turns
and its token at sequence index p sits in column p (no padding inside a row), so a row's
position ids are its column indices and its attention mask over the cache is `column ≤ position`.
The last column is a trash column: padded entries of a prefill write there, and no mask ever
reads it. Nothing is reallocated between decoding steps, so the step can be captured as a CUDA
graph (`static.py`).

`StaticForward` is `LeanStep`'s code (the model's own weights, norms, rotary embedding and SDPA
attention function, without the module machinery; `leanstep.py`) with the cache writes and
reads of `StaticKV`: keys and values are scattered to each row's own columns and attention runs
over all L columns under the mask. Its logits equal the model's forward up to the rounding of
other kernels (more masked keys, other matrix shapes; ~1e-6 in float32, tested against the eager
engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stppo.rollout.leanstep import LeanStep


def cache_columns(max_total_tokens: int) -> int:
    """Columns of a `StaticKV` for trajectories of at most `max_total_tokens` tokens: room for
    every position, one trash column, rounded up to a multiple of 16 (what SDPA's memory-efficient
    kernels want of a mask's last dimension)."""
    return -(-(max_total_tokens + 1) // 16) * 16


class StaticKV:
    """Per layer (capacity, H_kv, L, D) key and value buffers; column L−1 is the trash column."""

    def __init__(self, num_layers: int, capacity: int, kv_heads: int, columns: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (capacity, kv_heads, columns, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity, self.columns = capacity, columns
        self.trash = columns - 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def gather_rows(self, order: torch.Tensor) -> None:
        """Slots 0..n−1 take the rows of slots `order` (n,) (a gather, then a write: `order` may
        name any slot, in any order)."""
        n = order.numel()
        for buf in (*self.k, *self.v):
            buf[:n] = buf[order]


@torch.no_grad()
def attention_mask(positions: torch.Tensor, columns: int) -> torch.Tensor:
    """(B, W) query positions → (B, 1, W, L) bool: query at position p reads columns 0..p."""
    col = torch.arange(columns, device=positions.device)  # (L,)
    return (col <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, W, L)


class StaticForward(LeanStep):
    """`LeanStep` over a `StaticKV`: (ids, positions, columns written) → (B, V) logits."""

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,  # type: ignore[override]
                 write_cols: torch.Tensor, mask: torch.Tensor, kv: StaticKV,
                 last: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids, write_cols (B, W): the tokens of rows 0..B−1 (slots), their
        positions, and the cache column each one's keys/values go to (`kv.trash` for padding);
        mask (B, 1, W, L) bool (`attention_mask`); last (B,): the column index in W of each
        row's last real token when W > 1 (the only one whose logits are read: the last layer's
        query, attention, output projection and MLP run there only, as in `LeanStep`).
        Returns the (B, V) logits of each row's last real token."""
        b, w = input_ids.shape
        h = F.embedding(input_ids.reshape(-1), self.embed)  # (B·W, E)
        cos, sin = self.rotary(h, position_ids)  # (B, W, D)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, W, D)
        slots = torch.arange(b, device=input_ids.device).unsqueeze(1)  # (B, 1)
        final = len(self.layers) - 1
        for i, (norm1, attn, q, k, v, o, norm2, act, gate, up, down) in enumerate(self.layers):
            x = norm1(h)
            heads = (b, w, -1, attn.head_dim)
            ks = self._rope(F.linear(x, *k).view(heads).transpose(1, 2), cos, sin)  # (B, H, W, D)
            vs = F.linear(x, *v).view(heads)  # (B, W, H, D)
            kv.k[i][slots, :, write_cols] = ks.transpose(1, 2).to(kv.k[i].dtype)  # scatter (B, W, H, D)
            kv.v[i][slots, :, write_cols] = vs.to(kv.v[i].dtype)
            layer_mask = mask
            if i == final and w > 1:  # from here on, each row's last real token only
                pick = torch.arange(b, device=h.device) * w + last  # (B,) rows of (B·W, E)
                h, x = h[pick], x[pick]
                at = last.view(b, 1, 1, 1).expand(b, 1, 1, cos.shape[-1])
                cos, sin = cos.gather(2, at), sin.gather(2, at)  # (B, 1, 1, D)
                layer_mask = mask.gather(2, last.view(b, 1, 1, 1).expand(b, 1, 1, mask.shape[-1]))
                heads = (b, 1, -1, attn.head_dim)
            qs = self._rope(F.linear(x, *q).view(heads).transpose(1, 2), cos, sin)  # (B, H, w', D)
            if qs.shape[2] == 1:
                out = _one_query_attention(qs, kv.k[i][:b], kv.v[i][:b], layer_mask, attn.scaling)
            else:
                out, _ = self.attend(attn, qs, kv.k[i][:b], kv.v[i][:b], layer_mask,
                                     dropout=0.0, scaling=attn.scaling)
            h = h + F.linear(out.reshape(h.shape[0], -1), *o)
            x = norm2(h)
            h = h + F.linear(act(F.linear(x, *gate)) * F.linear(x, *up), *down)
        return F.linear(self.norm(h), *self.head)  # (B, V)


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """SDPA of one query position per row with grouped KV heads, without repeating the keys:
    the G query heads that share a KV head become G query rows of it (as transformers'
    `pack_gqa` does for a decoding step). q (B, H, 1, D); k, v (B, H_kv, L, D); mask (B, 1, 1, L)
    bool. Returns (B, 1, H, D), laid out as the attention function returns it."""
    b, heads, _, d = q.shape
    packed = q.reshape(b, k.shape[1], heads // k.shape[1], d)  # (B, H_kv, G, D)
    out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale)  # (B, H_kv, G, D)
    return out.reshape(b, heads, 1, d).transpose(1, 2)
