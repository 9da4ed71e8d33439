"""Critic warm start (`trainer.critic_warmstart`): the value model regressed on the warm-started
policy's own rollouts before RL, so GAE presets start with a critic that predicts something.

The paper blames an inaccurate critic for PPO's collapse; a critic that starts at random (or from
the policy's backbone with a fresh head) has explained variance ≈ 0 for its first steps. Here,
before step 1: the warm-started policy rolls out `questions` training questions × `group_size`
samples (temperature of the run); the targets are the Monte-Carlo returns of those trajectories,
G_t = γ^(agent tokens after t) · score (GAE with λ = 1 and V ≡ 0: the recursion skips observation
tokens, as the trainer's GAE does); the critic is fitted to them by `steps` AdamW steps (lr
`lr`) of the unclipped value loss ½ agg(V − G)² over minibatches of `batch_size` trajectories.
One fifth of the trajectories (whole groups) is held out: explained variance on it before and
after (`critic_warmstart/explained_var_before`, `_after`, logged at step 0) says what the fit
bought.

The fit depends on the model, the task, the policy warm start and these settings — not on the
preset or the RL learning rates — so it is cached like the policy warm start: every GAE preset,
seed and learning rate of a study starts from the same critic.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import asdict

import torch

from stppo import metric_names as K
from stppo.algos import explained_variance, gae, value_loss
from stppo.cache import cache_dir, content_hash
from stppo.config import Config
from stppo.rollout import RolloutConfig, rollout
from stppo.train.prepare import outcome_rewards
from stppo.train.update import minibatches

log = logging.getLogger(__name__)
SEED = 0  # one critic warm start per (model, task, warm starts), shared by every run of a study
HOLDOUT = 5  # every HOLDOUT-th group is held out


def returns_of(batch, gamma: float) -> torch.Tensor:
    """(N, T) Monte-Carlo returns of the trajectories' scores over agent tokens."""
    rewards = outcome_rewards(batch)
    zeros = torch.zeros_like(rewards)
    _, returns = gae(rewards, zeros, batch.loss_mask, gamma, 1.0)
    return returns


def fit_critic(critic, batch, returns: torch.Tensor, *, steps: int, lr: float, batch_size: int,
               precision, seed: int = SEED) -> dict[str, float]:
    """Regress `critic` on `returns` (N, T); EV before/after on the held-out groups."""
    groups = torch.unique(batch.group_ids, return_inverse=True)[1]  # (N,)
    held = (groups % HOLDOUT) == HOLDOUT - 1
    train_rows, held_rows = (~held).nonzero().squeeze(1), held.nonzero().squeeze(1)
    if len(held_rows) == 0 or len(train_rows) == 0:
        raise ValueError("trainer.critic_warmstart.questions is too small to hold out a fifth "
                         f"of the groups (got {int(groups.max()) + 1} groups); use >= {HOLDOUT}")

    def ev(rows: torch.Tensor) -> float:
        mb = batch.select(rows)
        with torch.no_grad(), precision.autocast():
            v = critic.values(mb.input_ids, mb.attention_mask, positions=mb.loss_mask)
        return float(explained_variance(v, returns[rows], mb.loss_mask))

    before = ev(held_rows)
    opt = torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    critic.train()
    losses = []
    epochs = max(1, -(-steps * batch_size // len(train_rows)))  # enough passes for `steps` steps
    for i, idx in enumerate(minibatches(len(train_rows), batch_size, epochs, gen)):
        if i >= steps:
            break
        rows = train_rows[idx]
        mb = batch.select(rows)
        with precision.autocast():
            v = critic.values(mb.input_ids, mb.attention_mask, positions=mb.loss_mask)
        loss, _ = value_loss(v, v, returns[rows], mb.loss_mask, clip_range=None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    critic.eval()
    tail = losses[-max(1, len(losses) // 5):]
    return {K.CRITIC_WS_EV_BEFORE: before, K.CRITIC_WS_EV_AFTER: ev(held_rows),
            K.CRITIC_WS_LOSS: sum(tail) / len(tail)}


def critic_warm_start(cfg: Config, comps) -> dict[str, float]:
    """Fit `comps.critic` as the module docstring says (through the cache); returns the metrics
    to log at step 0 ({} when disabled or the preset has no critic)."""
    cw = cfg.trainer.critic_warmstart
    if not cw.enabled or comps.critic is None:
        return {}
    key = {"model": asdict(cfg.model), "task": asdict(cfg.task), "warmstart": asdict(cfg.trainer.warmstart),
           "critic_warmstart": asdict(cw), "rollout": asdict(cfg.trainer.rollout),
           "group_size": cfg.trainer.group_size, "gamma": cfg.algo.gamma, "version": 1}
    path = cache_dir("critic_warmstart", content_hash(key))
    with open(path / "lock", "w") as lock:  # parallel jobs: the first fits, the others load
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fit_or_load(cfg, comps, path)


def _fit_or_load(cfg: Config, comps, path) -> dict[str, float]:
    cw = cfg.trainer.critic_warmstart
    done = path / "metrics.json"
    if done.exists():
        comps.critic.load_state_dict(torch.load(path / "critic.pt", map_location="cpu"))
        log.info("critic warm start: reused %s", path)
        return json.loads(done.read_text())
    qs = comps.task.split("train")[: cw.questions]
    qs = [q for q in qs for _ in range(cfg.trainer.group_size)]
    rc = RolloutConfig.from_settings(cfg.trainer.rollout)
    with comps.precision.autocast():
        batch = rollout(comps.policy, comps.tokenizer, comps.env, qs, rc,
                        generator=torch.Generator().manual_seed(SEED))
    batch = batch.to(next(comps.critic.parameters()).device)
    metrics = fit_critic(comps.critic, batch, returns_of(batch, cfg.algo.gamma), steps=cw.steps,
                         lr=cw.lr, batch_size=cw.batch_size, precision=comps.precision)
    torch.save(comps.critic.state_dict(), path / "critic.pt.tmp")
    os.replace(path / "critic.pt.tmp", path / "critic.pt")
    done.write_text(json.dumps(metrics))
    log.info("critic warm start: explained variance %.3f -> %.3f on held-out rollouts",
             metrics[K.CRITIC_WS_EV_BEFORE], metrics[K.CRITIC_WS_EV_AFTER])
    return metrics
