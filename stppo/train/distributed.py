"""Data parallelism for one run: `torchrun --nproc_per_node=P run.py ...` (gloo on CPU, NCCL on GPU).

Each rank rolls out its share of the step's questions (whole groups: a GRPO group never spans
ranks) and keeps a full replica of the policy and critic. The update is the single-process update
of the global batch:

    loss denominators   D_tok, D_seq all-reduced per minibatch (`global_denoms`): each rank's loss
                        is its share of the whole minibatch's loss
    gradients           all-reduced as a *sum* (one flat buffer per optimizer step), then clipped
                        and applied identically on every rank, so the replicas never drift
    whitening, λ        advantage whitening statistics, clip_bias/norm, the clip-triggered RMS
                        ratio and the `grad` estimator's ‖C‖ are sums over ranks (`reduce`);
                        the rollout correction's weights, masks and metrics are computed on
                        every rank's rows (`gather_rows`)
    metrics             reduced once per step (mean, or max/min for *_max/*_min keys); rank 0 logs

A single process is the same code with `world == 1` (every collective is the identity).
Minibatches: each rank takes `minibatch_size / world` of its rows per optimizer step, so a global
minibatch has `minibatch_size` rows; with one minibatch per epoch the update equals the
single-process update to float tolerance (tests/test_distributed.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from stppo.metric_names import reduce_name

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """This process's place in the data-parallel group (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (identity for a single process) -------------------------------------------
    @property
    def collective_device(self) -> torch.device:
        """Where collectives run: this rank's GPU under NCCL, the CPU under gloo."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of `x` (a new tensor on x's device; `x` is not modified)."""
        if not self.active:
            return x
        y = x.detach().clone().to(self.collective_device)
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y.to(x.device)

    @property
    def reduce(self):
        """The all-reduce-sum hook of `stppo.algos` (None for a single process)."""
        return self.all_sum if self.active else None

    def global_denoms(self, loss_mask: torch.Tensor):
        """(D_tok, D_seq) of the global minibatch, or None for a single process."""
        if not self.active:
            return None
        d = self.all_sum(torch.stack([loss_mask.sum(), loss_mask.any(dim=1).sum()]).double())
        return d[0], d[1]

    def gather_rows(self, *xs: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], slice]:
        """Every rank's rows of the (n_r, T_r) tensors `xs`, concatenated in rank order (columns
        padded with 0 / False to the widest rank's), and the slice of this rank's rows in them:
        a statistic of the whole batch computed on them is the one-process batch's. Identity for a
        single process."""
        n, t = xs[0].shape
        if not self.active:
            return xs, slice(0, n)
        dev = self.collective_device
        sizes = [torch.zeros(2, dtype=torch.long, device=dev) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([n, t], dtype=torch.long, device=dev))
        rows = [int(s[0]) for s in sizes]
        width, most = max(int(s[1]) for s in sizes), max(rows)
        out = []
        for x in xs:
            pad = torch.zeros(most, width, dtype=torch.float64, device=dev)
            pad[:n, :t] = x.detach().to(dev, torch.float64)
            parts = [torch.empty_like(pad) for _ in range(self.world)]
            dist.all_gather(parts, pad)
            full = torch.cat([p[:k] for p, k in zip(parts, rows)]).to(x.device)
            out.append(full != 0 if x.dtype == torch.bool else full.to(x.dtype))
        start = sum(rows[:self.rank])
        return tuple(out), slice(start, start + n)

    def sync_grads(self, params: Sequence[torch.Tensor], bad: bool) -> bool:
        """Sum the gradients of `params` over ranks in one flat buffer; returns whether any rank
        flagged its step `bad` (a non-finite loss), so that all ranks skip it together."""
        if not self.active:
            return bad
        flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                          for p in params] + [torch.tensor([float(bad)], device=params[0].device,
                                                           dtype=params[0].dtype)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        i = 0
        for p in params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[i:i + n].view_as(p))
            i += n
        return bool(flat[-1] > 0)

    def reduce_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """One value per key over ranks: mean, or max/min for *_max/*_min keys (CONVENTIONS 5),
        over the ranks that have the key — a rank may lack one (a turn none of its trajectories
        reached has no per-turn metrics there)."""
        if not self.active:
            return dict(metrics)
        every: list = [None] * self.world
        dist.all_gather_object(every, sorted(metrics))
        keys = sorted(set().union(*every))
        dev = self.collective_device
        has = torch.tensor([k in metrics for k in keys], dtype=torch.float64, device=dev)
        x = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64, device=dev)
        how = [reduce_name(k) for k in keys]
        mx = torch.where(has > 0, x, float("-inf"))
        mn = torch.where(has > 0, x, float("inf"))
        mx[torch.tensor([h != "max" for h in how], device=dev)] = float("-inf")
        mn[torch.tensor([h != "min" for h in how], device=dev)] = float("inf")
        for t, op in ((x, dist.ReduceOp.SUM), (has, dist.ReduceOp.SUM), (mx, dist.ReduceOp.MAX),
                      (mn, dist.ReduceOp.MIN)):
            dist.all_reduce(t, op=op)
        return {k: float(mx[i] if h == "max" else mn[i] if h == "min" else x[i] / has[i])
                for i, (k, h) in enumerate(zip(keys, how))}

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers to every rank."""
        if self.active:
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of `items` (every world-th one, starting at its rank)."""
        return list(items[self.rank::self.world])


def from_env() -> Dist:
    """The group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def init(device: torch.device) -> Dist:
    """Join the process group torchrun started (gloo on CPU, NCCL on CUDA); a no-op without it."""
    d = from_env()
    if d.active and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and all_gather_object use the current device
        dist.init_process_group(backend=backend)
        log.info("data parallel: rank %d of %d (%s)", d.rank, d.world, backend)
    return d


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_divisible(world: int, questions_per_step: int, minibatch_size: int,
                    micro_batch_size: int = 0) -> None:
    """Every rank must run the same number of minibatches, and of micro-batches in each:
    one-line error otherwise."""
    for name, value in (("trainer.questions_per_step", questions_per_step),
                        ("trainer.minibatch_size", minibatch_size)):
        if value % world:
            raise ValueError(f"{name}={value} must be divisible by the number of data-parallel "
                             f"processes ({world})")
    rows = minibatch_size // world
    if micro_batch_size and rows % micro_batch_size:
        raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must divide the rows of "
                         f"each rank's minibatch (trainer.minibatch_size={minibatch_size} / "
                         f"{world} processes = {rows})")
