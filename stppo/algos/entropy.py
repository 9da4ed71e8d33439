"""Token log-probabilities and entropies from logits, memory-lean.

    log π(y_t) = z_{t, y_t} − logsumexp_v z_{t, v}
    H_t        = logsumexp_v z_{t, v} − Σ_v softmax(z_t)_v z_{t, v}
    Σπ²_t      = exp(logsumexp_v 2 z_{t, v} − 2 logsumexp_v z_{t, v})

`token_log_probs` never builds a log-softmax over the vocabulary: a gather and one logsumexp.
`entropy_from_logits` builds one softmax (the only full-vocabulary copy) and contracts it with the
logits by a batched matrix product instead of an elementwise product copy. Both accept
`chunk_size` to process that many tokens at a time (bounds the peak temporary memory).

Positions: the result at index t uses the logits at index t. For the `Batch` layout
(log_probs[:, t] = log π(ids[t] | ids[:t])) use the next token as target: with logits (N, T, V),
`token_log_probs(logits, F.pad(input_ids[:, 1:], (0, 1)))[:, :-1]` are the log-probs of positions
1..T-1. Pass contiguous logits (slicing logits[:, :-1] first would force a full copy).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _chunked(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *others: torch.Tensor,
             chunk_size: Optional[int]) -> torch.Tensor:
    """Apply `fn` over the flattened leading dims of `logits` (…, V) in chunks of tokens."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # (M, V)
    flat_others = [o.reshape(-1) for o in others]  # (M,)
    if chunk_size is None or flat.shape[0] <= chunk_size:
        return fn(flat, *flat_others).view(lead)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be None or >= 1, got {chunk_size}")
    parts = [fn(flat[i:i + chunk_size], *(o[i:i + chunk_size] for o in flat_others))
             for i in range(0, flat.shape[0], chunk_size)]
    return torch.cat(parts).view(lead)


def _log_probs(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return z.gather(1, ids.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)  # (M,)


def _entropy(z: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(z, dim=-1)  # (M, V) the one full-vocabulary copy
    pz = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)  # (M,) Σ_v p z, no product copy
    return torch.logsumexp(z, dim=-1) - pz


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor,
                    chunk_size: Optional[int] = None) -> torch.Tensor:
    """log softmax(logits)[ids]: logits (…, V), ids (…) long in [0, V) → (…)."""
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"ids has shape {tuple(ids.shape)}, expected {tuple(logits.shape[:-1])} "
                         "(logits without the vocabulary dim)")
    return _chunked(_log_probs, logits, ids, chunk_size=chunk_size)


def entropy_from_logits(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logits (…, V) → (…)."""
    return _chunked(_entropy, logits, chunk_size=chunk_size)


def _sum_pi_squared(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))


def sum_pi_squared_from_logits(logits: torch.Tensor,
                               chunk_size: Optional[int] = None) -> torch.Tensor:
    """Σ_v softmax(logits)_v² = exp(logsumexp(2z) − 2 logsumexp(z)) over the last dim (verl's
    `calculate_sum_pi_squared_from_logits`; the optimal token baseline's input): (…, V) → (…)."""
    return _chunked(_sum_pi_squared, logits, chunk_size=chunk_size)
