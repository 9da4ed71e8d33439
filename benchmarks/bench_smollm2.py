"""Where a SmolLM2-135M-Instruct step of `+experiment=smollm2_learn` spends its time on a CPU, and
how it compares with the plain Hugging Face calls that do the same work.

Prints, measured in one run (wall clock, the recipe's torch threads; medians of --repeats steps
after one warm-up step):
  profile lines          per part of one training step: the rollout (its turns' generation and
                         the env), the batch preparation (rewards, advantages, critic values), the
                         actor and critic updates, the step-KL forward; and one live check
  step_over_raw: X       the step ÷ (HF `generate` of the same tokens — per turn, from the whole
                         context, as many new tokens as the turn's longest row — plus one raw
                         forward/backward/AdamW of the policy, and of the critic when the preset has
                         one, on the step's batch) — goal ≤ 1.3
  bf16_over_fp32: Y      the step under `model.dtype=native_bf16` ÷ under float32, on the same
                         questions (only where the CPU computes bf16 natively) — goal < 1

    python benchmarks/bench_smollm2.py [--algo ppo] [--repeats 3] [--threads 2] [--no-fp32]

The warm start of the recipe comes from the cache (the first call trains it, ~10 min).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from stppo.algos import token_log_probs
from stppo.config import compose, to_config
from stppo.models import position_ids_from_mask
from stppo.models.precision import native_bf16
from stppo.rollout import engine as engine_module
from stppo.tracker import Tracker
from stppo.train import loop
from stppo.train.setup import build_components

PARTS = {"generate_turn": (engine_module, "generate_turn"), "prepare_batch": (loop, "prepare_batch"),
         "actor_update": (loop, "actor_update"), "critic_update": (loop, "critic_update"),
         "step_kl": (loop, "step_kl")}


@contextmanager
def timed_parts(times: dict[str, list[float]]):
    """Record the wall time of each call of PARTS' functions (and the env's turns) in `times`."""
    from stppo.envs import SearchEnv

    originals = {name: getattr(mod, attr) for name, (mod, attr) in PARTS.items()}
    env_step = SearchEnv.step_batch

    def wrap(name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            times[name].append(time.perf_counter() - t)
            return out
        return timed

    for name, (mod, attr) in PARTS.items():
        setattr(mod, attr, wrap(name, originals[name]))
    SearchEnv.step_batch = wrap("env", env_step)
    try:
        yield
    finally:
        for name, (mod, attr) in PARTS.items():
            setattr(mod, attr, originals[name])
        SearchEnv.step_batch = env_step


def trainer_for(args, dtype: str, weights=None):
    """The recipe's trainer under compute `dtype`; `weights` (the policy's and the critic's state
    dicts) replace the warm start (which is cached per dtype): both dtypes start alike."""
    cfg = to_config(compose(["+experiment=smollm2_learn", f"algo={args.algo}", f"model.dtype={dtype}",
                             f"trainer.threads={args.threads}", "tracking.enabled=false", "trainer.progress=false",
                             *(["trainer.warmstart.enabled=false"] if weights else [])]))
    torch.set_num_threads(args.threads)
    comps = build_components(cfg, progress=False)
    if weights:
        comps.policy.load_state_dict(weights[0])
        if comps.critic is not None:
            comps.critic.load_state_dict(weights[1])
    return cfg, comps, loop.Trainer(cfg, comps, Tracker(None, "bench", enabled=False), run_dir=None)


def profile(args, dtype: str, weights=None) -> dict:
    """One warm-up step, then `repeats` steps with their parts timed; the last step's batch."""
    cfg, comps, trainer = trainer_for(args, dtype, weights)
    copy = lambda m: {k: v.clone() for k, v in m.state_dict().items()} if m is not None else None  # noqa: E731
    start = (copy(comps.policy), copy(comps.critic)) if weights is None else None
    batches = []
    real_prepare = loop.prepare_batch
    loop.prepare_batch = lambda b, *a, **k: batches.append(b) or real_prepare(b, *a, **k)
    try:
        trainer.train_step(1)
        steps, times = [], defaultdict(list)
        with timed_parts(times):
            for s in range(args.repeats):
                t = time.perf_counter()
                trainer.train_step(2 + s)
                steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        trainer._live_check(2 + args.repeats)
        live = time.perf_counter() - t
    finally:
        loop.prepare_batch = real_prepare
    per_step = {k: sum(v) / args.repeats for k, v in times.items()}
    return {"cfg": cfg, "comps": comps, "step": statistics.median(steps), "parts": per_step, "live": live,
            "batch": batches[-1], "start": start}


