"""Multi-turn batches in verl's layout, and verl's own actor-loss path on CPU.

`make_batch` builds what verl's trainer hands the actor (left-padded prompts, right-padded
responses, `response_mask` 0 on observation tokens); `run_ppo_loss` then goes through verl's own
code: `left_right_2_no_padding`, `prepare_micro_batches` (the FSDP engine's split, fixed
micro-batch size), and `workers/utils/losses.py::ppo_loss` per micro-batch — with the model's
per-token log-probs replaced by a leaf tensor, so the gradient w.r.t. log π can be read off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

DT = torch.float64


@dataclass
class Batch:
    """One mini-batch, padded as verl's trainer holds it. Tensors (N, ·)."""

    prompts: torch.Tensor  # (N, P) left-padded ids
    responses: torch.Tensor  # (N, T) right-padded ids
    attention_mask: torch.Tensor  # (N, P + T)
    response_mask: torch.Tensor  # (N, T) int: 1 on generated tokens
    log_prob: torch.Tensor  # (N, T) log π_θ (0 on padding, as verl's unpadding returns it)
    old_log_probs: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N, T)

    @property
    def mask(self) -> torch.Tensor:
        return self.response_mask.bool()

    def rows(self, sl: slice) -> "Batch":
        return Batch(*(getattr(self, f)[sl] for f in self.__dataclass_fields__))


def _row_layout(gen: torch.Generator, t: int, kind: str) -> tuple[list[int], int]:
    """(response_mask row, response length) of one row: agent runs of 1–6 tokens separated by
    observation runs of 1–4 tokens; 'truncated' runs to T mid-turn; 'empty' has tokens but no
    agent token (e.g. a sequence verl's rejection sampling masked out)."""
    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    if kind == "empty":
        n = r(3, t)
        return [0] * n + [0] * (t - n), n
    row: list[int] = []
    turns = r(1, 4) if kind != "truncated" else 99
    for k in range(turns):
        if k:
            row += [0] * r(1, 4)
        row += [1] * r(1, 6)
        if len(row) >= t:
            break
    if kind == "truncated":
        row = row[:t]
        row[-1] = 1  # the last position is inside a turn: cut mid-turn
        row[-2] = 1
    else:
        row = row[: t - 1]  # ≥ 1 padding position
    n = len(row)
    return row + [0] * (t - n), n


def make_batch(n: int = 8, t: int = 24, p: int = 5, seed: int = 0, spread: float = 0.6,
               garbage: float = float("nan")) -> Batch:
    """n rows: row 1 truncated mid-turn, row n−2 empty, the others 1–4 turns then padding.
    log π − log π_old ~ N(0, spread²) plus a few large steps, so clipping (and the dual clip, c = 3,
    on A < 0) binds somewhere; `garbage` fills old log-probs and advantages off agent tokens."""
    gen = torch.Generator().manual_seed(seed)
    kinds = ["turns"] * n
    kinds[1], kinds[n - 2] = "truncated", "empty"
    masks, lengths = zip(*(_row_layout(gen, t, k) for k in kinds))
    response_mask = torch.tensor(masks, dtype=torch.long)  # (N, T)
    resp_len = torch.tensor(lengths)  # (N,)
    prompt_len = torch.randint(1, p + 1, (n,), generator=gen)  # (N,)
    pos_p = torch.arange(p).expand(n, p)
    prompt_att = (pos_p >= p - prompt_len.unsqueeze(1)).long()  # left padding
    resp_att = (torch.arange(t).expand(n, t) < resp_len.unsqueeze(1)).long()  # right padding
    prompts = torch.randint(3, 50, (n, p), generator=gen) * prompt_att
    responses = torch.randint(3, 50, (n, t), generator=gen) * resp_att
    old = -torch.rand(n, t, generator=gen, dtype=DT) * 3.0
    step = torch.randn(n, t, generator=gen, dtype=DT) * spread
    step = step + (torch.rand(n, t, generator=gen, dtype=DT) < 0.08) * 2.0  # ρ ≈ e² > c
    lp = (old + step) * resp_att  # verl's unpadding yields 0 on padding
    adv = torch.randn(n, t, generator=gen, dtype=DT)
    agent = response_mask.bool()
    return Batch(prompts, responses, torch.cat([prompt_att, resp_att], 1), response_mask, lp,
                 torch.where(agent, old, garbage), torch.where(agent, adv, garbage))


def _trainer_td(b: Batch) -> TensorDict:
    n, p = b.prompts.shape
    att = b.attention_mask
    input_ids = torch.cat([b.prompts, b.responses], dim=1)
    position_ids = (att.cumsum(dim=1) - 1).clamp(min=0)
    return TensorDict({"prompts": b.prompts, "responses": b.responses, "input_ids": input_ids,
                       "attention_mask": att, "position_ids": position_ids,
                       "response_mask": b.response_mask, "old_log_probs": b.old_log_probs,
                       "advantages": b.advantages}, batch_size=[n])


def _model_log_probs(b: Batch, leaf: torch.Tensor, rows: range) -> torch.Tensor:
    """What the FSDP engine's forward returns for `rows`: a jagged (bsz, prompt + response) tensor
    of per-token log-probs, shifted by one (position j predicts token j + 1), built from `leaf`
    (N, T) so that verl's `no_padding_2_padding` slices exactly leaf's response positions."""
    pieces, offsets = [], [0]
    for i in rows:
        pl = int(b.attention_mask[i, : b.prompts.shape[1]].sum())
        rl = int(b.attention_mask[i, b.prompts.shape[1]:].sum())
        pieces += [leaf.new_full((pl - 1,), -7.0), leaf[i, :rl], leaf.new_full((1,), -7.0)]
        offsets.append(offsets[-1] + pl + rl)
    values = torch.cat(pieces)
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor(offsets))


def run_ppo_loss(config, b: Batch, micro: int, dp_size: int = 1, batch_num_tokens=None,
                 global_batch_size=None) -> tuple[list[torch.Tensor], list[dict], torch.Tensor]:
    """verl's actor-loss path over `b` in micro-batches of `micro` rows (one rank's share when
    dp_size > 1; pass the global counts then). Returns the micro-batch losses, their metrics
    (verl's `Metric` objects, one value each) and ∂(Σ losses)/∂ log π (N, T)."""
    td = left_right_2_no_padding(_trainer_td(b))
    tokens = int(b.response_mask.sum()) if batch_num_tokens is None else batch_num_tokens
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=tokens,
                         global_batch_size=len(b.prompts) if global_batch_size is None
                         else global_batch_size, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=micro)
    micro_batches, order = prepare_micro_batches(td)
    assert order is None  # fixed-size micro-batches keep the row order
    leaf = b.log_prob.clone().requires_grad_(True)
    losses, metrics = [], []
    for m, mb in enumerate(micro_batches):
        rows = range(m * micro, (m + 1) * micro)
        out = {"log_probs": _model_log_probs(b, leaf, rows)}
        loss, met = ppo_loss(config, out, mb)
        loss.backward()
        losses.append(loss.detach())
        metrics.append(met)
    return losses, metrics, leaf.grad


def floats(metrics: dict) -> dict[str, float]:
    """verl's per-micro-batch `Metric` objects → their single value."""
    out = {}
    for k, v in metrics.items():
        vals = getattr(v, "values", [v])
        assert len(vals) == 1, k
        out[k] = float(vals[0])
    return out
