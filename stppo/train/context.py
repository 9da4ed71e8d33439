"""`UpdateContext`: what the update needs besides the batch (the run's loss config, the trainer's
schedule, data parallelism, precision), shared by `update`, `microbatch` and `actor_loss`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stppo.config import AlgoConfig, TrainerConfig
from stppo.models import Precision
from stppo.train.distributed import Dist


@dataclass
class UpdateContext:
    """What the update needs besides the batch; `opt_steps` counts optimizer steps over the run
    (it schedules the exact clip-bias diagnostic)."""
    algo: AlgoConfig
    trainer: TrainerConfig
    generator: torch.Generator
    opt_steps: int = 0
    nan_at_first_minibatch: bool = False  # fault injection for tests (trainer.debug_nan_steps)
    dist: Dist = Dist()  # data parallelism (stppo.train.distributed); one process by default
    precision: Precision = Precision()  # autocast for the forwards (stppo.models.precision)
    max_turns: int = 0  # > 0: log the per-turn breakdown of turns 0..max_turns-1

    @property
    def minibatch_rows(self) -> int:
        """Rows of this rank's share of one global minibatch of `trainer.minibatch_size`."""
        return self.trainer.minibatch_size // self.dist.world

    @property
    def micro_rows(self) -> int:
        """Rows per forward/backward inside a minibatch (`trainer.micro_batch_size`, else all)."""
        return self.trainer.micro_batch_size or self.minibatch_rows
