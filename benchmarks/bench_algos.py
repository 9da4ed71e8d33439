"""Speed of stppo.algos on CPU, measured in one run (CONVENTIONS.md 10).

Layout: N=64 trajectories of T=2048 tokens — a prompt, then ~8 agent turns alternating with
observation segments, then padding. Prints, each on its own line:
    st_ppo_over_ppo: X        forward+backward of the ST-PPO policy loss (turn ratio +
                              clip_bias_norm correction) ÷ the token-level PPO loss (goal ≤ 1.25)
    loop_over_vectorised: Y   forward+backward of a naive per-turn Python-loop turn ratio ÷ the
                              library's vectorised turn ratio (goal ≥ 20)
and the raw timings (medians over interleaved repeats after a warm-up) on other lines. The loss
timings are taken with the allocator in the state of a training process (see `main`); the
`fresh_process_*` lines give the same measurement taken first, in the fresh process.
Run: `OMP_NUM_THREADS=1 python benchmarks/bench_algos.py [--repeats R]` (≈ 5 s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import torch

from stppo.algos import log_ratio, policy_loss, turn_ratio

N, T, TURNS = 64, 2048, 8


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A realistic multi-turn layout with log-probs slightly off-policy."""
    rng = random.Random(seed)
    loss_mask = torch.zeros(N, T, dtype=torch.bool)
    turn_ids = torch.full((N, T), -1, dtype=torch.long)
    for i in range(N):
        pos = rng.randint(100, 300)  # prompt
        for k in range(rng.randint(TURNS - 2, TURNS + 2)):
            n_agent = rng.randint(20, 120)
            if pos + n_agent > T:
                break
            loss_mask[i, pos:pos + n_agent] = True
            turn_ids[i, pos:pos + n_agent] = k
            pos += n_agent + rng.randint(60, 160)  # observation
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g) * 3.0
    log_probs = old + 0.15 * torch.randn(N, T, generator=g)
    advantages = torch.randn(N, T, generator=g)
    return dict(log_probs=log_probs, old_log_probs=old, advantages=advantages,
                loss_mask=loss_mask, turn_ids=turn_ids)


def naive_turn_ratio(log_probs, old_log_probs, loss_mask, turn_ids) -> torch.Tensor:
    """The per-turn Python loop the library replaces."""
    delta = log_ratio(log_probs, old_log_probs, loss_mask)
    ratio = torch.ones_like(delta)
    for i in range(delta.shape[0]):
        for k in range(int(turn_ids[i].max()) + 1):
            sel = (turn_ids[i] == k) & loss_mask[i]
            ratio[i, sel] = delta[i, sel].mean().exp()
    return ratio


def timed(fn: Callable[[], None], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(fns: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per call. Rounds alternate between the functions (in turn-reversed order)
    so that load from other processes on the machine hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        timed(fn, warmup, 0)
    order = list(fns)
    for r in range(repeats):
        for k in (order if r % 2 == 0 else order[::-1]):
            times[k] += timed(fns[k], 0, 1)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b = make_batch()
    lp = b["log_probs"].clone().requires_grad_(True)
    common = dict(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean")
    rest = (b["old_log_probs"], b["advantages"], b["loss_mask"], b["turn_ids"])

    def ppo() -> None:
        lp.grad = None
        loss, _ = policy_loss(lp, *rest, ratio_level="token", **common)
        loss.backward()

    def st_ppo() -> None:
        lp.grad = None
        loss, _ = policy_loss(lp, *rest, ratio_level="turn",
                              correction={"kind": "clip_bias_norm", "tau": 0.5}, **common)
        loss.backward()

    def ratio_fwd_bwd(impl) -> Callable[[], None]:
        def run() -> None:
            lp.grad = None
            rho = impl(lp, b["old_log_probs"], b["loss_mask"], b["turn_ids"])
            (rho * b["advantages"]).sum().backward()
        return run

    def vectorised(log_probs, old, mask, tids):
        return turn_ratio(log_ratio(log_probs, old, mask), mask, tids)

    with torch.no_grad():
        same = torch.allclose(naive_turn_ratio(lp, *rest[:1], *rest[2:]),
                              vectorised(lp, *rest[:1], *rest[2:]), rtol=1e-5, atol=1e-6)
    turns = int((b["turn_ids"].max(dim=1).values + 1).sum())
    print(f"layout: N={N} T={T} agent_tokens={int(b['loss_mask'].sum())} turns={turns} "
          f"loop_matches_vectorised={same}")

    # A fresh process returns freed (N, T) buffers to the OS and page-faults them back on every
    # call; a training process has freed far larger buffers (logits, activations), after which
    # glibc keeps buffers below its raised mmap threshold (up to 32 MB) on the heap. The main
    # figure is measured in that state, reached by freeing one 16 MB buffer; the fresh-process
    # figure is printed too.
    cold = interleaved({"ppo": ppo, "st_ppo": st_ppo}, args.warmup, args.repeats)
    del_me = torch.empty(4 * 2**20)
    del del_me
    t = interleaved({"ppo": ppo, "st_ppo": st_ppo}, args.warmup, args.repeats)
    print(f"ppo_fwd_bwd_ms: {t['ppo'] * 1e3:.3f}")
    print(f"st_ppo_fwd_bwd_ms: {t['st_ppo'] * 1e3:.3f}")
    print(f"fresh_process_ppo_fwd_bwd_ms: {cold['ppo'] * 1e3:.3f}")
    print(f"fresh_process_st_ppo_fwd_bwd_ms: {cold['st_ppo'] * 1e3:.3f}")
    print(f"fresh_process_st_ppo_over_ppo: {cold['st_ppo'] / cold['ppo']:.3f}")
    t2 = interleaved({"loop": ratio_fwd_bwd(naive_turn_ratio), "vec": ratio_fwd_bwd(vectorised)},
                     max(1, args.warmup // 2), max(3, args.repeats // 5))
    print(f"loop_turn_ratio_fwd_bwd_ms: {t2['loop'] * 1e3:.3f}")
    print(f"vectorised_turn_ratio_fwd_bwd_ms: {t2['vec'] * 1e3:.3f}")
    print(f"st_ppo_over_ppo: {t['st_ppo'] / t['ppo']:.3f}")
    print(f"loop_over_vectorised: {t2['loop'] / t2['vec']:.1f}")


if __name__ == "__main__":
    main()
