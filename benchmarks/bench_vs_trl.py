"""stppo's own trainer step against TRL's `GRPOTrainer` on the same GRPO workload, in one run
(speed claims are ratios measured in one run, never timed asserts). Needs TRL: `make trl-env`, then
`OMP_NUM_THREADS=1 .venv-trl/bin/python benchmarks/bench_vs_trl.py` (trl is not a dependency of
stppo; .venv-trl holds trl 1.16 and stppo --no-deps).

Workload (both sides): a random-init `transformers.Qwen2ForCausalLM` (hidden 128, 4 layers,
4 heads, 4 KV heads, intermediate 512, tied embeddings) over a byte-level BPE of 2048 ids
trained with `stppo.models.train_tokenizer` on synthetic sentences; both sides start from the
same weights. 256 plain prompts of 40–64 tokens (synthetic sentences); per step 16 prompts × 4
completions, temperature 1, at most 64 new tokens, ending at EOS only; reward = the fraction of
vowels among the completion's letters (special tokens removed), the same function on both sides;
GRPO, no KL, one epoch, one minibatch of all 64 rows, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8,
no weight decay, constant lr), max grad norm 1, float32, CPU. 2 warm-up + 6 measured steps per
side in this one process, the two sides' steps alternating (TRL's step k, then stppo's step k,
run from a callback at the end of TRL's step and kept off TRL's clock).

stppo's step: `stppo.rollout.rollout` with `stppo.envs.single_turn.SingleTurnEnv` (one turn, no
stop tags), then `stppo.train.prepare.prepare_batch` and `stppo.train.update.actor_update` with
the `grpo` preset (token ratio, GRPO advantages, no critic, no KL, seq-mean-token-mean, clip 0.2),
π_old computed as the trainer computes it (where the trainer has
`stppo.train.update.old_log_probs_from_update`, it skips that forward for this on-policy update).

TRL's step (`GRPOConfig`, read against TRL 1.16's source): per_device_train_batch_size=64,
num_generations=4 (16 prompts per step), gradient_accumulation_steps=1, steps_per_generation=1,
num_iterations=1 (one optimizer step per generation batch, so TRL skips its old-log-prob forward
and takes the current log-probs, detached, as π_old), beta=0 (no reference model),
loss_type='grpo' (per-sequence token mean, then mean over sequences = stppo's
seq-mean-token-mean), scale_rewards='group', epsilon=0.2, importance_sampling_level='token',
mask_truncated_completions=False, max_completion_length=64, temperature=1, top_p=1, top_k=0,
learning_rate=1e-4, lr_scheduler_type='constant', optim='adamw_torch', max_grad_norm=1,
bf16/fp16 off, gradient_checkpointing off, use_cpu, no vLLM, no logging, saving or evaluation.
Remaining differences from stppo's grpo: advantages divide by (group std + 1e-4) in TRL and by
(group std + 1e-6) in stppo (both the unbiased std); TRL runs the LM head over completion
positions only, and a stppo trainer without `old_log_probs_from_update` recomputes π_old in a
forward pass of its own and runs the LM head over every position; TRL's generation is
`model.generate`, stppo's its rollout engine.

Timing: process CPU time with one torch thread (and no tokenizer thread pool), the two sides'
steps interleaved. The machine is shared (2 vCPUs): other jobs inflate wall time far more than
CPU time, but under load CPU time too grows (shared caches and cores slow every instruction), so
absolute seconds depend on the load while alternating the sides step by step exposes both to the
same load and keeps the ratio (see benchmarks/bench_algos.py). A step is the trainer's whole step;
generation is stppo's `rollout` call and TRL's `_generate` call (tokenising, `generate`,
decoding), update is the rest (rewards, advantages, π_old where computed, forward/backward,
optimizer step). Prints, each on its line:
    stppo_over_trl: X    completion tokens per CPU second over the measured steps, stppo ÷ TRL
and each side's tokens per second and median step, generation and update seconds and minor page
faults per step. Goal ≥ 1.5.

Page faults. Both updates allocate logits-sized blocks (64 rows × 128 positions × 2048 ids ×
4 bytes = 67 MB) that glibc serves with fresh pages whenever its heap has no free block that
large — which depends on the whole process's allocation history, not on either trainer: measured
here, stppo's update (the same code) took 1.7–3.0 CPU s a step across runs and process states,
with 16,000–190,000 faults. Interleaving
charges that noise to both sides alike, but it still moves the ratio by ±0.1 between runs; run it
a few times. (PyTorch's THP_MEM_ALLOC_ENABLE=1 cuts the fault count ~10×; not set here.)

On a GPU (`--device cuda`): both models on the GPU under bfloat16 autocast with float32 master
weights — TRL with `bf16=True` (accelerate's autocast) and its default transformers generation
path (`model.generate`), stppo with its trainer's precision and its default engine there (the
static path: fixed-size cache, CUDA graphs; `stppo.rollout.static`) — and every time is wall time
between device synchronisations instead of CPU time.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Callable

try:
    import resource  # page-fault counts (POSIX)
except ImportError:  # pragma: no cover
    resource = None

import warnings  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no Rust thread pool on either side
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed arguments

import torch  # noqa: E402

from stppo.config import AlgoConfig, TrainerConfig  # noqa: E402
from stppo.envs.base import Question  # noqa: E402
from stppo.envs.single_turn import SingleTurnEnv  # noqa: E402
from stppo.models import build_random_model, resolve_precision, train_tokenizer  # noqa: E402
from stppo.rollout import RolloutConfig, encode_prompt, rollout  # noqa: E402
from stppo.train.prepare import prepare_batch  # noqa: E402
from stppo.train.update import UpdateContext, actor_update  # noqa: E402

try:  # the trainer's rule for skipping π_old's forward on a provably on-policy update
    from stppo.train.update import old_log_probs_from_update  # noqa: E402
except ImportError:  # a trainer that always runs it
    old_log_probs_from_update = None

ARCH = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 512}
VOCAB, N_PROMPTS, PROMPT_TOKENS = 2048, 256, (40, 64)
PROMPTS_PER_STEP, GROUP, MAX_NEW = 16, 4, 64
LR, MAX_GRAD_NORM = 1e-4, 1.0
CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"


def synthetic_sentences(n: int, seed: int) -> list[str]:
    """n sentences over a Zipf-distributed vocabulary of 3000 made-up words."""
    rng = random.Random(seed)
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                    for _ in range(3500)})[:3000]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    out = []
    for _ in range(n):
        ws = rng.choices(words, weights, k=rng.randint(6, 24))
        out.append(" ".join(ws).capitalize() + rng.choice(".!?"))
    return out


def build_workload(seed: int = 0):
    """(tokenizer, 256 prompt texts of 40–64 tokens, the initial model)."""
    tok = train_tokenizer(synthetic_sentences(20000, seed), vocab_size=VOCAB)
    rng, lo_hi, prompts = random.Random(seed + 1), PROMPT_TOKENS, []
    pool = iter(synthetic_sentences(100000, seed + 2))
    while len(prompts) < N_PROMPTS:
        target, text = rng.randint(*lo_hi), ""
        while len(tok.encode(text, add_special_tokens=False)) < target:
            text = (text + " " + next(pool)).strip()
        if lo_hi[0] <= len(tok.encode(text, add_special_tokens=False)) <= lo_hi[1]:
            prompts.append(text)
    return tok, prompts, build_random_model(ARCH, tok, seed=seed)


def vowel_fraction(text: str, specials: tuple[str, ...]) -> float:
    """The reward: vowels ÷ letters of the completion, special-token texts removed."""
    for s in specials:
        text = text.replace(s, "")
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0


def step_order(n_steps: int, seed: int) -> list[list[int]]:
    """Prompt indices of each step: epoch-wise shuffled passes, 16 distinct prompts a step."""
    order, out = [], []
    for epoch in range(-(-n_steps * PROMPTS_PER_STEP // N_PROMPTS)):
        perm = list(range(N_PROMPTS))
        random.Random(seed * 1000 + epoch).shuffle(perm)
        order += perm
    for s in range(n_steps):
        out.append(order[s * PROMPTS_PER_STEP:(s + 1) * PROMPTS_PER_STEP])
    return out


def clock() -> float:
    """CPU seconds on the CPU; on a GPU wall seconds after the device finished its queue."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


