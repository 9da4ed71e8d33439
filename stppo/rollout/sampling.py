"""Next-token sampling: temperature, top-p (nucleus), greedy; log-probs under the raw model.

The recorded log-probability of a sampled token y is log softmax(z)_y of the model's unmodified
logits z (temperature 1, no top-p): that is the policy π the trainer optimises, so the rollout
log-probs equal a fresh forward pass (`policy_log_probs`) and the first PPO minibatch is on-policy.
The token itself is drawn from the sampling distribution
    q(v) ∝ softmax(z / τ)_v · 1[v ∈ nucleus_p],
the nucleus being the smallest set of most likely tokens whose mass under softmax(z / τ) is ≥ p.

Randomness: a turn's uniforms are drawn at once, u ∈ [0, 1)^(B×S) for its B rows and up to S
steps (`turn_uniforms`), from the run's generator; row r's token at step s is the inverse CDF of q
at u[r, s]. So a row's draws depend only on the seed, the turn and its place in the turn — not on
which other rows are still generating — and the eager and the static engine (`static.py`), which
keep finished rows differently, sample the same tokens from the same logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from stppo.rollout.config import RolloutConfig


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """(B, V) logits → (B, V) with tokens outside the nucleus set to −inf (the top token stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def turn_uniforms(rows: int, steps: int, generator: Optional[torch.Generator],
                  device: torch.device | str) -> torch.Tensor:
    """(rows, steps) float32 uniforms of one turn, drawn where the generator lives (the trainer's
    are CPU generators seeded per step, so a seed gives the same draws on any device), then moved
    to `device`."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(rows, steps, generator=generator, device=gen_device, dtype=torch.float32)
    return u.to(device)


def sample_next(logits: torch.Tensor, cfg: RolloutConfig,
                generator: Optional[torch.Generator] = None,
                u: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) next-token logits → (tokens (B,) long, log π(token) (B,) float32). Sampling reads
    the uniforms `u` (B,) when given, else draws them from `generator`; greedy reads none."""
    z = logits.float()  # (B, V)
    log_probs = torch.log_softmax(z, dim=-1)  # (B, V) — the unmodified policy
    if cfg.greedy:
        tokens = z.argmax(dim=-1)  # (B,)
    else:
        scaled = z if cfg.temperature == 1.0 else z / cfg.temperature  # z / 1 == z exactly
        q = top_p_filter(scaled, cfg.top_p).softmax(dim=-1)  # (B, V)
        if u is None:
            u = turn_uniforms(q.shape[0], 1, generator, q.device)[:, 0]
        tokens = inverse_cdf(q, u)  # (B,)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities, (B,) uniforms in [0, 1) → (B,) draws: the first v with
    CDF(v) > u·CDF(V). Tokens of zero probability have empty intervals, so they are never drawn.
    (Several times faster than `torch.multinomial` on CPU for one draw per row; no host sync.)"""
    cdf = q.cumsum(dim=-1)  # (B, V)
    target = u.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]  # (B, 1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)
    return tokens.clamp_(max=q.shape[-1] - 1)