def turn_contexts(batch):
    """Per turn k: (left-padded contexts before turn k's first agent token, attention mask, the
    turn's longest generation) over the rows that have turn k."""
    out = []
    for k in range(int(batch.turn_ids.max()) + 1):
        rows, ctxs, lengths = [], [], []
        for i in range(len(batch)):
            where = (batch.turn_ids[i] == k).nonzero().flatten()
            if len(where):
                rows.append(i)
                ctxs.append(batch.input_ids[i, : int(where[0])])
                lengths.append(len(where))
        width = max(len(c) for c in ctxs)
        ids = torch.zeros(len(ctxs), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for j, c in enumerate(ctxs):
            ids[j, width - len(c):], attn[j, width - len(c):] = c, 1
        out.append((ids, attn, max(lengths)))
    return out


def raw_step(comps, batch, repeats: int) -> float:
    """HF generate of the batch's turns + one raw forward/backward/AdamW per trained model."""
    policy, precision, pad = comps.policy, comps.precision, comps.tokenizer.pad_token_id
    turns = turn_contexts(batch)
    models = [policy] + ([comps.critic] if comps.critic is not None else [])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-12) for m in models]  # moves nothing measurable
    mask = batch.attention_mask

    def once():
        policy.eval()
        with torch.inference_mode(), precision.autocast():
            for ids, attn, n in turns:
                policy.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n,
                                do_sample=True, top_k=0, pad_token_id=pad)
        for model, opt in zip(models, opts):
            model.train()
            with precision.autocast():
                if model is policy:
                    logits = policy(input_ids=batch.input_ids, attention_mask=mask.long(),
                                    position_ids=position_ids_from_mask(mask), use_cache=False).logits
                    lp = token_log_probs(logits[:, :-1].float(), batch.input_ids[:, 1:])
                    loss = -(lp * batch.loss_mask[:, 1:]).sum() / batch.loss_mask.sum()
                else:
                    v = model.values(batch.input_ids, mask, positions=batch.loss_mask)
                    loss = (v.float() ** 2)[batch.loss_mask].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        policy.eval()

    once()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algo", default="ppo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-fp32", action="store_true", help="skip the float32 comparison")
    args = p.parse_args()
    bf16 = native_bf16("cpu")
    main_dtype = "native_bf16"
    m = profile(args, main_dtype)
    b = m["batch"]
    print(f"SmolLM2-135M-Instruct, {args.algo}, {args.threads} torch threads, compute "
          f"{m['comps'].precision.describe()}; batch {len(b)} rows, {int(b.attention_mask.sum())} tokens "
          f"({int(b.loss_mask.sum())} agent), {int(b.turn_ids.max()) + 1} turns at most")
    for name, secs in sorted(m["parts"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:14s} {secs:7.2f} s per step ({secs / m['step']:.0%})")
    print(f"  step           {m['step']:7.2f} s;  one live check ({m['cfg'].trainer.collapse.questions} "
          f"questions, greedy) {m['live']:.2f} s")
    raw = raw_step(m["comps"], b, args.repeats)
    print(f"raw_step_s: {raw:.2f}")
    print(f"step_over_raw: {m['step'] / raw:.3f}")
    if bf16 and not args.no_fp32:
        f = profile(args, "float32", m["start"])
        print(f"fp32_step_s: {f['step']:.2f}")
        print(f"bf16_over_fp32: {m['step'] / f['step']:.3f}")
    elif not bf16:
        print("bf16_over_fp32: n/a (this CPU has no native bfloat16: native_bf16 runs float32)")


if __name__ == "__main__":
    main()