DEVICE = torch.device("cpu")  # main() sets it from --device


def stppo_trainer(model, tok, prompts: list[str], n_steps: int, seed: int):
    """stppo's trainer step as a function of the step index → {gen, update, tokens} (CPU s)."""
    algo = AlgoConfig(name="grpo")  # the preset's loss (stppo.algos.PRESETS)
    trainer = TrainerConfig(questions_per_step=PROMPTS_PER_STEP, group_size=GROUP, ppo_epochs=1,
                            minibatch_size=PROMPTS_PER_STEP * GROUP, actor_lr=LR,
                            max_grad_norm=MAX_GRAD_NORM, threads=1, device=DEVICE.type)
    precision = resolve_precision("auto", None, DEVICE)  # bf16 autocast on a GPU, none on CPU
    ctx = UpdateContext(algo, trainer, torch.Generator(), precision=precision)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    specials = tuple(tok.all_special_tokens)
    env = SingleTurnEnv(lambda q, text: vowel_fraction(text, specials))
    cfg = RolloutConfig(max_new_tokens=MAX_NEW, max_total_tokens=PROMPT_TOKENS[1] + MAX_NEW + 1,
                        temperature=1.0)
    order = step_order(n_steps, seed)
    # As the trainer's step: π_old from prepare_batch's own forward, unless the trainer knows
    # the update to be on-policy (here: one epoch, one minibatch of all rows, no KL).
    skip = old_log_probs_from_update is not None and old_log_probs_from_update(
        SimpleNamespace(algo=algo, trainer=trainer))
    prepare_kwargs = {"skip_old": True} if skip else {}

    def step(s: int) -> dict:
        qs = [Question(str(i), prompts[i], ()) for i in order[s] for _ in range(GROUP)]
        f0, t0 = _faults(), clock()
        with precision.autocast():
            batch = rollout(model, tok, env, qs, cfg, generator=torch.Generator().manual_seed(seed + s))
        t1 = clock()
        batch, _ = prepare_batch(batch.to(DEVICE), model, None, None, algo, precision=precision,
                                 **prepare_kwargs)
        ctx.generator.manual_seed(seed + s)
        actor_update(model, opt, batch, ctx)
        t2 = clock()
        return {"gen": t1 - t0, "update": t2 - t1, "tokens": int(batch.loss_mask.sum()),
                "faults": _faults() - f0}

    return step


