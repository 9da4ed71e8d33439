"""Batched multi-turn generation for any `transformers` causal LM and any `AgentEnv` → `Batch`.

Per turn, the active trajectories generate together: the new tokens of each row (the prompt at
turn 0; later the previous turn's last sampled token and the observation) are left-padded and
encoded once (prefill; position ids from the attention mask), on top of the keys/values the row
kept from its previous turn (`kvcache.py`); then one token per step reusing the KV cache. A row's
turn ends at a stop tag (the env's `stop_tags` when it has that attribute, else `STOP_TAGS`) or
EOS (`stopping.py`), at `max_new_tokens`, or at the total-length limit — then the trajectory is
truncated (scored 0). Finished rows leave the batch (compacted once a quarter of it has
finished; until then they are fed padding, masked out). Sampled ids are kept exactly; their
decoded text (special tokens kept) goes to `env.step_batch`, and the observation text is
tokenised and appended. No progress output: the trainer reports progress.

Speed (benchmarks/bench_rollout.py, benchmarks/bench_vs_trl.py). Per decoding step the engine
does only tensor work on the batch (no per-row Python, no conversion to lists until the turn
ends): the turn's attention mask is one preallocated buffer filled a column per step; sampled
ids and log-probs go to (B, S) buffers; for SDPA models the 4-D mask transformers would derive
from the 2-D one is handed over directly; generation runs in inference mode; a decoding step of a
Qwen2/Llama model runs the model's code without the module machinery (`leanstep.py`, checked bit
for bit against the forward). None of this changes a number. Two things move the logits of a
turn's first token by the rounding of other matrix kernels (~1e-7 to 1e-6, measured), being the
same computation on fewer rows: a prefill over cached tokens of such a model runs its last
layer's query, attention and MLP on the last position only (`leanstep.py`); and rows that share
a prompt (a GRPO group's samples) are prefilled once and their keys/values copied — equal bit
for bit while the prefill still has many rows, but with only one or two distinct prompts BLAS
picks other kernels for the smaller matrices — as log-probs already move when finished rows are
compacted out of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stppo.batch import Batch
from stppo.envs.base import STOP_TAGS, AgentEnv, Question
from stppo.models.logprobs import position_ids_from_mask
from stppo.rollout.config import RolloutConfig
from stppo.rollout.episodes import (Trajectory, encode_prompt, encode_texts, pack_batch,
                                    pad_token_id)
from stppo.rollout.kvcache import (RowCache, cache_kwarg, row_cache, stack_row_caches,
                                  supports_row_caches)
from stppo.rollout import leanstep
from stppo.rollout.leanstep import ModelSteps
from stppo.rollout.sampling import sample_next, turn_uniforms
from stppo.rollout.static import engine_for
from stppo.rollout.weights import sampler_model
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
    `cfg.engine` picks the decoding path (`resolve_engine`): this module's, or `static.py`'s.
    """
    stop = StopChecker(tokenizer, eos_token_ids(tokenizer, model),
                       getattr(env, "stop_tags", STOP_TAGS))
    pad_id = pad_token_id(tokenizer)
    trajs = [Trajectory(encode_prompt(tokenizer, env.prompt(q))) for q in questions]
    longest = max((len(tr.ids) for tr in trajs), default=0)
    if longest >= cfg.max_total_tokens:
        raise ValueError(f"rollout.max_total_tokens={cfg.max_total_tokens} leaves no room to "
                         f"generate after a {longest}-token prompt; raise it")
    turns = (StaticTurns(model, cfg, len(trajs)) if resolve_engine(model, cfg) == "static"
             else EagerTurns(model, len(trajs)))
    active = list(range(len(trajs)))
    was_training = model.training
    model.eval()
    try:
        for turn in range(env.max_turns):
            if not active:
                break
            budgets = [min(cfg.max_new_tokens, cfg.max_total_tokens - len(trajs[i].ids))
                       for i in active]
            outs = turns.generate(active, [trajs[i].ids for i in active], budgets, cfg, stop,
                                  pad_id=pad_id, generator=generator,
                                  keep_cache=turn + 1 < env.max_turns)
            active = _advance(env, tokenizer, questions, trajs, active, outs, turn, cfg)
            turns.keep(active)
    finally:
        model.train(was_training)
    scores = [0.0 if tr.truncated or tr.answer is None else float(env.score(q, tr.answer))
              for q, tr in zip(questions, trajs)]
    return pack_batch(trajs, list(questions), pad_id=pad_id, group_ids=group_ids, scores=scores)


