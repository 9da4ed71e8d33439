"""KL estimators between the policy and the frozen reference (docs/design.md §2, "KL").

With x = log π_θ(y_t) − log π_ref(y_t) per token (Schulman, "Approximating KL divergence", 2020):
    k1 = x
    k2 = ½ x²
    k3 = exp(−x) + x − 1, computed as verl's `low_var_kl`: −x clamped to [−20, 20] before the
         exp and the result clamped to [−10, 10].
Used either as a loss term (`kl_loss`, aggregated like every loss) or as a per-token penalty in
the reward (`kl_in_reward`, rewards − β·k).

`sampled_k3(log_q, log_p)`: the same k3 between two other policies, for tokens sampled by p —
e^r − 1 − r with r = log q − log p, ≥ 0 per token, whose mean under p is KL(p ‖ q) (the
diagnostics `offpolicy/kl_to_current` and `actor/step_kl`).
"""

from __future__ import annotations

from typing import Callable

import torch

from stppo.algos.aggregation import GlobalDenoms, agg_loss
from stppo.registry import Registry
from stppo.metric_names import KL_REF

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("kl estimator")


@KL_ESTIMATORS.register("k1")
def _k1(x: torch.Tensor) -> torch.Tensor:
    return x


@KL_ESTIMATORS.register("k2")
def _k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.square()


@KL_ESTIMATORS.register("k3")
def _k3(x: torch.Tensor) -> torch.Tensor:
    neg = (-x).clamp(-20.0, 20.0)  # log(π_ref/π_θ)
    return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)


def sampled_k3(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Per-token e^r − 1 − r, r = log q − log p clamped to [−20, 20], in float64 (module
    docstring). Same shape as the inputs."""
    r = (log_q.double() - log_p.double()).clamp(-20.0, 20.0)
    return torch.expm1(r) - r


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str,
               loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate `kind` ∈ KL_ESTIMATORS. (N, T); 0 off agent tokens if a mask is
    given (masked with torch.where before the estimator: garbage there reaches nothing)."""
    fn = KL_ESTIMATORS[kind]
    x = log_probs - ref_log_probs  # (N, T)
    if loss_mask is not None:
        x = torch.where(loss_mask, x, 0.0)  # every estimator is 0 at x = 0
    return fn(x)


def kl_loss(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, loss_mask: torch.Tensor, *,
            kind: str, loss_agg: str, global_denoms: GlobalDenoms = None,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """agg(k(log π_θ − log π_ref)) and {actor/kl_ref: its detached value}."""
    loss = agg_loss(kl_penalty(log_probs, ref_log_probs, kind, loss_mask), loss_mask, loss_agg,
                    global_denoms)
    return loss, {KL_REF: loss.detach()}


@torch.no_grad()
def kl_in_reward(rewards: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                 loss_mask: torch.Tensor, *, beta: float, kind: str = "k1",
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """rewards − β·k(log π_old − log π_ref) on agent tokens (N, T), and {actor/kl_ref: the
    token-mean k over agent tokens}."""
    kl = kl_penalty(old_log_probs, ref_log_probs, kind, loss_mask)  # (N, T)
    out = torch.where(loss_mask, rewards - beta * kl, rewards)
    return out, {KL_REF: kl.sum() / loss_mask.sum().clamp(min=1)}
