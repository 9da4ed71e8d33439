"""PPO update cost vs a raw training step, and the cost of the exact clip-bias norm.

Prints, measured in one run on CPU with the `small` model:
  update_over_raw: X            PPO update time per token ÷ raw forward+backward+AdamW step on
                                the same tokens (goal ≤ 1.3)
  exact_clip_bias_fraction: Y   extra time of one exact parameter-space ‖C‖ as a fraction of a
                                minibatch step

    python benchmarks/bench_step.py [--model small] [--rows 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from stppo.config import compose, to_config  # noqa: E402
from stppo.models import policy_log_probs  # noqa: E402
from stppo.rollout import rollout  # noqa: E402
from stppo.train.loop import rollout_config  # noqa: E402
from stppo.train.prepare import prepare_batch  # noqa: E402
from stppo.train.setup import build_components  # noqa: E402
from stppo.train.update import UpdateContext, actor_update  # noqa: E402


def median_time(fn, repeats: int) -> float:
    """Median process CPU time of `fn` (one torch thread: CPU time = compute time, and other jobs
    on the machine do not leak into it as they do into wall time)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = to_config(compose([f"model={args.model}", "algo=st_ppo", "trainer.warmstart.enabled=false",
                             "tracking.enabled=false", f"trainer.minibatch_size={args.rows}",
                             f"trainer.questions_per_step={args.rows}", "trainer.group_size=1"]))
    c = build_components(cfg, progress=False)
    qs = c.task.split("train")[: args.rows]
    batch = rollout(c.policy, c.tokenizer, c.env, qs, rollout_config(cfg),
                    generator=torch.Generator().manual_seed(0))
    batch, _ = prepare_batch(batch, c.policy, c.critic, None, cfg.algo)
    tokens = int(batch.attention_mask.sum())
    policy = c.policy
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)

    def raw_step():
        lp = policy_log_probs(policy, batch.input_ids, batch.attention_mask)
        loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()

    def ppo_step(exact_every: int):
        tr = replace(cfg.trainer, exact_clip_bias_every=exact_every)
        ctx = UpdateContext(cfg.algo, tr, torch.Generator().manual_seed(0))
        return lambda: actor_update(policy, opt, batch, ctx)

    t_raw = median_time(raw_step, args.repeats)
    t_ppo = median_time(ppo_step(0), args.repeats)
    t_exact = median_time(ppo_step(1), args.repeats)
    print(f"model: {args.model}  rows: {args.rows}  tokens: {tokens}  T: {batch.input_ids.shape[1]}")
    print(f"raw_step_s: {t_raw:.4f}")
    print(f"ppo_update_s: {t_ppo:.4f}")
    print(f"ppo_update_exact_clip_bias_s: {t_exact:.4f}")
    print(f"update_over_raw: {t_ppo / t_raw:.3f}")
    print(f"exact_clip_bias_fraction: {(t_exact - t_ppo) / t_ppo:.3f}")


if __name__ == "__main__":
    main()
