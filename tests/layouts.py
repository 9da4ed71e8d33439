"""A random multi-turn token layout for update tests (importable by pytest modules and by the
torchrun script tests/dp_update.py): prompt, then agent turns separated by observations, then
right padding — the Batch layout of docs/design.md §1."""

from __future__ import annotations

import torch


def multi_turn_layout(g: torch.Generator, n: int, t: int, vocab: int, *, prompt: int,
                      action: tuple[int, int], gap: tuple[int, int], shortest: int,
                      no_agent_rows: tuple[int, ...] = ()):
    """(ids, attention_mask, loss_mask, turn_ids), each (n, t): row lengths t − shortest … t,
    `prompt` prompt tokens, turns of `action` tokens (randint bounds) with `gap` observation
    tokens between them; rows in `no_agent_rows` hold the prompt only. Draws from `g` in a fixed
    order, so a seed gives one layout."""
    ids = torch.randint(1, vocab, (n, t), generator=g)
    attn = torch.zeros(n, t, dtype=torch.bool)
    loss = torch.zeros(n, t, dtype=torch.bool)
    turns = torch.full((n, t), -1, dtype=torch.long)
    for i in range(n):
        length = int(torch.randint(t - shortest, t + 1, (1,), generator=g))
        attn[i, :length] = True
        pos, turn = prompt, 0
        while pos < length and i not in no_agent_rows:
            a = int(torch.randint(*action, (1,), generator=g))
            loss[i, pos:min(pos + a, length)] = True
            turns[i, pos:min(pos + a, length)] = turn
            pos, turn = pos + a + int(torch.randint(*gap, (1,), generator=g)), turn + 1
    return torch.where(attn, ids, 0), attn, loss, turns
