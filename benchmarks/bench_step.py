"""PPO update cost vs a raw training step, the cost of the exact clip-bias norm, and what running
the LM head on agent tokens only saves.

Prints, measured in one run on CPU (one thread, process CPU time, medians):
  update_over_raw: X            the PPO update's time *per optimizer step* (the default trainer's
                                epochs × minibatches of the `st_ppo` preset, divided by their
                                number) ÷ one raw step on a minibatch of the same rows: forward
                                with the full-vocabulary head over every position, token NLL of
                                the agent tokens, backward, grad clip, AdamW (goal ≤ 1.3)
  exact_clip_bias_fraction: Y   extra time of one exact parameter-space ‖C‖ per optimizer step,
                                as a fraction of the update's optimizer step
  logprob_agent_only_speedup: Z log-probs + entropy, forward and backward, of a batch whose
                                prompt and observation tokens are >= 50% of its tokens, under a
                                32k vocabulary: LM head over every position ÷ LM head over the
                                agent tokens only (what the trainer's update, old-log-prob and
                                reference passes do)

    python benchmarks/bench_step.py [--model small] [--rows 32] [--repeats 5] [--device cuda]

On CUDA (`--device cuda`) every side runs on the GPU under the trainer's precision (bf16 autocast,
float32 master weights) and times are wall-clock between device synchronisations.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from stppo.algos import token_log_probs
from stppo.config import compose, to_config
from stppo.models import policy_log_probs, position_ids_from_mask, resolve_precision
from stppo.rollout import rollout
from stppo.train.loop import rollout_config
from stppo.train.prepare import prepare_batch
from stppo.train.setup import build_components
from stppo.train.update import UpdateContext, actor_update, minibatches


def median_time(fn, repeats: int, device: str = "cpu") -> float:
    """Median process CPU time of `fn` (one torch thread: CPU time = compute time, and other jobs
    on the machine do not leak into it as they do into wall time); on CUDA the wall time between
    two device synchronisations."""
    cuda = torch.device(device).type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t = clock()
        fn()
        sync()
        times.append(clock() - t)
    return statistics.median(times)


def raw_step_fn(policy, opt, batch, precision):
    """A plain causal-LM step: full logits over every position, NLL of the agent tokens."""
    def raw_step():
        mask = batch.attention_mask
        with precision.autocast():
            logits = policy(input_ids=batch.input_ids, attention_mask=mask.long(),
                            position_ids=position_ids_from_mask(mask), use_cache=False).logits
        lp = token_log_probs(logits[:, :-1].float(), batch.input_ids[:, 1:])  # (N, T-1)
        agent = batch.loss_mask[:, 1:]
        loss = -(lp * agent).sum() / agent.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
    return raw_step


def update_per_step(args) -> None:
    cfg = to_config(compose([f"model={args.model}", "algo=st_ppo", "trainer.warmstart.enabled=false",
                             "tracking.enabled=false", f"trainer.questions_per_step={args.rows}",
                             f"trainer.device={args.device}",
                             "trainer.group_size=1",
                             f"trainer.minibatch_size={max(1, args.rows // 2)}"]))
    c = build_components(cfg, progress=False)
    qs = c.task.split("train")[: args.rows]
    with c.precision.autocast():
        batch = rollout(c.policy, c.tokenizer, c.env, qs, rollout_config(cfg),
                        generator=torch.Generator().manual_seed(0))
    batch = batch.to(next(c.policy.parameters()).device)  # packed on the CPU, as in the trainer
    batch, _ = prepare_batch(batch, c.policy, c.critic, None, cfg.algo, precision=c.precision)
    tokens = int(batch.attention_mask.sum())
    steps = sum(1 for _ in minibatches(len(batch), cfg.trainer.minibatch_size,
                                       cfg.trainer.ppo_epochs, torch.Generator()))
    policy = c.policy
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    mb = batch.select(torch.arange(cfg.trainer.minibatch_size))

    def ppo_step(exact_every: int):
        tr = replace(cfg.trainer, exact_clip_bias_every=exact_every)
        ctx = UpdateContext(cfg.algo, tr, torch.Generator().manual_seed(0), precision=c.precision)
        return lambda: actor_update(policy, opt, batch, ctx)

    t_raw = median_time(raw_step_fn(policy, opt, mb, c.precision), args.repeats, args.device)
    t_ppo = median_time(ppo_step(0), args.repeats, args.device) / steps
    t_exact = median_time(ppo_step(1), args.repeats, args.device) / steps
    print(f"device: {args.device} ({c.precision.describe()})  model: {args.model}  "
          f"rows: {args.rows}  tokens: {tokens}  T: {batch.input_ids.shape[1]}  "
          f"optimizer_steps_per_update: {steps} ({cfg.trainer.ppo_epochs} epochs x "
          f"{args.rows // cfg.trainer.minibatch_size} minibatches of {cfg.trainer.minibatch_size})")
    print(f"raw_step_s: {t_raw:.4f}")
    print(f"ppo_update_per_optimizer_step_s: {t_ppo:.4f}")
    print(f"ppo_update_exact_clip_bias_per_optimizer_step_s: {t_exact:.4f}")
    print(f"update_over_raw: {t_ppo / t_raw:.3f}")
    print(f"exact_clip_bias_fraction: {(t_exact - t_ppo) / t_ppo:.3f}")


def agent_only_batch(n: int, t: int, vocab: int, agent_share: float, seed: int = 0):
    """(ids, attention mask, agent mask): a prompt, then turns of agent tokens alternating with
    observations; padding at the end of some rows; the agent share of real tokens as given."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    attn = torch.ones(n, t, dtype=torch.bool)
    agent = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n):
        length = t - (i % 4) * t // 16
        attn[i, length:] = False
        pos, turn = t // 8, max(8, int(64 * agent_share))
        while pos + turn < length:
            agent[i, pos:pos + turn] = True
            pos += turn + max(8, int(64 * (1 - agent_share)))
    return ids, attn, agent


