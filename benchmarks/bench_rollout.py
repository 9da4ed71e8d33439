"""Speed of the multi-turn rollout engine against plain `model.generate`, measured in one run
(CONVENTIONS.md 10).

Setup: the `tiny` random-init Qwen2 preset over a 1500-token BPE trained on the task, the
synthetic multi-hop task behind a real SearchEnv (bm25, top-2, compact prompts, 4 turns), N
questions, 24 new tokens per turn, temperature 1, one CPU thread. Prints, each on its own line:
    rollout_over_generate: X   agent tokens/s of `stppo.rollout.rollout` ÷ new tokens/s of one
                               `model.generate` call for the same N prompts producing the rollout's
                               per-row average number of agent tokens (min_new_tokens =
                               max_new_tokens, sampling) — goal ≥ 0.8
and the raw throughputs, wall-clock figures and page faults per call on other lines. The rollout
pays for what a single `generate` call does not: one prefill per turn of the observation tokens
over the grown context, attention over contexts ~4x longer, stop checks, decoding, the env
(parsing, retrieval). Two lines count that work, per side (exact counts, not timings):
    model_tokens_per_agent_token: tokens fed through the model per sampled token
    keys_per_decoding_step: mean number of real keys one decoding step attends to

Timing: R rounds after a warm-up, each calling the rollout and `generate` once in a fresh random
order; throughputs from the median process CPU time over the rounds (torch runs on one thread, so
on an idle machine that is the wall time; on a shared one preemptions inflate wall time, not CPU
time — see benchmarks/bench_algos.py).

Process state. The rollout's per-turn prefill allocates activations and per-turn KV stacks of a
few MB. In a fresh process glibc serves such blocks from fresh mmap'd pages and trims its heap
after every burst — measured here, ~50,000 minor page faults and ~0.15 s of kernel time per
rollout, ~15% of its cost — while a trainer has freed far larger blocks (its update's
forward/backward) before every rollout, after which glibc keeps such blocks on its heap: measured
here in a loop of rollout, `prepare_batch` and `actor_update` (bench_vs_trl.py's workload), a
rollout then causes 0–1 page faults. So the rounds run after a stand-in of that update (one
forward/backward of the policy over a rollout batch); `faults_per_call` shows the state.
On CUDA (`--device cuda`: the model on the GPU, both sides under the trainer's bf16 autocast) the
figures are wall-clock times between device synchronisations, and the ratio is the wall one: CPU
time there only counts the host's launches and waits.
Run: `OMP_NUM_THREADS=1 python benchmarks/bench_rollout.py [--questions N] [--repeats R]
[--device cuda]`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

try:
    import resource  # page-fault counts (POSIX)
except ImportError:  # pragma: no cover
    resource = None

import torch

from stppo.envs import BM25Retriever, SearchEnv, build_synthetic_task, tokenizer_texts
from stppo.models import (MODEL_PRESETS, build_random_model, policy_log_probs, resolve_precision,
                          train_tokenizer)
from stppo.rollout import RolloutConfig, encode_prompt, rollout


def setup(n_questions: int, device: str = "cpu"):
    task = build_synthetic_task(n_sft=0, n_train=n_questions, n_val=0, n_test=0)
    env = SearchEnv.for_task(task, BM25Retriever(task.corpus), max_turns=4, topk=2,
                             prompt_style="compact")
    tok = train_tokenizer(tokenizer_texts(task, env), vocab_size=1500)
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).to(device).eval()
    return task.split("train"), env, tok, model


def generate_inputs(tok, env, questions) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's prompts, left-padded as `generate` expects for decoder-only models."""
    prompts = [encode_prompt(tok, env.prompt(q)) for q in questions]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    return ids, attn


def rollout_work(batch) -> tuple[float, float]:
    """(tokens fed through the model per agent token, mean keys per decoding step) of a rollout
    batch. Every token but each trajectory's last is fed once (the last sampled one never is); a
    decoding step feeds the previous agent token of the same turn (the turn's first token comes
    from the prefill) and attends to every real position up to it: t keys for the token at t."""
    agent = batch.loss_mask
    fed = int(batch.attention_mask.sum()) - agent.shape[0]
    decoded = agent[:, 1:] & (batch.turn_ids[:, 1:] == batch.turn_ids[:, :-1])  # (N, T-1)
    positions = torch.arange(1, agent.shape[1]).expand_as(decoded)  # (N, T-1) index t
    keys = float(positions[decoded].float().mean())
    return fed / int(agent.sum()), keys


