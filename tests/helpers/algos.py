"""Shared builders and plain-loop references for the stppo.algos tests (no tests here)."""

from __future__ import annotations

import math
import random

import pytest
import torch


def make_layout(n: int, t: int, seed: int = 0, max_turns: int = 4,
                empty_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask (N, T) bool, turn_ids (N, T) long): prompt, then agent turns alternating with
    observations, then padding — the Batch layout of docs/design.md §1."""
    rng = random.Random(seed)
    mask = torch.zeros(n, t, dtype=torch.bool)
    turns = torch.full((n, t), -1, dtype=torch.long)
    for i in range(n):
        if empty_row and i == n - 1:
            continue
        pos = rng.randint(1, 3)
        for k in range(rng.randint(1, max_turns)):
            length = rng.randint(1, 4)
            if pos + length > t:
                break
            mask[i, pos:pos + length] = True
            turns[i, pos:pos + length] = k
            pos += length + rng.randint(1, 3)
    return mask, turns


def make_inputs(n: int, t: int, seed: int = 0, spread: float = 0.3, dtype=torch.float32,
                **layout) -> dict[str, torch.Tensor]:
    """Random off-policy log-probs and advantages on a `make_layout` layout."""
    mask, turns = make_layout(n, t, seed, **layout)
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=dtype) * 2.0 - 0.1
    lp = old + spread * torch.randn(n, t, generator=g, dtype=dtype)
    adv = torch.randn(n, t, generator=g, dtype=dtype)
    return dict(log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=mask, turn_ids=turns)


def with_garbage(x: torch.Tensor, mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """x with nan / +inf / -inf / huge values on the positions where mask is False."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([math.nan, math.inf, -math.inf, 1e30], dtype=x.dtype)
    junk = choices[torch.randint(0, 4, x.shape, generator=g)]
    return torch.where(mask, x, junk)


def loop_ratio(lp, old, mask, turns, level: str) -> torch.Tensor:
    """ρ by plain Python loops over rows, turns and tokens (differentiable)."""
    n, t = mask.shape
    rows = []
    for i in range(n):
        row = []
        for j in range(t):
            if not mask[i, j]:
                row.append(torch.ones((), dtype=lp.dtype))
                continue
            if level == "token":
                members = [j]
            elif level == "turn":
                members = [u for u in range(t) if mask[i, u] and turns[i, u] == turns[i, j]]
            else:
                members = [u for u in range(t) if mask[i, u]]
            d = [torch.clamp(lp[i, u] - old[i, u], -20, 20) for u in members]
            row.append(torch.exp(sum(d) / len(d)))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def loop_agg(values, mask, mode: str) -> torch.Tensor:
    """agg by loops: token-mean, seq-mean-token-mean, seq-mean-token-sum."""
    n, t = mask.shape
    if mode == "token-mean":
        terms = [values[i, j] for i in range(n) for j in range(t) if mask[i, j]]
        return sum(terms) / max(1, len(terms)) if terms else torch.zeros(())
    per_row = []
    for i in range(n):
        terms = [values[i, j] for j in range(t) if mask[i, j]]
        if terms:
            per_row.append(sum(terms) / (len(terms) if mode == "seq-mean-token-mean" else 1))
    return sum(per_row) / len(per_row) if per_row else torch.zeros(())


def loop_surrogate(rho, adv, mask, clip_low, clip_high, dual_clip=None):
    """(s, κ_high, κ_low) token by token with Python floats deciding the branches."""
    n, t = mask.shape
    hi = torch.zeros(n, t, dtype=torch.bool)
    lo = torch.zeros(n, t, dtype=torch.bool)
    s_rows = []
    for i in range(n):
        row = []
        for j in range(t):
            if not mask[i, j]:
                row.append(torch.zeros((), dtype=rho.dtype))
                continue
            a, r = float(adv[i, j]), rho[i, j]
            rf = float(r.detach())
            unclipped = -a * r
            clipped = -a * torch.clamp(r, 1 - clip_low, 1 + clip_high)
            v = torch.maximum(unclipped, clipped)
            if dual_clip is not None and a < 0:
                v = torch.minimum(v, torch.tensor(-dual_clip * a, dtype=rho.dtype))
            hi[i, j] = a > 0 and rf > 1 + clip_high
            lo[i, j] = a < 0 and rf < 1 - clip_low
            row.append(v)
        s_rows.append(torch.stack(row))
    s = torch.stack(s_rows)
    return s, hi, lo


def check_garbage_is_ignored(grad, x: dict, agg: str, extra: dict | None = None) -> None:
    """A loss `grad(inputs, **kw) -> (loss, d loss / d log π, metrics)` ignores masked positions:
    finite garbage there (log-probs, old log-probs, advantages, IS weights, and `extra`'s
    replacements) changes neither the loss, nor the gradient on agent tokens, nor a metric, and
    the gradient off them is 0."""
    mask = x["loss_mask"]
    omega = 0.5 + torch.rand(x["advantages"].shape, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(1))
    a, g_a, m_a = grad(x, loss_agg=agg, rollout_is_weights=omega)
    y = {**x, "log_probs": with_garbage(x["log_probs"], mask, 1),
         "old_log_probs": with_garbage(x["old_log_probs"], mask, 2),
         "advantages": with_garbage(x["advantages"], mask, 3), **(extra or {})}
    b, g_b, m_b = grad(y, loss_agg=agg, rollout_is_weights=with_garbage(omega, mask, 4))
    assert a.item() == b.item()
    assert torch.equal(torch.where(mask, g_a, 0.0), torch.where(mask, g_b, 0.0))
    assert torch.equal(g_b[~mask], torch.zeros_like(g_b[~mask]))
    for k in m_a:
        assert torch.equal(m_a[k], m_b[k]), k


def check_half_batches_sum_to_whole(grad, x: dict, agg: str) -> None:
    """Rows 0–2 and 3–7 with the whole batch's denominators (`agg_denoms`) sum to the whole
    batch's loss and gradient. `grad` as in `check_garbage_is_ignored`; every value of `x` is
    split by rows."""
    from stppo.algos import agg_denoms

    whole, g_whole, _ = grad(x, loss_agg=agg)
    denoms = agg_denoms(x["loss_mask"])
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 8)):
        loss, g, _ = grad({k: v[rows] for k, v in x.items()}, loss_agg=agg, global_denoms=denoms)
        total += loss.item()
        grads.append(g)
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(torch.cat(grads), g_whole, atol=1e-15)


def check_one_line_error(match: str, **kwargs) -> None:
    """`policy_loss` on a small token-level batch with `kwargs` raises ValueError matching
    `match`, in one line."""
    from keyword_loss import policy_loss

    x = make_inputs(2, 6, seed=0)
    kw = {"ratio_level": "token", **kwargs}
    with pytest.raises(ValueError, match=match) as e:
        policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                    x["turn_ids"], clip_low=0.2, clip_high=0.2, loss_agg="token-mean", **kw)
    assert "\n" not in str(e.value)
