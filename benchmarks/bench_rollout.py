"""Speed of the multi-turn rollout engine against plain `model.generate`, measured in one run
(CONVENTIONS.md 10).

Setup: the `tiny` random-init Qwen2 preset over a 1500-token BPE trained on the task, the
synthetic multi-hop task behind a real SearchEnv (bm25, top-2, compact prompts, 4 turns), N
questions, 24 new tokens per turn, temperature 1, one CPU thread. Prints, each on its own line:
    rollout_over_generate: X   agent tokens/s of `stppo.rollout.rollout` ÷ new tokens/s of one
                               `model.generate` call for the same N prompts producing the rollout's
                               per-row average number of agent tokens (min_new_tokens =
                               max_new_tokens, sampling) — goal ≥ 0.6
and the raw throughputs on other lines (best of R interleaved rounds after a warm-up: the
machine is shared, and the best round is the least disturbed one). The rollout pays
for what a single `generate` call does not: one prefill per turn over the grown context,
stop checks, decoding, the env (parsing, retrieval) and observation tokens.
Run: `OMP_NUM_THREADS=1 python benchmarks/bench_rollout.py [--questions N] [--repeats R]`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from stppo.envs import BM25Retriever, SearchEnv, build_synthetic_task, tokenizer_texts
from stppo.models import MODEL_PRESETS, build_random_model, train_tokenizer
from stppo.rollout import RolloutConfig, encode_prompt, rollout


def setup(n_questions: int):
    task = build_synthetic_task(n_sft=0, n_train=n_questions, n_val=0, n_test=0)
    env = SearchEnv.for_task(task, BM25Retriever(task.corpus), max_turns=4, topk=2,
                             prompt_style="compact")
    tok = train_tokenizer(tokenizer_texts(task, env), vocab_size=1500)
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()
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


def measure(model, tok, env, questions, cfg, repeats: int) -> tuple[float, float, int, int]:
    """Best throughputs over `repeats` interleaved rounds (one rollout, one generate each), so
    both see the same machine load: (rollout tokens/s, generate tokens/s, agent tokens of the
    warm-up rollout, new tokens per row given to generate)."""
    warm = rollout(model, tok, env, questions, cfg, generator=torch.Generator().manual_seed(99))
    per_row = max(1, round(int(warm.loss_mask.sum()) / len(questions)))
    ids, attn = generate_inputs(tok, env, questions)
    kwargs = dict(attention_mask=attn, do_sample=True, top_k=0, min_new_tokens=per_row,
                  max_new_tokens=per_row, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
    roll_tps, gen_tps = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        batch = rollout(model, tok, env, questions, cfg, generator=torch.Generator().manual_seed(r))
        roll_tps.append(int(batch.loss_mask.sum()) / (time.perf_counter() - t0))
        torch.manual_seed(r)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kwargs)
        gen_tps.append(per_row * len(questions) / (time.perf_counter() - t0))
        assert out.shape[1] - ids.shape[1] == per_row
    return max(roll_tps), max(gen_tps), int(warm.loss_mask.sum()), per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("STPPO_CACHE_DIR", cache)
        questions, env, tok, model = setup(args.questions)
        cfg = RolloutConfig(max_new_tokens=24, max_total_tokens=1024)
        roll_tps, gen_tps, tokens, per_row = measure(model, tok, env, questions, cfg, args.repeats)
    print(f"rollout_over_generate: {roll_tps / gen_tps:.2f}")
    print(f"rollout_tokens_per_s: {roll_tps:.0f} (about {tokens} agent tokens over "
          f"{len(questions)} trajectories, {env.max_turns} turns of <= {cfg.max_new_tokens})")
    print(f"generate_tokens_per_s: {gen_tps:.0f} ({per_row} new tokens x {len(questions)} rows)")

if __name__ == "__main__":
    main()
