"""Stale rollouts under torchrun: every rank samples with the same past policies.

    python -m torch.distributed.run --nproc_per_node=P tests/dp_offpolicy.py OUT

Each rank trains the tiny setup (random init, no warm start) STEPS steps at
trainer.offpolicy.lag=LAG, uniform mode, and writes OUT.rank{r}.pt: per step a digest of its
snapshot ring and of its policy, its groups' lags, the sampling log-probs of its agent tokens and
the trainer's forward of those tokens under the weights the script itself kept after step
t − 1 − lag (independent of the ring), and the step's metrics (reduced over ranks).
tests/test_distributed.py compares the ranks.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's stppo, whatever the environment has installed

import torch  # noqa: E402

from conftest import TINY_OVERRIDES  # noqa: E402
from stppo.config import compose, to_config  # noqa: E402
from stppo.models import policy_log_probs  # noqa: E402
from stppo.tracker import Tracker  # noqa: E402
from stppo.train import distributed, loop  # noqa: E402
from stppo.train.setup import build_components  # noqa: E402

STEPS, LAG = 4, 2
OVERRIDES = [*TINY_OVERRIDES, "algo=ppo", "trainer.warmstart.enabled=false", "trainer.actor_lr=1e-2",
             f"trainer.total_steps={STEPS}", "trainer.questions_per_step=4", "trainer.group_size=2",
             "trainer.minibatch_size=8", "trainer.device=cpu", "tracking.enabled=false",
             f"trainer.offpolicy.lag={LAG}", "trainer.offpolicy.lag_mode=uniform"]


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(out: str) -> None:
    d = distributed.init(torch.device("cpu"))
    cfg = to_config(compose(OVERRIDES))
    comps = build_components(cfg, progress=False)
    for m in (comps.policy, comps.critic):
        d.broadcast_module(m)
    batches = []
    prepare = loop.prepare_batch

    def spy(batch, *args, **kwargs):
        res = prepare(batch, *args, **kwargs)
        batches.append(res[0])
        return res

    loop.prepare_batch = spy
    trainer = loop.Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=None, dist=d)
    kept = {0: copy.deepcopy(comps.policy.state_dict())}
    record = []
    for step in range(1, STEPS + 1):
        metrics = trainer.train_step(step)
        b = batches[-1]
        sampler = torch.zeros_like(b.rollout_log_probs)
        for age in b.rollout_lags.unique().tolist():
            model = copy.deepcopy(comps.policy).eval()
            model.load_state_dict(kept[step - 1 - age])
            with torch.no_grad():
                lp = policy_log_probs(model, b.input_ids, b.attention_mask, positions=b.loss_mask)
            rows = b.rollout_lags == age
            sampler[rows] = lp[rows]
        kept[step] = copy.deepcopy(comps.policy.state_dict())
        ring = trainer.sampler.history.snapshots
        record.append({
            "ring": {s: digest(w) for s, w in ring.items()}, "policy": digest(comps.policy.state_dict()),
            "group_lags": b.rollout_lags[::cfg.trainer.group_size].tolist(),
            "rollout": b.rollout_log_probs[b.loss_mask], "sampler": sampler[b.loss_mask],
            "question_ids": b.meta["question_ids"], "metrics": metrics})
    torch.save(record, f"{out}.rank{d.rank}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
