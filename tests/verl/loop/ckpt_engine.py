"""TEST-ONLY checkpoint engine for verl's off-policy trainers on a machine without NCCL (the CPU).

With `trainer.offpolicy.lag=1` stppo runs verl's one-step off-policy trainer: the rollout has GPUs
(here: logical ones) of its own and gets the weights after every step through verl's
`CheckpointEngineManager` — prepare → build_topology → init_process_group → the trainer's
`send_weights` and the rollout worker's `receive_weights` → finalize — with the backend
`actor_rollout_ref.rollout.checkpoint_engine.backend`, NCCL by default. This backend,
`BACKEND`, registered with verl's public `CheckpointEngineRegistry.register`, moves the full
tensors through Ray's object store instead: trainer rank 0 puts `{name: tensor}` (CPU copies)
into a named mailbox actor, the rollout worker takes the version it was asked for. Other trainer
ranks drain their generator (FSDP gathers need every rank) and send nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "stppo_object_store"
MAILBOX = "stppo_weights_mailbox"


class Mailbox:
    """Holds the latest weights; `take(version)` waits until that version (or a later one) is in."""

    def __init__(self):
        self.version, self.state = None, None
        self.changed = asyncio.Condition()

    async def put(self, state: dict[str, torch.Tensor], version: Any) -> None:
        async with self.changed:
            self.version, self.state = version, state
            self.changed.notify_all()

    async def take(self, version: Any) -> dict[str, torch.Tensor]:
        async with self.changed:
            await self.changed.wait_for(lambda: self.state is not None and (version is None or self.version == version))
            return self.state


def _mailbox():
    """The job's mailbox (created by whichever side comes first). Ray ends an actor when the last
    handle to it goes, so each engine keeps its handle for the run."""
    return ray.remote(Mailbox).options(name=MAILBOX, get_if_exists=True, num_cpus=0).remote()


@CheckpointEngineRegistry.register(BACKEND)
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """verl's CheckpointEngine over a Ray actor (see the module docstring)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **kwargs) -> None:
        self.is_master = is_master
        self.role, self.rank, self.box = None, None, None

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return ({"role": ["trainer"] * actor_wg_world_size, "rank": list(range(actor_wg_world_size))},
                {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size))})

    def init_process_group(self, role: str, rank: int, **kwargs) -> None:
        self.role, self.rank = role, rank
        if self.box is None:
            self.box = _mailbox()

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights, global_steps: int | None = None):
        state = {}
        async for name, tensor in _aiter(weights):
            if self.rank == 0:
                tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.rank == 0:
            await self.box.put.remote(state, global_steps)
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        state = await self.box.take.remote(global_steps)
        for name, tensor in state.items():
            yield name, tensor


async def _aiter(weights):
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
