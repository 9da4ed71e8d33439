"""The static decoding path (`trainer.rollout.engine=static`; `auto` picks it on CUDA).

Same episodes, same sampled ids as the eager engine (`engine.py`), decoded so that a decoding
step is a fixed sequence of kernels that can be captured once and replayed as a CUDA graph:

* **Fixed-size KV cache** (`staticstep.StaticKV`): every row keeps a slot for the whole rollout,
  its token at sequence index p in column p, for up to `max_total_tokens` tokens. Turns append
  to it in place: a turn's new tokens (the previous turn's last sampled token and the
  observation) are prefilled into the row's next columns; nothing is restacked between turns.
* **Batch buckets**: a decoding step runs over the first b slots, b a power of two ≥ the rows
  still generating. When finished rows let the live ones fit a smaller bucket, the live rows'
  slots move to the front (one gather of the cache) — the batch shrinks only to bucket sizes,
  so each bucket's step is captured once.
* **No host synchronisation inside a step**: the step samples from the logits buffer, records
  the id and its log-prob, marks rows done on EOS / single-token stop tags / their token budget,
  feeds the ids and writes the next logits — all on the device. The host looks every
  `check_every` steps: it finds multi-token stop tags in the decoded tail (`StopChecker`), ends
  the turn when every row is done, and compacts. A row's tokens after its end (up to
  `check_every − 1` of them, for text tags) are discarded exactly: its length is set to its end,
  and the columns it wrote beyond are overwritten by its next turn.
* **Sampling from a turn's uniforms** (`sampling.turn_uniforms`): drawn per turn from the run's
  generator; row r's token at step s reads u[r, s], as in the eager engine, so a seed reproduces
  the rollout and both engines draw the same tokens.
* **Sampler weights** (`weights.SamplerWeights`): under bfloat16 autocast the steps read a
  bfloat16 copy of the policy, refreshed in place when the policy's parameters changed (as
  inference engines receive weights), so captured graphs keep valid pointers. The log-probs
  recorded are log softmax of the copy's raw logits; the sampler/trainer mismatch is logged
  (`rollout_corr/*`).

On CUDA each (bucket, greedy) step is captured as a CUDA graph on first use (`cuda_graphs`);
on the CPU the same step runs as plain calls (no graphs), which is what the tests compare with
the eager engine. torch.compile is not used.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stppo.rollout.config import RolloutConfig
from stppo.rollout.sampling import inverse_cdf, top_p_filter, turn_uniforms
from stppo.rollout.staticstep import StaticForward, StaticKV, attention_mask, cache_columns
from stppo.rollout.stopping import StopChecker

# sampler model → {(shape, graphs): engine}: a run keeps one; a benchmark may hold graphs on and off
log = logging.getLogger(__name__)
_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def bucket(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class EngineShape:
    """What fixes an engine's buffers and graphs."""
    columns: int
    max_new_tokens: int
    dtype: torch.dtype
    device: torch.device
    temperature: float
    top_p: float


def engine_key(model: torch.nn.Module, cfg: RolloutConfig) -> tuple["EngineShape", bool]:
    """What an engine of `model` for `cfg` is kept under: its shape and whether it uses graphs."""
    p = next(model.parameters())
    shape = EngineShape(cache_columns(cfg.max_total_tokens), cfg.max_new_tokens, p.dtype, p.device,
                        cfg.temperature, cfg.top_p)
    return shape, cfg.cuda_graphs and p.device.type == "cuda"


def cached_engine(model: torch.nn.Module, cfg: RolloutConfig) -> Optional["StaticEngine"]:
    """The engine `engine_for` keeps for `model` and `cfg`, if one was built."""
    return _ENGINES.get(model, {}).get(engine_key(model, cfg))


def engine_for(model: torch.nn.Module, cfg: RolloutConfig, rows: int) -> "StaticEngine":
    """The static engine of `model` (the sampler's weights) for `cfg`, with room for `rows`
    rows: built once and kept while the model lives; rebuilt (graphs recaptured) when more rows
    are asked for than it holds."""
    key = engine_key(model, cfg)
    held = _ENGINES.setdefault(model, {})
    eng = held.get(key)
    if eng is None or eng.capacity < rows:
        capacity = bucket(max(rows, eng.capacity if eng is not None else 1))
        held.pop(key, None)  # free the old buffers and graphs before allocating the new ones
        eng = held[key] = StaticEngine(model, key[0], capacity, graphs=key[1])
    return eng