def resolve_engine(model, cfg: RolloutConfig) -> str:
    """'static' or 'eager' for `cfg.engine` on this model: auto is static on CUDA for the models
    the lean code supports, eager otherwise; static on another model is a one-line error."""
    if cfg.engine == "eager":
        return "eager"
    ok = leanstep.supported(model)
    if cfg.engine == "static":
        if not ok:
            raise ValueError(f"trainer.rollout.engine=static needs a Qwen2 or Llama model with SDPA "
                             f"full attention and no hooks ({type(model).__name__} is not one); "
                             "use trainer.rollout.engine=eager")
        return "static"
    return "static" if ok and next(model.parameters()).device.type == "cuda" else "eager"


class EagerTurns:
    """The eager path's turns: each trajectory's keys/values travel between turns as row caches
    (`kvcache.py`), restacked for the next turn."""

    def __init__(self, model, n: int):
        self.model = model
        self.caches: list = [None] * n  # per trajectory: keys/values of ids[:cached[i]]
        self.cached = [0] * n

    def generate(self, active, ids, budgets, cfg, stop, *, pad_id, generator, keep_cache):
        outs = generate_turn(self.model, [x[self.cached[i]:] for i, x in zip(active, ids)],
                             [self.caches[i] for i in active], budgets, cfg, stop, pad_id=pad_id,
                             generator=generator, keep_cache=keep_cache)
        for i, x, out in zip(active, ids, outs):  # the cache covers all but the last sampled token
            self.caches[i] = out.cache
            self.cached[i] = len(x) + len(out.ids) - 1 if out.cache is not None else 0
            out.cache = None
        return outs

    def keep(self, active) -> None:
        still = set(active)
        self.caches = [c if i in still else None for i, c in enumerate(self.caches)]


class StaticTurns:
    """The static path's turns (`static.py`): each trajectory's keys/values stay in its slot of
    the engine's fixed-size cache; the engine reads the sampler's weights (`weights.py`)."""

    def __init__(self, model, cfg: RolloutConfig, n: int):
        sampler = sampler_model(model)
        self.engine = engine_for(sampler, cfg, n)
        self.device = next(sampler.parameters()).device
        self.slot, self.cached = list(range(n)), [0] * n

    def generate(self, active, ids, budgets, cfg, stop, *, pad_id, generator, keep_cache):
        with torch.autocast(self.device.type, enabled=False):  # the sampler holds compute-dtype weights
            res = self.engine.turn([self.slot[i] for i in active], [self.cached[i] for i in active],
                                   [x[self.cached[i]:] for i, x in zip(active, ids)], budgets, cfg,
                                   stop, pad_id=pad_id, generator=generator)
        for i, r in zip(active, res):
            self.slot[i], self.cached[i] = r.slot, r.cached
        return [TurnOutput(r.ids, r.log_probs, r.stopped) for r in res]

    def keep(self, active) -> None:
        pass  # finished trajectories' slots are simply not read again


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
    going = []  # (trajectory, observation text) of the episodes that go on
    for i, res in zip(stepping, results):
        trajs[i].record(res)
        if not (res.done or turn + 1 >= env.max_turns):
            going.append((i, res.observation))
    observations = encode_texts(tokenizer, [text for _, text in going])
    still = []
    for (i, _), obs in zip(going, observations):
        tr = trajs[i]
        tr.add_observation(obs)
        if len(tr.ids) >= cfg.max_total_tokens:  # no room left to generate the next turn
            tr.cut(cfg.max_total_tokens)
            tr.truncated = True
            continue
        still.append(i)
    return still


