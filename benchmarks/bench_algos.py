"""Speed of stppo.algos on CPU, measured in one run (ratios, never timed asserts).

Layout: N=64 trajectories of T=2048 tokens — a prompt, then ~8 agent turns alternating with
observation segments, then padding. Prints, each on its own line:
    st_ppo_over_ppo: X        forward+backward of the ST-PPO policy loss (turn ratio +
                              clip_bias_norm correction) ÷ the token-level PPO loss (goal ≤ 1.1)
    loop_over_vectorised: Y   forward+backward of a naive per-turn Python-loop turn ratio ÷ the
                              library's vectorised turn ratio (goal ≥ 20)
and the raw timings on other lines. Times are medians over repeats after a warm-up, the
functions called in a fresh random order each round, of the process's CPU time: torch runs on one
thread here, so on an idle machine that is the wall time, while on a shared machine every
preemption adds a whole time slice (~4 ms here, longer than a call) to the call it lands in —
measured at a load of 3.5 on 2 cores, about half the calls got one and wall-clock ratios ranged
from 0.7 to 2.5 between runs, CPU-time ratios within ±0.02. Wall-clock figures: `*_wall`.

Process state. The loss allocates (N, T) temporaries of 0.5–1 MB. glibc serves blocks above its
mmap threshold (128 KB at start) with fresh mmap'd pages — hundreds of page faults per loss call
— but raises the threshold to the size of any mmap'd block freed, up to 32 MB, and then serves
such blocks from the heap. A training process has freed far larger blocks before its first loss
(the policy forward/backward that produces log_probs, rollout KV caches grown by concatenation):
measured here, after one forward/backward of the `tiny` Qwen2 policy over a 64×512 minibatch, a
loss call causes no page fault. So `st_ppo_over_ppo` and the `*_fwd_bwd_ms` lines are measured
after a stand-in of that step (`policy_step_standin`), and `faults_per_call` shows the state. The
same measurement taken first, before anything large was freed, is printed as `fresh_process_*`
for comparison; it is noisier (page faults cost kernel time).
Run: `OMP_NUM_THREADS=1 python benchmarks/bench_algos.py [--repeats R]` (≈ 7 s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

try:
    import resource  # page-fault counts (POSIX)
except ImportError:  # pragma: no cover
    resource = None

import torch

from stppo.algos import PRESETS, log_ratio, policy_loss, turn_ratio

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


def policy_step_standin(rows: int = 4, hidden: int = 96, vocab: int = 1500) -> None:
    """One forward/backward of a toy causal-LM policy (the `tiny` preset's width and vocabulary:
    embedding, one MLP block, tied output head, next-token log-probs) over a (rows, T)
    micro-batch: the step a trainer runs before every policy loss, which allocates and frees
    activations of 3–50 MB."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(vocab, hidden)
    mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                              torch.nn.Linear(4 * hidden, hidden))
    ids = torch.randint(0, vocab, (rows, T), generator=g)
    h = emb(ids)  # (rows, T, hidden)
    h = h + mlp(h)
    log_p = torch.log_softmax(h @ emb.weight.T, dim=-1)  # (rows, T, vocab)
    log_p[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def interleaved(fns: dict[str, Callable[[], None]], warmup: int,
                repeats: int) -> dict[str, dict[str, float]]:
    """Per function: median process CPU seconds (`cpu`), wall seconds (`wall`) and minor page
    faults (`faults`) per call. Each round calls every function once, in a fresh random order,
    so that load from other processes hits all of them alike (a fixed alternation can beat with
    the scheduler's period and charge every preemption to the same function)."""
    samples: dict[str, dict[str, list[float]]] = {
        k: {"wall": [], "cpu": [], "faults": []} for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    order, rng = list(fns), random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for k in order:
            f0, c0, t0 = _faults(), time.process_time(), time.perf_counter()
            fns[k]()
            s = samples[k]
            s["wall"].append(time.perf_counter() - t0)
            s["cpu"].append(time.process_time() - c0)
            s["faults"].append(_faults() - f0)
    return {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b = make_batch()
    lp = b["log_probs"].clone().requires_grad_(True)
    specs = {name: PRESETS[name].spec() for name in ("ppo", "st_ppo")}  # clip 0.2, seq-mean-token-mean
    rest = (b["old_log_probs"], b["advantages"], b["loss_mask"], b["turn_ids"])

    def ppo() -> None:
        lp.grad = None
        loss, _ = policy_loss(lp, *rest, specs["ppo"])
        loss.backward()

    def st_ppo() -> None:
        lp.grad = None
        loss, _ = policy_loss(lp, *rest, specs["st_ppo"])  # turn ratios, clip_bias_norm τ 0.5
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

    # First in the fresh process, then after a stand-in policy step (see the module docstring).
    cold = interleaved({"ppo": ppo, "st_ppo": st_ppo}, args.warmup, args.repeats)
    policy_step_standin()
    t = interleaved({"ppo": ppo, "st_ppo": st_ppo}, args.warmup, args.repeats)
    print(f"ppo_fwd_bwd_ms: {t['ppo']['cpu'] * 1e3:.3f}")
    print(f"st_ppo_fwd_bwd_ms: {t['st_ppo']['cpu'] * 1e3:.3f}")
    print(f"st_ppo_over_ppo_wall: {t['st_ppo']['wall'] / t['ppo']['wall']:.3f}")
    print(f"faults_per_call: ppo={t['ppo']['faults']:.0f} st_ppo={t['st_ppo']['faults']:.0f} "
          f"fresh_process: ppo={cold['ppo']['faults']:.0f} st_ppo={cold['st_ppo']['faults']:.0f}")
    print(f"fresh_process_ppo_fwd_bwd_ms: {cold['ppo']['cpu'] * 1e3:.3f}")
    print(f"fresh_process_st_ppo_fwd_bwd_ms: {cold['st_ppo']['cpu'] * 1e3:.3f}")
    print(f"fresh_process_st_ppo_over_ppo: {cold['st_ppo']['cpu'] / cold['ppo']['cpu']:.3f}")
    print(f"fresh_process_st_ppo_over_ppo_wall: "
          f"{cold['st_ppo']['wall'] / cold['ppo']['wall']:.3f}")
    t2 = interleaved({"loop": ratio_fwd_bwd(naive_turn_ratio), "vec": ratio_fwd_bwd(vectorised)},
                     max(1, args.warmup // 2), max(3, args.repeats // 5))
    print(f"loop_turn_ratio_fwd_bwd_ms: {t2['loop']['cpu'] * 1e3:.3f}")
    print(f"vectorised_turn_ratio_fwd_bwd_ms: {t2['vec']['cpu'] * 1e3:.3f}")
    print(f"st_ppo_over_ppo: {t['st_ppo']['cpu'] / t['ppo']['cpu']:.3f}")
    print(f"loop_over_vectorised: {t2['loop']['cpu'] / t2['vec']['cpu']:.1f}")


if __name__ == "__main__":
    main()