class StaticEngine:
    """Buffers, steps and graphs of one sampler model; `turn` runs one generation call."""

    def __init__(self, model: torch.nn.Module, shape: EngineShape, capacity: int, *, graphs: bool):
        c, dev = model.config, shape.device
        self.shape, self.capacity, self.graphs = shape, capacity, graphs
        self.forward = StaticForward(model)
        self.forward_params = list(model.parameters())
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.kv = StaticKV(c.num_hidden_layers, capacity, c.num_key_value_heads, shape.columns,
                           head_dim, shape.dtype, dev)
        r, s = capacity + 1, shape.max_new_tokens  # row-indexed buffers: the last row is a dump
        self.ids = torch.zeros(r, s, dtype=torch.long, device=dev)  # (R+1, S) sampled ids
        self.logps = torch.zeros(r, s, dtype=torch.float32, device=dev)  # (R+1, S)
        self.u = torch.zeros(r, s, dtype=torch.float32, device=dev)  # (R+1, S) the turn's uniforms
        self.logits = torch.zeros(capacity, c.vocab_size, dtype=torch.float32, device=dev)  # (C, V)
        self.rows = torch.zeros(capacity, dtype=torch.long, device=dev)  # slot → row of the turn
        self.cur = torch.zeros(capacity, dtype=torch.long, device=dev)  # column of the next fed id
        self.done = torch.ones(capacity, dtype=torch.bool, device=dev)
        self.length = torch.zeros(capacity, dtype=torch.long, device=dev)  # ids kept when done
        self.stopped = torch.zeros(capacity, dtype=torch.bool, device=dev)  # ended by a stop id
        self.budget = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # the turn's decoding step
        self.stop_ids = torch.zeros(0, dtype=torch.long, device=dev)
        self.pad_id = 0
        self.state = (self.rows, self.cur, self.done, self.length, self.stopped, self.budget)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # A list to time the decoding steps into (benchmarks): (bucket, steps, seconds) per run
        # of steps between two checks; None: not timed.
        self.timings: Optional[list[tuple[int, int, float]]] = None
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    # -- one decoding step over the first b slots (captured per (b, greedy) on CUDA) -----------
    def _step(self, b: int, greedy: bool) -> None:
        s = self.step
        rows = self.rows[:b]
        cols = s.expand(b)  # (b,): a 0-d index would be read on the host (no capture)
        z = self.logits[:b]  # (b, V) float32
        if greedy:
            tok = z.argmax(dim=-1)  # (b,)
        else:
            scaled = z if self.shape.temperature == 1.0 else z / self.shape.temperature
            q = top_p_filter(scaled, self.shape.top_p).softmax(dim=-1)
            tok = inverse_cdf(q, self.u[rows, cols])  # (b,)
        logp = torch.log_softmax(z, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)  # (b,)
        live = ~self.done[:b]
        self.ids[rows, cols] = tok
        self.logps[rows, cols] = logp
        hit = (tok.unsqueeze(1) == self.stop_ids).any(dim=1)  # (b,): EOS or a one-token tag
        ends = live & (hit | (self.budget[:b] <= s + 1))
        self.length[:b] = torch.where(ends, s + 1, self.length[:b])
        self.stopped[:b] |= ends & hit
        self.done[:b] |= ends
        going = live & ~ends  # rows whose id is fed (a row's last id is fed by its next turn)
        pos = self.cur[:b].unsqueeze(1)  # (b, 1)
        feed = torch.where(going, tok, self.pad_id).unsqueeze(1)  # (b, 1)
        mask = attention_mask(pos, self.kv.columns)  # (b, 1, 1, L)
        out = self.forward(feed, pos, pos, mask, self.kv)  # (b, V)
        self.logits[:b] = out.float()
        self.cur[:b] += going
        s += 1

    def _run_step(self, b: int, greedy: bool) -> None:
        if not self.graphs:
            return self._step(b, greedy)
        g = self._graphs.get((b, greedy))
        if g is None:
            try:
                g = self._graphs[(b, greedy)] = self._capture(b, greedy)
            except RuntimeError as e:  # a kernel that cannot be captured here: plain steps
                torch.cuda.synchronize()
                log.warning("stppo: capturing the static rollout's decoding step failed (%s); "
                            "running it without CUDA graphs", str(e).splitlines()[0])
                self.graphs, self._graphs = False, {}
                return self._step(b, greedy)
        g.replay()

    def _capture(self, b: int, greedy: bool) -> "torch.cuda.CUDAGraph":
        """Capture the step of bucket b: one warm-up call on a side stream (lazy initialisation,
        kernel selection), then the capture; the step's state is restored after each, so
        capturing changes nothing the turn sees (the warm-up's cache writes land in columns the
        real step writes again)."""
        saved = [t.clone() for t in (*self.state, self.step, self.logits, self.ids, self.logps)]
        targets = (*self.state, self.step, self.logits, self.ids, self.logps)

        def restore() -> None:
            for t, v in zip(targets, saved):
                t.copy_(v)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(b, greedy)
        torch.cuda.current_stream().wait_stream(side)
        restore()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(b, greedy)
        restore()
        return g

    # -- one turn ------------------------------------------------------------------------------
    @torch.no_grad()
    def turn(self, slots: Sequence[int], cached: Sequence[int], chunks: Sequence[list[int]],
             budgets: Sequence[int], cfg: RolloutConfig, stop: StopChecker, *, pad_id: int,
             generator: Optional[torch.Generator]) -> list[TurnResult]:
        """One generation call for n rows: row r's cache is in slot `slots[r]` and holds its first
        `cached[r]` tokens; its new tokens are `chunks[r]` (`cached` = 0 and any slots at the
        first turn). Returns each row's ids, log-probs, stop flag, and its slot and cached length
        for the next turn."""
        n, dev = len(chunks), self.shape.device
        if list(slots) != list(range(n)):
            self.kv.gather_rows(torch.tensor(list(slots), dtype=torch.long, device=dev))
        self._bake(pad_id, stop)
        start = self._prefill(list(cached), chunks)  # (n,) column of each row's first sampled id
        steps = max(budgets)
        b = bucket(n)
        self._arm(n, b, start, budgets, steps, cfg, generator)
        slot_row = list(range(n))  # host copy of self.rows[:n]
        live = set(range(n))
        s = 0
        while live and s < steps:
            k = min(cfg.check_every, steps - s)
            clock = _Clock(self.shape.device) if self.timings is not None else None
            for _ in range(k):
                self._run_step(b, cfg.greedy)
            if clock is not None:
                self.timings.append((b, k, clock.seconds()))
            live = self._check(s, s + k, b, slot_row, live, stop, start)
            s += k
            if live and bucket(len(live)) < b:
                b = self._compact(b, n, slot_row, live)
        return self._collect(n, slot_row)

    def _bake(self, pad_id: int, stop: StopChecker) -> None:
        """The constants the captured steps read: the padding id and the stop ids (graphs are
        dropped if a call brings others)."""
        key = (int(pad_id), tuple(stop.stop_ids.tolist()))
        if key != getattr(self, "_baked", None):
            self._graphs.clear()
            self.pad_id = key[0]
            self.stop_ids = torch.tensor(key[1], dtype=torch.long, device=self.shape.device)
            self._baked = key

    def _prefill(self, cached: list[int], chunks: Sequence[list[int]]) -> list[int]:
        """Write every row's new tokens into its next columns (right-padded; padding goes to the
        trash column) and put the logits of its last one in the logits buffer."""
        n, dev, w = len(chunks), self.shape.device, max(len(c) for c in chunks)
        lens = torch.tensor([len(c) for c in chunks], device=dev)  # (n,)
        ids = torch.tensor([list(c) + [self.pad_id] * (w - len(c)) for c in chunks], device=dev)
        base = torch.tensor(cached, device=dev).unsqueeze(1)  # (n, 1)
        t = torch.arange(w, device=dev)  # (W,)
        pos = base + t  # (n, W)
        real = t < lens.unsqueeze(1)  # (n, W)
        cols = torch.where(real, pos, self.kv.trash)
        mask = attention_mask(pos, self.kv.columns)  # (n, 1, W, L)
        self.logits[:n] = self.forward(ids, pos, cols, mask, self.kv, last=lens - 1).float()
        return [c + len(ch) for c, ch in zip(cached, chunks)]

    def _arm(self, n: int, b: int, start: list[int], budgets: Sequence[int], steps: int,
             cfg: RolloutConfig, generator) -> None:
        """The per-slot state of a new turn: rows 0..n−1 in slots 0..n−1, slots n..b−1 idle
        (done, writing to the trash column, recording to the dump row)."""
        dev, dump = self.shape.device, self.capacity
        idle = b - n
        self.rows[:b] = torch.tensor(list(range(n)) + [dump] * idle, device=dev)
        self.cur[:b] = torch.tensor(list(start) + [self.kv.trash] * idle, device=dev)
        self.done[:b] = torch.tensor([False] * n + [True] * idle, device=dev)
        self.budget[:b] = torch.tensor(list(budgets) + [0] * idle, device=dev)
        self.length[:b] = 0
        self.stopped[:b] = False
        self.step.zero_()
        if not cfg.greedy:
            self.u[:n, :steps] = turn_uniforms(n, steps, generator, dev)

    def _check(self, s0: int, s1: int, b: int, slot_row: list[int], live: set[int],
               stop: StopChecker, start: list[int]) -> set[int]:
        """After steps s0..s1−1: read which rows ended (one host sync), find multi-token stop
        tags in the new ids of rows still live at s0, end those rows there."""
        done, length = (t.tolist() for t in (self.done[:b], self.length[:b]))
        off = max(0, s0 - stop.window + 1)
        ids = cand = None
        if not stop.by_token_id:  # the new ids (and the tag window before them), on the host
            window = self.ids[:len(slot_row), off:s1].cpu()  # (n, s1 − off)
            ids, cand = window.tolist(), stop.may_end_text(window).tolist()
        still = set()
        for slot, row in enumerate(slot_row):
            if row not in live:
                continue
            last = length[slot] if done[slot] else s1  # steps of this row to scan: s0..last−1
            hit = _text_stop(stop, ids[row], cand[row], off, s0, last) if ids is not None else None
            if hit is not None:
                self._end(slot, hit + 1, start[row] + hit)
            elif not done[slot]:
                still.add(row)
        return still

    def _end(self, slot: int, length: int, cur: int) -> None:
        """End the row in `slot` after `length` ids (a stop tag found by the host)."""
        self.length[slot] = length
        self.stopped[slot] = True
        self.done[slot] = True
        self.cur[slot] = cur

    def _compact(self, b: int, n: int, slot_row: list[int], live: set[int]) -> int:
        """Move the live rows' slots to the front (then the finished ones, whose caches the next
        turn needs); the steps then run over the smaller bucket."""
        order = [s for s, r in enumerate(slot_row) if r in live]
        order += [s for s, r in enumerate(slot_row) if r not in live]
        idx = torch.tensor(order, device=self.shape.device)
        self.kv.gather_rows(idx)
        for t in self.state:
            t[:n] = t[idx]
        self.logits[:n] = self.logits[idx]
        slot_row[:] = [slot_row[s] for s in order]
        return bucket(len(live))

    def _collect(self, n: int, slot_row: list[int]) -> list[TurnResult]:
        """One host copy of the turn's results, by row."""
        length, stopped, cur = (t.tolist() for t in (self.length[:n], self.stopped[:n], self.cur[:n]))
        slot_of = {row: slot for slot, row in enumerate(slot_row)}
        longest = max(length)
        ids, logps = self.ids[:n, :longest].tolist(), self.logps[:n, :longest].tolist()
        out = []
        for r in range(n):
            slot = slot_of[r]
            m = length[slot]
            out.append(TurnResult(ids[r][:m], logps[r][:m], bool(stopped[slot]), slot, cur[slot]))
        return out


