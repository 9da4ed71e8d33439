"""Who samples a step's rollouts: one interface, two implementations (docs/design.md §8).

    OnPolicySampler   the live policy samples (trainer.offpolicy.lag = 0)
    StaleSampler      each group is sampled by a policy `lag` updates older (stppo.train.offpolicy)

A sampler owns what sampling needs and leaves behind: the snapshots of past policies and the lag
draws (stale), the behaviour copy they are loaded into, whether π_old needs a forward of its own
(`on_policy`: an update may take π_old from its own forward only when the live policy sampled),
its metrics, and its state (`state_dict`: the snapshots go into the checkpoint). The trainer
calls, per step:

    rollout(step, questions, salt)   this rank's rollout of the step's questions (all ranks')
    refill(step, salt)               DAPO's refill rollouts, sampled the same way
    record(step)                     after the rollouts, before the update (stale: keep θ_{t−1})
    metrics(batch, sampled, reduce)  (metrics, log π of the live policy θ_{t−1}) after the
                                     preparation — the live log-probs the step's KL reads
    restart(step)                    after a rollback (the rolled-back weights are the newest)

`stppo.train.offpolicy.sampler_class(cfg.trainer.offpolicy)` is the one place that reads the lag
to choose.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from stppo.batch import Batch
from stppo.cache import content_hash
from stppo.config import Config
from stppo.rollout import RolloutConfig, rollout
from stppo.train.distributed import Dist

Refill = Callable[[list, int], Batch]  # (questions, round) → a refill rollout (stppo.train.dapo)


def step_seed(seed: int, step: int, salt: str = "") -> int:
    return int(content_hash(seed, step, salt), 16) % (2**62)


class Sampler:
    """The interface (module docstring); `comps` the trainer's Components."""

    on_policy = True

    def __init__(self, cfg: Config, comps, rc: RolloutConfig, dist: Dist = Dist()) -> None:
        self.cfg, self.c, self.rc, self.dist = cfg, comps, rc, dist

    def _roll(self, model, questions: list, generator: torch.Generator,
              group_ids: Optional[list] = None) -> Batch:
        c = self.c
        return rollout(model, c.tokenizer, c.env, questions, self.rc, group_ids=group_ids, generator=generator)

    def _generator(self, step: int, key: str) -> torch.Generator:
        return torch.Generator().manual_seed(step_seed(self.cfg.seed, step, key))

    def rollout(self, step: int, questions: list, salt: str) -> Batch:
        raise NotImplementedError

    def refill(self, step: int, salt: str) -> Refill:
        raise NotImplementedError

    def record(self, step: int) -> None:
        pass

    def metrics(self, batch: Batch, sampled: torch.Tensor, reduce=None
                ) -> tuple[dict[str, float], Optional[torch.Tensor]]:
        return {}, batch.old_log_probs

    def restart(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, step: int) -> None:
        pass


class OnPolicySampler(Sampler):
    """The live policy samples every group, from the generator of (seed, step, rank)."""

    def rollout(self, step: int, questions: list, salt: str) -> Batch:
        g = self.cfg.trainer.group_size
        qs = [q for q in self.dist.shard(questions) for _ in range(g)]  # whole groups per rank
        return self._roll(self.c.policy, qs, self._generator(step, salt))

    def refill(self, step: int, salt: str) -> Refill:
        return lambda questions, r: self._roll(self.c.policy, questions,
                                               self._generator(step, f"{salt}-refill{r}"))