def generate_work(attn: torch.Tensor, per_row: int) -> tuple[float, float]:
    """The same two counts for one `generate` call of `per_row` new tokens per prompt."""
    prompt = attn.sum(1).float()  # (N,) real prompt tokens
    n = attn.shape[0]
    fed = float(prompt.sum()) + n * (per_row - 1)
    steps = torch.arange(1, per_row, dtype=torch.float32)  # the i-th decoding step: prompt + i keys
    keys = float((prompt[:, None] + steps[None, :]).mean()) if per_row > 1 else 0.0
    return fed / (n * per_row), keys


def update_standin(model, batch) -> None:
    """One forward/backward of the policy over a rollout batch: what a trainer runs between
    rollouts (it frees activation blocks far larger than any the rollout allocates)."""
    model.train()
    policy_log_probs(model, batch.input_ids, batch.attention_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def measure(model, tok, env, questions, cfg, repeats: int) -> dict:
    """Median CPU/wall seconds and page faults per call of the rollout and of `generate`, over
    `repeats` rounds in random order, after a warm-up and the update stand-in. On CUDA both run
    under the trainer's autocast and each wall time lies between two device synchronisations."""
    device = next(model.parameters()).device
    precision = resolve_precision("auto", None, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with precision.autocast():
        warm = rollout(model, tok, env, questions, cfg, generator=torch.Generator().manual_seed(99))
    per_row = max(1, round(int(warm.loss_mask.sum()) / len(questions)))
    ids, attn = (t.to(device) for t in generate_inputs(tok, env, questions))
    kwargs = dict(attention_mask=attn, do_sample=True, top_k=0, min_new_tokens=per_row,
                  max_new_tokens=per_row, pad_token_id=tok.pad_token_id)
    tokens = {}

    def run_rollout(r: int) -> None:
        gen = torch.Generator().manual_seed(r)
        with precision.autocast():
            batch = rollout(model, tok, env, questions, cfg, generator=gen)
        tokens.setdefault("rollout", []).append(int(batch.loss_mask.sum()))

    def run_generate(r: int) -> None:
        torch.manual_seed(r)
        with torch.no_grad(), precision.autocast():
            out = model.generate(ids, **kwargs)
        assert out.shape[1] - ids.shape[1] == per_row
        tokens.setdefault("generate", []).append(per_row * len(questions))

    fns = {"rollout": run_rollout, "generate": run_generate}
    run_generate(99)
    with precision.autocast():
        update_standin(model, warm.to(device))
    stats = {name: {"cpu": [], "wall": [], "faults": []} for name in fns}
    order = random.Random(0)
    for r in range(repeats):
        for name in order.sample(sorted(fns), len(fns)):
            sync()
            f, c, w = _faults(), time.process_time(), time.perf_counter()
            fns[name](r)
            sync()
            stats[name]["cpu"].append(time.process_time() - c)
            stats[name]["wall"].append(time.perf_counter() - w)
            stats[name]["faults"].append(_faults() - f)
    out = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in stats.items()}
    for name in fns:
        out[name]["tokens"] = statistics.median(tokens[name])
    out["per_row"] = per_row
    out["clock"] = "wall" if device.type == "cuda" else "cpu"
    out["work"] = {"rollout": rollout_work(warm), "generate": generate_work(attn.cpu(), per_row)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("STPPO_CACHE_DIR", cache)
        questions, env, tok, model = setup(args.questions, args.device)
        cfg = RolloutConfig(max_new_tokens=24, max_total_tokens=1024)
        m = measure(model, tok, env, questions, cfg, args.repeats)
    roll, gen = m["rollout"], m["generate"]
    clock = m["clock"]  # process CPU time on CPU, synchronised wall time on CUDA
    roll_tps, gen_tps = roll["tokens"] / roll[clock], gen["tokens"] / gen[clock]
    print(f"rollout_over_generate: {roll_tps / gen_tps:.2f}  (device {args.device}, {clock} time)")
    print(f"rollout_tokens_per_s: {roll_tps:.0f} (about {roll['tokens']:.0f} agent tokens over "
          f"{len(questions)} trajectories, {env.max_turns} turns of <= {cfg.max_new_tokens})")
    print(f"generate_tokens_per_s: {gen_tps:.0f} ({m['per_row']} new tokens x "
          f"{len(questions)} rows)")
    wall = (roll["tokens"] / roll["wall"]) / (gen["tokens"] / gen["wall"])
    print(f"rollout_over_generate_wall: {wall:.2f}")
    print(f"faults_per_call: rollout {roll['faults']:.0f}, generate {gen['faults']:.0f}")
    (r_fed, r_keys), (g_fed, g_keys) = m["work"]["rollout"], m["work"]["generate"]
    print(f"model_tokens_per_agent_token: rollout {r_fed:.2f}, generate {g_fed:.2f}")
    print(f"keys_per_decoding_step: rollout {r_keys:.0f}, generate {g_keys:.0f}")


if __name__ == "__main__":
    main()