@dataclass
class TurnResult:
    ids: list[int]  # the sampled ids, exactly
    log_probs: list[float]  # log softmax of the sampler's raw logits at each id
    stopped: bool  # ended by a stop tag or EOS (not by its token budget)
    slot: int  # where the row's cache is now
    cached: int  # tokens of the row in its cache: all but the last sampled one


def _text_stop(stop: StopChecker, ids: list[int], cand: list[bool], off: int, s0: int,
               last: int) -> Optional[int]:
    """The first step s in s0..last−1 whose id completes a multi-token stop tag, or None
    (ids[j], cand[j]: the id of step off + j and whether its text holds a tag's last character)."""
    for s in range(s0, last):
        j = s - off
        if cand[j] and stop.text_hit(ids[:j + 1]):
            return s
    return None


class _Clock:
    """Seconds between its creation and `seconds()` on the device's timeline (CUDA events; the
    host's clock on the CPU). `seconds()` synchronises."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def seconds(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


def step_bytes(engine: StaticEngine, b: int) -> int:
    """Bytes a decoding step at bucket b must at least move: every weight once (the sampler's
    parameters), the keys and values of the b slots over all cache columns (the step attends to
    all of them under its mask), and the float32 logits written and read back."""
    weights = sum(p.numel() * p.element_size() for p in engine.forward_params)
    kv = sum(t[:b].numel() * t.element_size() for t in (*engine.kv.k, *engine.kv.v))
    return weights + kv + 2 * engine.logits[:b].numel() * engine.logits.element_size()
