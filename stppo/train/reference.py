"""The actor update of token-level PPO, top to bottom: the page to read first.

What the trainer's update does for `algo=ppo` — `stppo.train.update.actor_update` through
`microbatch`, `actor_loss` and `stppo.algos.policy_loss` (the clip path) — written out as one
function, in the order it happens, with the equations of docs/design.md §2:

    δ_t = clamp(log π_θ(y_t) − log π_old(y_t), −20, 20)         on agent tokens (loss_mask)
    ρ_t = exp(δ_t)
    s_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε_low, 1 + ε_high))   the clipped surrogate
    L   = (1/D_seq) Σ_i (1/|y_i|) Σ_{t∈i} s_t                     seq-mean-token-mean (ppo's)

per minibatch of `epochs` shuffled passes over the batch, then the gradient norm is clipped and
the optimizer steps. The trainer computes the same numbers another way — s = aρ + b as one dot
product (`stppo.algos.loss`), with its metrics, data parallelism, micro-batches and every other
preset — and tests/test_reference_update.py holds the two equal: the loss and the gradients
before each optimizer step. What comes before (π_old, the advantages: `stppo.train.prepare`)
and beside it (the critic, KL, the entropy bonus, rollout corrections) is not here.
"""

from __future__ import annotations

import torch

from stppo.batch import Batch
from stppo.models import policy_log_probs


def ppo_actor_update(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *,
                     epochs: int, minibatch_size: int, generator: torch.Generator,
                     clip_low: float = 0.2, clip_high: float = 0.2,
                     max_grad_norm: float = 1.0) -> list[float]:
    """`epochs` × minibatches of PPO's clipped loss on `batch` (its `old_log_probs` and
    `advantages` filled), one optimizer step each; returns the minibatches' losses."""
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(batch), generator=generator)  # a fresh shuffle per epoch
        for start in range(0, len(batch), minibatch_size):
            mb = batch.select(order[start:start + minibatch_size])
            mask = mb.loss_mask  # (n, T) the agent's tokens
            log_probs = policy_log_probs(policy, mb.input_ids, mb.attention_mask,
                                         positions=mask)  # (n, T), with graph
            delta = torch.where(mask, log_probs - mb.old_log_probs, 0.0).clamp(-20.0, 20.0)
            ratio = delta.exp()  # (n, T) ρ, 1 off agent tokens
            adv = torch.where(mask, mb.advantages, 0.0)  # (n, T)
            surrogate = torch.maximum(-adv * ratio,
                                      -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
            lengths = mask.sum(dim=1)  # (n,) |y_i|
            per_row = torch.where(mask, surrogate, 0.0).sum(dim=1) / lengths.clamp(min=1)
            loss = per_row[lengths > 0].mean()  # over the trajectories with agent tokens

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            losses.append(float(loss))
    return losses
