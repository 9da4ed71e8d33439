"""Batched multi-turn generation for any `transformers` causal LM and any `AgentEnv` → `Batch`.

Per turn, the active trajectories generate together: the new tokens of each row (the prompt at
turn 0; later the previous turn's last sampled token and the observation) are left-padded and
encoded once (prefill; position ids from the attention mask), on top of the keys/values the row
kept from its previous turn (`kvcache.py`); then one token per step reusing the KV cache. A row's
turn ends at a stop tag or EOS (`stopping.py`), at `max_new_tokens`, or at the total-length limit
— then the trajectory is truncated (scored 0). Finished rows leave the batch (compacted once a
quarter of it has finished; until then they are fed padding, masked out). Sampled ids are kept
exactly; their decoded text (special tokens kept) goes to `env.step_batch`, and the observation
text is tokenised and appended. No progress output: the trainer reports progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stppo.batch import Batch
from stppo.envs.base import AgentEnv, Question
from stppo.models.logprobs import position_ids_from_mask
from stppo.rollout.config import RolloutConfig
from stppo.rollout.episodes import (Trajectory, encode_prompt, encode_text, pack_batch,
                                    pad_token_id)
from stppo.rollout.kvcache import RowCache, row_cache, stack_row_caches, supports_row_caches
from stppo.rollout.sampling import sample_next
from stppo.rollout.stopping import StopChecker, eos_token_ids


@dataclass
class TurnOutput:
    ids: list[int]  # the sampled ids, exactly
    log_probs: list[float]  # log π(id | prefix) under the unmodified model
    stopped: bool  # ended by a stop tag or EOS (not by a length limit)
    cache: RowCache = None  # per layer (K, V) of the row's tokens but the last sampled one


@torch.no_grad()
def rollout(model, tokenizer, env: AgentEnv, questions: Sequence[Question], cfg: RolloutConfig, *,
            group_ids: Optional[Sequence[int]] = None,
            generator: Optional[torch.Generator] = None) -> Batch:
    """Run every question to the end of its episode; return the right-padded `Batch`.

    `group_ids` default: rows with the same question id share a group (numbered by first
    appearance). `generator` makes sampling reproducible (same seed ⇒ same rollout on CPU).
    """
    stop = StopChecker(tokenizer, eos_token_ids(tokenizer, model))
    pad_id = pad_token_id(tokenizer)
    trajs = [Trajectory(encode_prompt(tokenizer, env.prompt(q))) for q in questions]
    longest = max((len(tr.ids) for tr in trajs), default=0)
    if longest >= cfg.max_total_tokens:
        raise ValueError(f"rollout.max_total_tokens={cfg.max_total_tokens} leaves no room to "
                         f"generate after a {longest}-token prompt; raise it")
    active = list(range(len(trajs)))
    caches: list = [None] * len(trajs)  # per trajectory: keys/values of ids[:cached[i]]
    cached = [0] * len(trajs)
    was_training = model.training
    model.eval()
    try:
        for turn in range(env.max_turns):
            if not active:
                break
            budgets = [min(cfg.max_new_tokens, cfg.max_total_tokens - len(trajs[i].ids))
                       for i in active]
            outs = generate_turn(model, [trajs[i].ids[cached[i]:] for i in active],
                                 [caches[i] for i in active], budgets, cfg, stop, pad_id=pad_id,
                                 generator=generator, keep_cache=turn + 1 < env.max_turns)
            for i, out in zip(active, outs):  # the cache covers all but the last sampled token
                caches[i] = out.cache
                cached[i] = len(trajs[i].ids) + len(out.ids) - 1 if out.cache is not None else 0
                out.cache = None
            active = _advance(env, tokenizer, questions, trajs, active, outs, turn, cfg)
            still = set(active)
            caches = [c if i in still else None for i, c in enumerate(caches)]
    finally:
        model.train(was_training)
    scores = [0.0 if tr.truncated or tr.answer is None else float(env.score(q, tr.answer))
              for q, tr in zip(questions, trajs)]
    return pack_batch(trajs, list(questions), pad_id=pad_id, group_ids=group_ids, scores=scores)


def _advance(env: AgentEnv, tokenizer, questions: Sequence[Question], trajs: list[Trajectory],
             active: list[int], outs: list[TurnOutput], turn: int, cfg: RolloutConfig) -> list[int]:
    """Append the turn's tokens, judge the complete turns, append observations → still active."""
    stepping = []
    for i, out in zip(active, outs):
        tr = trajs[i]
        tr.add_action(out.ids, turn, out.log_probs)
        tr.actions.append(tokenizer.decode(out.ids, skip_special_tokens=False))
        if not out.stopped and len(tr.ids) >= cfg.max_total_tokens:
            tr.truncated = True  # the total-length limit cut this turn short
        else:
            stepping.append(i)
    if not stepping:
        return []
    results = env.step_batch([questions[i] for i in stepping],
                             [trajs[i].actions[-1] for i in stepping], [turn] * len(stepping))
    still = []
    for i, res in zip(stepping, results):
        tr = trajs[i]
        tr.record(res)
        if res.done or turn + 1 >= env.max_turns:
            continue
        tr.add_observation(encode_text(tokenizer, res.observation))
        if len(tr.ids) >= cfg.max_total_tokens:  # no room left to generate the next turn
            tr.cut(cfg.max_total_tokens)
            tr.truncated = True
            continue
        still.append(i)
    return still