@torch.inference_mode()  # no autograd bookkeeping per op; nothing made here reaches the trainer
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
    b, width, steps = len(chunks), max(len(c) for c in chunks), max(budgets)
    past, held = stack_row_caches(model, caches, device, room=width + steps)  # cache, (B, C)
    keep_cache = keep_cache and supports_row_caches(model)
    # SDPA over full-attention layers: the model gets the 4-D mask it would build from the 2-D
    # one (`_step_mask`, `_prefill_mask`), without building it at every step.
    mask_4d = (supports_row_caches(model)
               and getattr(model.config, "_attn_implementation", None) == "sdpa")
    c0 = held.shape[1]
    # The mask of the whole turn, filled a column per step (views of it go to the model).
    mask = torch.zeros(b, c0 + width + steps, dtype=torch.bool, device=device)  # (B, C+W+S)
    mask[:, :c0] = held
    chunk_len = torch.tensor([len(c) for c in chunks])  # (B,)
    mask[:, c0:c0 + width] = (torch.arange(width) >= width - chunk_len[:, None]).to(device)
    ids = torch.tensor([[pad_id] * (width - len(c)) + list(c) for c in chunks], dtype=torch.long)
    pos = position_ids_from_mask(mask[:, :c0 + width])[:, -width:]  # (B, W)
    # Rows with nothing cached and the same new tokens (a group's samples of one prompt) are
    # prefilled once; their keys/values and next-token logits are then copied to every copy.
    same = _shared_prompts(chunks, caches)
    rep = torch.arange(b) if same is None else torch.tensor(same[0])  # (U,) rows prefilled
    calls = ModelSteps(model, cache_kwarg(type(model).forward))  # lean where checked
    logits = calls.prefill(ids[rep].to(device), pos[rep],
                           _prefill_mask(mask[rep.to(device)], c0, width, mask_4d), past)  # (U, V)
    if same is not None:
        src = torch.tensor(same[1], device=device)  # (B,) each row's prefilled row
        past.batch_select_indices(src)
        logits = logits[src]  # (B, V)
    # Row r's real positions: its cached ones (right-aligned in the first C), then its chunk's.
    held_len = held.sum(1).tolist()
    spans = [((c0 - n, c0), (c0 + width - len(c), c0 + width)) for n, c in zip(held_len, chunks)]
    spans = [((a, e),) if e0 == a2 else ((a, e0), (a2, e)) for (a, e0), (a2, e) in spans]
    run = _Decode(b, steps, budgets, device)
    u = None if cfg.greedy else turn_uniforms(b, steps, generator, device)  # (B, S)
    return run.loop(past, mask, c0 + width, logits, cfg, stop, spans, pad_id=pad_id, u=u,
                    keep_cache=keep_cache, mask_4d=mask_4d, step_fn=calls.decode)


