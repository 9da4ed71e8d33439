"""Next-token sampling: temperature, top-p (nucleus), greedy; log-probs under the raw model.

The recorded log-probability of a sampled token y is log softmax(z)_y of the model's unmodified
logits z (temperature 1, no top-p): that is the policy π the trainer optimises, so the rollout
log-probs equal a fresh forward pass (`policy_log_probs`) and the first PPO minibatch is on-policy.
The token itself is drawn from the sampling distribution
    q(v) ∝ softmax(z / τ)_v · 1[v ∈ nucleus_p],
the nucleus being the smallest set of most likely tokens whose mass under softmax(z / τ) is ≥ p.
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


def sample_next(logits: torch.Tensor, cfg: RolloutConfig,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) next-token logits → (tokens (B,) long, log π(token) (B,) float32)."""
    z = logits.float()  # (B, V)
    log_probs = torch.log_softmax(z, dim=-1)  # (B, V) — the unmodified policy
    if cfg.greedy:
        tokens = z.argmax(dim=-1)  # (B,)
    else:
        scaled = z if cfg.temperature == 1.0 else z / cfg.temperature  # z / 1 == z exactly
        q = top_p_filter(scaled, cfg.top_p).softmax(dim=-1)  # (B, V)
        tokens = _inverse_cdf(q, generator)  # (B,)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(q: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """(B, V) probabilities → (B,) draws: the first v with CDF(v) > u·CDF(V), u ~ U[0, 1).
    Tokens of zero probability have empty intervals, so they are never drawn. (Several times
    faster than `torch.multinomial` on CPU for one draw per row.)"""
    cdf = q.cumsum(dim=-1)  # (B, V)
    # u is drawn where the generator lives (the trainer's are CPU generators seeded per step), so
    # a seed gives the same draws whatever device the model is on.
    gen_device = generator.device if generator is not None else q.device
    u = torch.rand(q.shape[0], 1, generator=generator, device=gen_device, dtype=cdf.dtype).to(q.device)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # (B,)
    return tokens.clamp_(max=q.shape[-1] - 1)
