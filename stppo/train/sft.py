"""Supervised warm start on oracle trajectories (agent tokens only in the loss).

Random-init models cannot follow the tool format, so every study starts here. The result is
cached by (model, task, tokenizer, warm-start settings): every preset and seed of a study starts
from the same weights (a fair comparison), and the second run does not pay for it again.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from stppo.cache import cache_dir, content_hash
from stppo.config import WarmStartConfig
from stppo.models import Precision, policy_log_probs
from stppo.rollout import collate_episodes

log = logging.getLogger(__name__)
DONE = "warmstart.done"


def warmstart_dir(key_parts: dict) -> Path:
    return cache_dir("warmstart", content_hash(key_parts))


def sft_loss(policy, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of the agent tokens (the head on those tokens only)."""
    lp = policy_log_probs(policy, input_ids, attention_mask, positions=loss_mask)  # (n, T)
    return -(lp.sum() / loss_mask.sum().clamp(min=1))


def train_sft(policy, tokenizer, episodes, ws: WarmStartConfig, *, seed: int,
              progress: bool = True, precision: Precision = Precision()) -> list[float]:
    """Fit `policy` to the episodes' agent tokens; returns the loss curve. The forward runs under
    the run's `precision` (autocast), the optimizer steps its (float32) parameters."""
    batch = collate_episodes(tokenizer, episodes).to(next(policy.parameters()).device)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=ws.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, ws.warmup_steps, ws.steps))
    policy.train()
    losses: list[float] = []
    bar = tqdm(range(ws.steps), desc="warm start (SFT)", disable=not progress, leave=False)
    n = len(batch)
    perm, pos = torch.randperm(n, generator=gen), 0
    for _ in bar:
        if pos + ws.batch_size > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + ws.batch_size]
        pos += ws.batch_size
        mb = batch.select(idx)
        keep = mb.attention_mask.any(dim=0).nonzero().max() + 1  # trim right padding
        with precision.autocast():
            loss = sft_loss(policy, mb.input_ids[:, :keep], mb.attention_mask[:, :keep],
                            mb.loss_mask[:, :keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    policy.eval()
    return losses


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