def run_trl(model, tok, prompts: list[str], n_steps: int, seed: int, out_dir: str,
            between: Callable[[int], None]) -> list[dict]:
    """TRL's GRPOTrainer for n_steps → per step {gen, update, tokens} (CPU s, tokens);
    `between(k)` runs after TRL's step k, outside its clock."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    specials = tuple(tok.all_special_tokens)
    counted: list[int] = []  # completion tokens of each reward call (one per step)

    def reward(prompts, completions, completion_ids, **_):
        counted.append(sum(len(ids) for ids in completion_ids))
        return [vowel_fraction(c, specials) for c in completions]

    args = GRPOConfig(
        output_dir=out_dir, max_steps=n_steps, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        num_generations=GROUP, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, beta=0.0, loss_type="grpo", scale_rewards="group", epsilon=0.2,
        importance_sampling_level="token", mask_truncated_completions=False,
        max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, bf16=DEVICE.type == "cuda", fp16=False,
        gradient_checkpointing=False, use_cpu=DEVICE.type == "cpu", use_vllm=False, report_to="none",
        logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        log_completions=False, seed=seed, dataloader_num_workers=0, shuffle_dataset=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    gen_times: list[float] = []
    generate = trainer._generate

    def timed_generate(*a, **k):
        t = clock()
        out = generate(*a, **k)
        gen_times.append(clock() - t)
        return out

    trainer._generate = timed_generate
    begin: list[tuple[float, int]] = []  # (CPU s, page faults) at each step's start / end
    end: list[tuple[float, int]] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            begin.append((clock(), _faults()))

        def on_step_end(self, *a, **k):
            end.append((clock(), _faults()))
            between(len(end) - 1)
            begin.append((clock(), _faults()))

    trainer.add_callback(StepClock())
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary line
    trainer.train()
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(begin, end)]
    if not len(steps) == len(gen_times) == len(counted) == n_steps:
        raise RuntimeError(f"TRL ran {len(steps)} steps, {len(gen_times)} generations, "
                           f"{len(counted)} reward calls; expected {n_steps} of each")
    return [{"gen": g, "update": st - g, "tokens": n, "faults": f}
            for (st, f), g, n in zip(steps, gen_times, counted)]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def summary(steps: list[dict]) -> dict:
    total = sum(s["gen"] + s["update"] for s in steps)
    return {"tokens_per_s": sum(s["tokens"] for s in steps) / total,
            "step": statistics.median(s["gen"] + s["update"] for s in steps),
            "gen": statistics.median(s["gen"] for s in steps),
            "update": statistics.median(s["update"] for s in steps),
            "tokens": statistics.median(s["tokens"] for s in steps),
            "faults": statistics.median(s["faults"] for s in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_vs_trl: --device cuda but torch sees no CUDA device")
    try:
        import trl
    except ImportError:
        sys.exit("bench_vs_trl: trl is not installed in this Python; run `make trl-env` and use "
                 ".venv-trl/bin/python benchmarks/bench_vs_trl.py")
    torch.set_num_threads(1)
    n = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("STPPO_CACHE_DIR", os.path.join(tmp, "cache"))
        tok, prompts, model0 = build_workload(args.seed)
        step = stppo_trainer(copy.deepcopy(model0).to(DEVICE), tok, prompts, n, args.seed)
        ours: list[dict] = []
        trl_side = run_trl(copy.deepcopy(model0).to(DEVICE), tok, prompts, n, args.seed,
                           os.path.join(tmp, "trl"), lambda k: ours.append(step(k)))
    lengths = [len(encode_prompt(tok, p)) for p in prompts]
    a, b = summary(ours[args.warmup:]), summary(trl_side[args.warmup:])
    print(f"stppo_over_trl: {a['tokens_per_s'] / b['tokens_per_s']:.2f}")
    for name, s in (("stppo", a), ("trl", b)):
        print(f"{name}_tokens_per_s: {s['tokens_per_s']:.0f} (median step {s['step']:.3f} s = "
              f"generation {s['gen']:.3f} s + update {s['update']:.3f} s, "
              f"{s['tokens']:.0f} completion tokens, {s['faults']:.0f} page faults)")
    print(f"workload: trl {trl.__version__}, vocabulary {len(tok)}, prompts {len(prompts)} of "
          f"{min(lengths)}-{max(lengths)} tokens, {args.warmup} warm-up + {args.steps} measured "
          f"steps per side, " + (f"wall seconds on {torch.cuda.get_device_name(0)}" if DEVICE.type == "cuda"
                                  else f"CPU seconds on {torch.get_num_threads()} thread"))


if __name__ == "__main__":
    main()