def agent_only_speedup(args) -> None:
    vocab = 32768
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=128, num_hidden_layers=2,
                                         intermediate_size=512, num_attention_heads=4,
                                         num_key_value_heads=4, tie_word_embeddings=True))
    model.to(args.device)
    precision = resolve_precision("auto", None, args.device)
    batch = agent_only_batch(8, 512, vocab, agent_share=0.35)
    ids, attn, agent = (t.to(args.device) for t in batch)
    obs_share = 1.0 - float(agent.sum()) / float(attn.sum())

    def fwd_bwd(positions):
        def run():
            model.zero_grad(set_to_none=True)
            with precision.autocast():
                lp, ent = policy_log_probs(model, ids, attn, return_entropy=True,
                                           positions=positions)
            (lp.sum() + ent.sum()).backward()
        return run

    def fwd(positions):
        @torch.no_grad()
        def run():
            with precision.autocast():
                policy_log_probs(model, ids, attn, positions=positions)
        return run

    time_of = lambda fn: median_time(fn, args.repeats, args.device)  # noqa: E731
    full, only = time_of(fwd_bwd(None)), time_of(fwd_bwd(agent))
    full_ng, only_ng = time_of(fwd(None)), time_of(fwd(agent))
    print(f"agent_only_batch: 8 x 512, vocab {vocab}, prompt+observation share of tokens "
          f"{obs_share:.2f}")
    print(f"logprob_full_head_fwd_bwd_s: {full:.4f}  agent_only: {only:.4f}")
    print(f"logprob_no_grad_speedup: {full_ng / only_ng:.2f}  (old/ref passes: {full_ng:.4f} s vs "
          f"{only_ng:.4f} s)")
    print(f"logprob_agent_only_speedup: {full / only:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    update_per_step(args)
    agent_only_speedup(args)


if __name__ == "__main__":
    main()
