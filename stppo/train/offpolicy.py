"""Stale rollouts (`trainer.offpolicy`, docs/design.md §8): the batch of step t sampled by an
older policy, as an asynchronous pipeline would, exactly and reproducibly.

    θ_s          the policy's weights after step s (θ_0: the start; a rollback at step r makes
                 the rolled-back weights θ_r and restarts the history there: `start` = r)
    lag ℓ        a group of step t is sampled by θ_src, src = max(start, t − 1 − ℓ); its age
                 t − 1 − src (≤ ℓ) is what is logged; π_old stays θ_{t−1}, the live policy
    fixed        every group of the step has lag `trainer.offpolicy.lag` = k
    uniform      each group draws ℓ ∈ {0, …, k} (a generator of (seed, step), the trainer's)

The three policies of the decoupled form: the sampler's log-probs (`Batch.rollout_log_probs`)
are θ_src's as the rollout engine computes them; π_old = θ_{t−1} is recomputed by the trainer
(`prepare_batch`, never taken from the update: `old_log_probs_from_update` is False at lag > 0);
π_θ is the update's. A rollout correction (TIS) acts between π_old and the sampler.

`PolicyHistory` keeps θ_{t−k} … θ_{t−1} (k host copies of the policy's state dict; θ_t is the
live policy) between steps, and goes into the checkpoint. `StaleSampler` loads the snapshot a
group needs into one behaviour copy of the policy (on the policy's device; the static engine's
bfloat16 sampler copy of it follows, `stppo.rollout.weights`) and rolls out per age. For the
`offpolicy/kl_to_current` metric it also runs the trainer's forward with those weights on the
rows they sampled (`Batch.stale_log_probs`), so the engine's own sampler/trainer mismatch does
not enter it. Under data parallelism every rank holds the same snapshots (taken from replicas
kept equal by the synchronised optimizer step) and draws the same lags for the whole step.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from stppo import metric_names as K
from stppo.algos.kl import sampled_k3
from stppo.batch import Batch, concat_batches, rows
from stppo.config import Config, OffPolicyConfig
from stppo.models import Precision
from stppo.rollout.episodes import pad_token_id
from stppo.train.distributed import Dist
from stppo.train.prepare import FORWARD_CHUNK, eval_log_probs
from stppo.train.rollout_corr import correction_for
from stppo.train.sampler import OnPolicySampler, Refill, Sampler, step_seed

# roll(model, questions, generator, group_ids) → Batch: one rollout of `questions` (each
# repeated group_size times, consecutive) by `model`
Roll = Callable[[torch.nn.Module, list, torch.Generator, "list[int] | None"], Batch]


def draw_lags(cfg: OffPolicyConfig, n_groups: int, seed: int) -> list[int]:
    """The lag of each of a step's `n_groups` groups: k for all (fixed), or uniform on 0…k drawn
    by a generator seeded with `seed` (the caller derives it from (run seed, step))."""
    if cfg.lag_mode == "fixed":
        return [cfg.lag] * n_groups
    rng = random.Random(seed)
    return [rng.randint(0, cfg.lag) for _ in range(n_groups)]


def host_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict copied to host memory (tensors shared in the module, such as
    tied embeddings, stay shared: one copy)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key not in seen:
            seen[key] = t.detach().to("cpu", copy=True)
        out[name] = seen[key]
    return out


@dataclass
class PolicyHistory:
    """The snapshot ring: θ_s for the steps s a later step can still ask for."""
    lag: int
    start: int = 0
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def source(self, step: int, lag: int) -> int:
        """The step whose weights sample a group of lag `lag` at step `step`."""
        return max(self.start, step - 1 - lag)

    def record(self, step: int, policy: torch.nn.Module) -> None:
        """At step `step`, after its rollouts and before its update: keep θ_{step−1} (the live
        weights) and drop what step + 1 cannot ask for. Between steps the ring holds at most
        `lag` snapshots."""
        keep_from = max(self.start, step - self.lag)
        self.snapshots = {s: w for s, w in self.snapshots.items() if s >= keep_from}
        if self.lag > 0 and step - 1 >= keep_from:
            self.snapshots[step - 1] = host_copy(policy)

    def restart(self, step: int) -> None:
        """A rollback at `step`: the live (rolled-back) weights are θ_step; older ones are gone."""
        self.start, self.snapshots = step, {}

    def state_dict(self) -> dict:
        return {"start": self.start, "snapshots": self.snapshots}

    def load_state_dict(self, s: dict) -> None:
        self.start, self.snapshots = s["start"], dict(s["snapshots"])


class StaleSampler(Sampler):
    """Rolls out a step's groups, each with the policy of its lag (module docstring); the
    `Sampler` of trainer.offpolicy.lag > 0."""

    on_policy = False  # π_old = θ_{t−1} is not the sampler: the trainer recomputes it

    def __init__(self, cfg: Config, comps, rc, dist: Dist = Dist()) -> None:
        super().__init__(cfg, comps, rc, dist)
        tr = cfg.trainer
        self.offpolicy, self.policy, self.precision = tr.offpolicy, comps.policy, comps.precision
        self.chunk, self.pad_id = tr.micro_batch_size or FORWARD_CHUNK, pad_token_id(comps.tokenizer)
        self.history = PolicyHistory(tr.offpolicy.lag)
        self.behaviour: torch.nn.Module | None = None  # the copy the snapshots are loaded into
        self.held: int | None = None  # the step whose weights `behaviour` holds

    # -- the Sampler interface --------------------------------------------------------------------
    def rollout(self, step: int, questions: list, salt: str) -> Batch:
        """This rank's groups, each rolled out by the policy of its lag: the lags of the whole
        step are drawn on every rank, then sharded; rows of age a draw from the generator of
        (seed, step, rank, a) — age 0's is the on-policy one."""
        lags = self.dist.shard(draw_lags(self.offpolicy, len(questions), step_seed(self.cfg.seed, step, "lags")))
        return self._by_age(step, self.dist.shard(questions), lags, salt)

    def refill(self, step: int, salt: str) -> Refill:
        """DAPO's refill rollouts: their groups draw lags too."""
        g = self.cfg.trainer.group_size

        def sample(questions: list, r: int) -> Batch:
            n = len(questions) // g
            lags = draw_lags(self.offpolicy, n, step_seed(self.cfg.seed, step, f"{salt}-refill{r}-lags"))
            return self._by_age(step, questions[::g], lags, f"{salt}-refill{r}")
        return sample

    def record(self, step: int) -> None:
        self.history.record(step, self.policy)  # θ_{step-1}, before this step's update

    def metrics(self, batch: Batch, sampled: torch.Tensor, reduce=None
                ) -> tuple[dict[str, float], Optional[torch.Tensor]]:
        sampler_old = correction_for(self.cfg.algo.spec.rollout_correction).old_from_sampler
        live = live_log_probs(batch, self.policy, sampler_old, self.precision, self.chunk)
        return offpolicy_metrics(batch, reduce, agent_mask=sampled, live=live), live

    def restart(self, step: int) -> None:
        self.history.restart(step)

    def state_dict(self) -> dict:
        return {"offpolicy": self.history.state_dict()}

    def load_state_dict(self, state: dict, step: int) -> None:
        if "offpolicy" in state:
            self.history.load_state_dict(state["offpolicy"])
        else:  # (a checkpoint without snapshots: the history starts here)
            self.history.restart(step)

    # -- sampling by age ------------------------------------------------------------------------
    def _by_age(self, step: int, groups: list, lags: list[int], salt: str) -> Batch:
        g = self.cfg.trainer.group_size

        def generator(age: int) -> torch.Generator:
            return self._generator(step, salt if age == 0 else f"{salt}-age{age}")

        return self.sample(step, [q for q in groups for _ in range(g)], lags, self._roll, generator)

    def model(self, step: int, source: int) -> torch.nn.Module:
        """θ_source at step `step`: the live policy for source = step − 1, else the behaviour
        copy loaded with its snapshot."""
        if source == step - 1:
            return self.policy
        if self.behaviour is None:
            self.behaviour = copy.deepcopy(self.policy).eval().requires_grad_(False)
            for p in self.behaviour.parameters():
                p.grad = None
        if self.held != source:
            self.behaviour.load_state_dict(self.history.snapshots[source])
            self.held = source
        return self.behaviour

    def sample(self, step: int, questions: Sequence, lags: Sequence[int], roll: Roll,
               generator: Callable[[int], torch.Generator]) -> Batch:
        """Roll out `questions` (len(lags) groups of consecutive rows), group g by the policy of
        lag lags[g]; one rollout per distinct age a, drawing from `generator(a)`; rows keep their
        order. Sets `rollout_lags` (the ages) and `stale_log_probs`."""
        n_groups = len(lags)
        size = len(questions) // n_groups
        ages = [step - 1 - self.history.source(step, lag) for lag in lags]
        order = sorted(set(ages))
        parts, placed = [], []
        for age in order:
            groups = [g for g in range(n_groups) if ages[g] == age]
            idx = [g * size + j for g in groups for j in range(size)]
            model = self.model(step, step - 1 - age)
            gids = None if len(order) == 1 else [g for g in groups for _ in range(size)]
            part = roll(model, [questions[i] for i in idx], generator(age), gids)
            parts.append(self._stale(part, model, age))
            placed += idx
        if len(parts) == 1:
            return parts[0]
        merged = concat_batches(parts, self.pad_id)
        out = rows(merged, torch.argsort(torch.tensor(placed)))  # back to the questions' order
        return replace(out, group_ids=torch.arange(len(questions)) // size)

    def _stale(self, b: Batch, model: torch.nn.Module, age: int) -> Batch:
        """`b` with its rows' age and log π_stale by the trainer's forward (zeros at age 0)."""
        n, t = b.input_ids.shape
        stale = torch.zeros(n, t, dtype=torch.float32)
        if age > 0:
            device = next(model.parameters()).device
            with self.precision.autocast():
                stale = eval_log_probs(model, b.to(device), self.chunk).float().cpu()
        return replace(b, rollout_lags=torch.full((n,), age, dtype=torch.long), stale_log_probs=stale)


@torch.no_grad()
def live_log_probs(batch: Batch, policy: torch.nn.Module, sampler_old: bool, precision: Precision,
                   chunk: int) -> torch.Tensor:
    """log π of the batch's tokens under the live policy θ_{t−1} (before the step's update): the
    recomputed π_old — or, when π_old is the sampler's (`sampler_old`: a rollout correction's
    bypass mode), one forward of the live policy for `offpolicy/kl_to_current` alone."""
    if not sampler_old:
        return batch.old_log_probs
    with precision.autocast():
        return eval_log_probs(policy, batch, chunk)


def offpolicy_metrics(batch: Batch, reduce=None, agent_mask: Optional[torch.Tensor] = None,
                      live: Optional[torch.Tensor] = None) -> dict[str, float]:
    """`offpolicy/lag_mean`, `lag_max` over the batch's groups and `offpolicy/kl_to_current` =
    mean over agent tokens of k3 = e^r − 1 − r, r = log π_live − log π_stale (Schulman's k3: ≥ 0
    per token, its mean under π_stale is KL(π_stale ‖ π_live); 0 on rows sampled by the live
    policy itself); over
    all ranks when `reduce` (an all-reduce sum) is given. `agent_mask` (N, T): the agent tokens
    as sampled (default `batch.loss_mask`) — a decoupled rollout correction's rejection has
    removed tokens from the prepared batch's mask, and the distance is the sampler's, not the
    kept tokens'. `live` (N, T): the live policy's log-probs (`live_log_probs`; default
    `batch.old_log_probs`)."""
    if batch.rollout_lags is None or (batch.old_log_probs is None and live is None):
        raise ValueError("offpolicy_metrics needs a stale batch with the live policy's log-probs")
    lags = batch.rollout_lags.double()  # (N,)
    _, group = torch.unique(batch.group_ids, return_inverse=True)  # (N,) 0..G-1
    per_group = torch.zeros(int(group.max()) + 1, dtype=torch.float64, device=lags.device)
    per_group = per_group.scatter_reduce(0, group, lags, "amax", include_self=False)  # (G,)
    agent = batch.loss_mask if agent_mask is None else agent_mask
    mask = agent & (batch.rollout_lags > 0)[:, None]  # (N, T)
    live = batch.old_log_probs if live is None else live
    k3 = sampled_k3(live, batch.stale_log_probs.to(live))  # (N, T) ≥ 0; mean under π_stale: KL(π_stale ‖ π_live)
    sums = torch.stack([per_group.sum(), torch.tensor(float(len(per_group)), dtype=torch.float64,
                                                      device=lags.device),
                        k3[mask].sum(), agent.sum().double()])
    if reduce is not None:
        sums = reduce(sums)
    return {K.OFFPOLICY_LAG_MEAN: float(sums[0] / sums[1].clamp(min=1)),
            K.OFFPOLICY_LAG_MAX: float(lags.max()) if len(lags) else 0.0,
            K.OFFPOLICY_KL_TO_CURRENT: float(sums[2] / sums[3].clamp(min=1))}


def sampler_class(offpolicy: OffPolicyConfig) -> type[Sampler]:
    """The sampler of a run's `trainer.offpolicy`: on-policy at lag 0, stale otherwise — the one
    place that reads the lag to choose (`stppo.train.sampler`)."""
    return OnPolicySampler if offpolicy.lag == 0 else StaleSampler