def generate_turn(model, chunks: Sequence[list[int]], caches: Sequence[RowCache],
                  budgets: Sequence[int], cfg: RolloutConfig, stop: StopChecker, *, pad_id: int,
                  generator: Optional[torch.Generator] = None,
                  keep_cache: bool = True) -> list[TurnOutput]:
    """One generation call for B rows. Row r's context is its cached keys/values (`caches[r]`,
    None = nothing cached) followed by the new tokens `chunks[r]`; the chunks are prefilled once
    (left-padded, holes masked, position ids from the mask), then one token per step with the KV
    cache; a row leaves the batch when its turn ends (stop id/text or its token budget), taking
    its keys/values along when `keep_cache` (`TurnOutput.cache`: all but its last sampled token)."""
    device = next(model.parameters()).device
    past, attn = stack_row_caches(model, caches, device)  # cache, (B, C)
    keep_cache = keep_cache and supports_row_caches(model)
    b, width = len(chunks), max(len(c) for c in chunks)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    new = torch.zeros(b, width, dtype=torch.long)
    for r, c in enumerate(chunks):
        ids[r, width - len(c):] = torch.tensor(c, dtype=torch.long)
        new[r, width - len(c):] = 1
    attn = torch.cat([attn, new.to(device)], dim=1)  # (B, C+W)
    pos = position_ids_from_mask(attn)[:, -width:]  # (B, W)
    out = model(input_ids=ids.to(device), attention_mask=attn, position_ids=pos,
                past_key_values=past, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]  # (B, V)
    next_pos = attn.sum(1)  # (B,) position id of each row's next token
    rows = list(range(b))  # batch slot -> row index
    live = [True] * b  # per slot: the row is still generating this turn
    results = [TurnOutput([], [], False) for _ in range(b)]
    while True:
        tokens, logps = sample_next(logits, cfg, generator)  # (B',), (B',)
        hit_ids = stop.hits(tokens).tolist()
        for slot, (r, tok, lp, hit) in enumerate(zip(rows, tokens.tolist(), logps.tolist(), hit_ids)):
            if not live[slot]:
                continue
            res = results[r]
            res.ids.append(tok)
            res.log_probs.append(lp)
            res.stopped = bool(hit) or stop.text_hit(res.ids)
            if res.stopped or len(res.ids) >= budgets[r]:
                live[slot] = False
                if keep_cache:
                    res.cache = row_cache(past, attn[slot], slot)
        n_live = sum(live)
        if n_live == 0:
            return results
        if len(rows) - n_live >= max(1, len(rows) // 4):  # compact: drop finished rows
            idx = torch.tensor([s for s in range(len(rows)) if live[s]], device=device)
            past.batch_select_indices(idx)
            tokens, attn, next_pos = tokens[idx], attn[idx], next_pos[idx]
            rows, live = [rows[s] for s in idx.tolist()], [True] * n_live
        # A few finished rows stay (compacting copies the cache): fed padding, masked out.
        alive = torch.tensor(live, device=device)  # (B',)
        tokens = torch.where(alive, tokens, torch.full_like(tokens, pad_id))
        attn = torch.cat([attn, alive.long().unsqueeze(1)], dim=1)  # (B', C+W+s)
        logits = model(input_ids=tokens.unsqueeze(1), attention_mask=attn,
                       position_ids=next_pos.unsqueeze(1), past_key_values=past,
                       use_cache=True).logits[:, -1]
        next_pos = next_pos + alive.long()