class _Decode:
    """The decoding steps of one turn: sampled ids and log-probs go to (B, S) buffers by row;
    batch slots map to rows (`rows`), finished rows are compacted away as in `generate_turn`."""

    def __init__(self, b: int, steps: int, budgets: Sequence[int], device: torch.device):
        self.ids = torch.zeros(b, steps, dtype=torch.long, device=device)  # (B, S)
        self.log_probs = torch.zeros(b, steps, dtype=torch.float32, device=device)  # (B, S)
        self.budget = torch.tensor(list(budgets), device=device)  # (B,)
        self.length, self.stopped, self.caches = [0] * b, [False] * b, [None] * b
        self.steps = steps

    def loop(self, past, mask, n, logits, cfg, stop, spans, *, pad_id, u,
             keep_cache, mask_4d, step_fn) -> list[TurnOutput]:
        device = mask.device
        rows = torch.arange(mask.shape[0], device=device)  # (B',) batch slot → row
        slot_rows = rows.tolist()
        live = torch.ones_like(rows, dtype=torch.bool)  # (B',) the row is still generating
        n_live = len(slot_rows)
        next_pos = mask[:, :n].sum(1)  # (B',) position id of each row's next token
        for step in range(self.steps):
            tokens, logps = sample_next(logits, cfg, u=None if u is None else u[rows, step])
            self.ids[rows, step] = tokens
            self.log_probs[rows, step] = logps
            hit = self._hits(stop, tokens, live, rows, slot_rows, step)  # (B',)
            ended = live & (hit | (self.budget[rows] <= step + 1))  # (B',)
            if bool(ended.any()):
                done = ended.nonzero()[:, 0].tolist()
                hits = hit[ended].tolist()
                for slot, h in zip(done, hits):
                    r = slot_rows[slot]
                    self.length[r], self.stopped[r] = step + 1, h
                    if keep_cache:  # every fed column since the prefill is the row's
                        segs = spans[r][:-1] + ((spans[r][-1][0], n),)
                        self.caches[r] = row_cache(past, slot, segs)
                n_live -= len(done)
                if n_live == 0:
                    break
                live = live & ~ended
                if len(slot_rows) - n_live >= max(1, len(slot_rows) // 4):  # compact
                    idx = live.nonzero()[:, 0]
                    past.batch_select_indices(idx)
                    tokens, mask, next_pos, rows = tokens[idx], mask[idx], next_pos[idx], rows[idx]
                    slot_rows, live = rows.tolist(), live[idx]
            # A few finished rows stay (compacting copies the cache): fed padding, masked out.
            if n_live < len(slot_rows):
                tokens = tokens.masked_fill(~live, pad_id)
            mask[:, n] = live
            n += 1
            logits = step_fn(tokens.unsqueeze(1), next_pos.unsqueeze(1),
                             _step_mask(mask, n, mask_4d), past)  # (B', V)
            next_pos = next_pos + live
        ids, log_probs = self.ids.tolist(), self.log_probs.tolist()
        return [TurnOutput(ids[r][:m], log_probs[r][:m], self.stopped[r], self.caches[r])
                for r, m in enumerate(self.length)]

    def _hits(self, stop: StopChecker, tokens, live, rows, slot_rows, step) -> torch.Tensor:
        """(B',) bool: the turn of the slot's row ends with this token (stop id or stop text)."""
        hit = stop.hits(tokens)  # (B',)
        if stop.by_token_id:
            return hit
        for slot in (live & ~hit & stop.may_end_text(tokens)).nonzero()[:, 0].tolist():
            r = slot_rows[slot]
            tail = self.ids[r, max(0, step + 1 - stop.window):step + 1].tolist()
            hit[slot] = stop.text_hit(tail)
        return hit


def _shared_prompts(chunks: Sequence[list[int]], caches: Sequence[RowCache]):
    """When no row has a cache and some chunks repeat: (the first row of each distinct chunk,
    for every row the index of its chunk among those); else None."""
    if any(c is not None for c in caches):
        return None
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(c), len(first)) for c in chunks]
    if len(first) == len(chunks):
        return None
    reps = [0] * len(first)
    for r in reversed(range(len(chunks))):
        reps[index[r]] = r
    return reps, index


def _step_mask(mask: torch.Tensor, n: int, mask_4d: bool) -> Optional[torch.Tensor]:
    """The attention mask of a one-token step over the first n columns: the 2-D mask, or the 4-D
    one transformers derives from it for SDPA (no padding: None; else the padding mask as
    (B, 1, 1, n), the causal part being all true for the last position)."""
    view = mask[:, :n]  # (B, n)
    if not mask_4d:
        return view
    return None if bool(view.all()) else view[:, None, None, :]


def _prefill_mask(mask: torch.Tensor, c0: int, width: int, mask_4d: bool) -> Optional[torch.Tensor]:
    """The attention mask of the prefill of `width` tokens after `c0` cached positions: the 2-D
    mask, or (with a cache) the 4-D one transformers derives from it for SDPA — padding and
    causal, (B, 1, W, C+W): query q (position c0+q) sees key k iff k is real and k <= c0+q."""
    if not mask_4d or c0 == 0:  # no cache: transformers may use SDPA's is_causal instead
        return mask[:, :c0 + width]
    if width == 1:
        return _step_mask(mask, c0 + 1, mask_4d)
    kv = torch.arange(c0 + width, device=mask.device)  # (C+W,)
    q = torch.arange(width, device=mask.device) + c0  # (W,)
    causal = kv[None, :] <= q[:, None]  # (W, C+W)
    return mask[:, None, None, :c0 + width] & causal[None, None]  # (B, 1, W, C+W)
