"""From a rollout to a training batch: π_old / π_ref log-probs, values, rewards, advantages.

    rollout (π_old) → old_log_probs, ref_log_probs, values → rewards (+ KL if in reward)
                    → rollout correction (decoupled mode) → advantages and returns of the preset

The rollout correction (`algo.rollout_correction`, the component of `stppo.train.rollout_corr`)
says where π_old comes from — the sampler's log-probs in bypass mode (no forward), else this
forward — and acts here once per step in decoupled mode, as verl's does before its advantages:
the rejected tokens leave the loss mask and the IS weights join the batch.

Every forward computes the agent tokens only (the LM and value heads run on those positions)
under the run's precision (autocast). When the update is provably on-policy (`skip_old`: see
`stppo.train.update.old_log_probs_from_update`) the old log-probs are not computed here: the
update takes the detached log-probs of its own forward, the same numbers, one forward less.

The optimal token baseline (`OLD_POLICY_ESTIMATORS`) also reads Σ_v π_old(v)² of each agent token,
from the same old-policy forward, and the decoupled rollout correction's IS weights when the run
has them (`Batch.rollout_is_weights`, as verl's `compute_advantage`); bypass mode, which has no
old-policy forward, cannot give it Σπ² (one line). A loss mode that
reads subsentences (SSPO, `LossMode.segments`) gets `Batch.segment_ids` from the token ids: a
token ends a subsentence when its text contains one of `algo.subsentence_delimiters`, a table over
the vocabulary that `build_components` attaches to the policy (`set_subsentence_ends`), since the
tokenizer decides which ids those are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from stppo.algos import LOSS_MODES, compute_advantages, kl_in_reward
from stppo.algos.advantages import OLD_POLICY_ESTIMATORS
from stppo.algos.segments import subsentence_ids
from stppo.batch import Batch
from stppo.config import AlgoConfig, delimiter_chars
from stppo.models import Precision, policy_log_probs, policy_log_probs_sum_pi_squared
from stppo.train.rollout_corr import Gather, correction_for
from stppo.metric_names import (ADV_MAX, ADV_MEAN, ADV_MIN, ADV_STD, RETURNS_MEAN, VALUES_MEAN)


FORWARD_CHUNK = 64  # rows per no-grad forward, unless trainer.micro_batch_size says otherwise


@torch.no_grad()
def forward_in_chunks(fn, batch: Batch, chunk: int):
    """fn(input_ids, attention_mask, positions) → (n, T), or a tuple of them, over row chunks of
    the batch, concatenated; `positions` is the chunk's loss mask (the agent tokens)."""
    outs = [fn(batch.input_ids[i:i + chunk], batch.attention_mask[i:i + chunk],
               batch.loss_mask[i:i + chunk]) for i in range(0, len(batch), chunk)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(xs, dim=0) for xs in zip(*outs))
    return torch.cat(outs, dim=0)


def _log_probs(model):
    return lambda ids, mask, pos: policy_log_probs(model, ids, mask, positions=pos)


def _log_probs_sum_pi_squared(model):
    return lambda ids, mask, pos: policy_log_probs_sum_pi_squared(model, ids, mask, positions=pos)


def eval_log_probs(model, batch: Batch, chunk: int, of=_log_probs):
    """`forward_in_chunks` of `of(model)` (log-probs; or log-probs and Σπ²) with the model in eval
    mode, its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        return forward_in_chunks(of(model), batch, chunk)
    finally:
        model.train(was_training)


# --- subsentences (SSPO) ------------------------------------------------------------------------
SUBSENTENCE_ENDS = "stppo_subsentence_ends"  # the policy's attribute: (V,) bool, ids ending one


def subsentence_end_table(tokenizer, delimiters: str, size: int) -> torch.Tensor:
    """(size,) bool: token id v ends a subsentence when its decoded text contains one of the
    characters of `delimiters` (`algo.subsentence_delimiters`, `\\n` = newline); ids the
    tokenizer does not know (a vocabulary padded beyond it) end none. One decode per id, once
    per run."""
    chars = set(delimiter_chars(delimiters))
    known = min(size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    table = torch.zeros(size, dtype=torch.bool)
    table[:known] = torch.tensor([any(c in text for c in chars) for text in texts],
                                 dtype=torch.bool)
    return table


def set_subsentence_ends(model: torch.nn.Module, table: torch.Tensor) -> None:
    """Attach the subsentence-end table (V,) bool to the policy (copies inherit it)."""
    if table.dtype != torch.bool or table.dim() != 1:
        raise ValueError(f"the subsentence-end table must be a (V,) bool tensor, got "
                         f"{table.dtype} {tuple(table.shape)}")
    setattr(model, SUBSENTENCE_ENDS, table)


def batch_subsentence_ids(batch: Batch, policy) -> torch.Tensor:
    """`stppo.algos.segments.subsentence_ids` of the batch from the policy's table. (N, T)"""
    table = getattr(policy, SUBSENTENCE_ENDS, None)
    if table is None:
        raise ValueError("a loss mode that reads subsentences (sspo) needs the tokenizer's "
                         "subsentence ends: stppo.train.prepare.set_subsentence_ends(policy, "
                         "subsentence_end_table(tokenizer, algo.subsentence_delimiters, V))")
    table = table.to(batch.input_ids.device)
    ids = batch.input_ids
    ends = torch.where(ids < table.numel(), table[ids.clamp(0, table.numel() - 1)], False)
    return subsentence_ids(ends, batch.loss_mask, batch.turn_ids)


def real_scores(batch: Batch) -> torch.Tensor:
    """(N,) the scores as float32, or float64 when they are (a float64 check of the update)."""
    return batch.scores if batch.scores.dtype == torch.float64 else batch.scores.float()


def outcome_rewards(batch: Batch) -> torch.Tensor:
    """(N, T): the trajectory's score at its last agent token, 0 elsewhere (docs/design.md §1)."""
    n, t = batch.input_ids.shape
    pos = torch.arange(t, device=batch.input_ids.device).expand(n, t)  # (N, T)
    last = torch.where(batch.loss_mask, pos, -1).max(dim=1).values  # (N,) -1: no agent token
    scores = real_scores(batch)
    rewards = torch.zeros(n, t, dtype=scores.dtype, device=batch.input_ids.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards


def masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float, float]:
    v = x[mask]
    if v.numel() == 0:
        return 0.0, 0.0, 0.0, 0.0
    return float(v.mean()), float(v.std(unbiased=False)), float(v.max()), float(v.min())


@torch.no_grad()
def prepare_batch(batch: Batch, policy, critic, ref, algo: AlgoConfig, *,
                  chunk: int = FORWARD_CHUNK, reduce=None, precision: Precision = Precision(),
                  skip_old: bool = False, gather: Gather = None) -> tuple[Batch, dict[str, float]]:
    """Fill old/ref log-probs, values, rewards, advantages and returns; return advantage stats
    (and the decoupled rollout correction's metrics). `chunk`: rows per forward (the run's
    `trainer.micro_batch_size` when set). `reduce` (data parallelism: an all-reduce sum over
    ranks) makes advantage whitening global, `gather` (`Dist.gather_rows`) the rollout
    correction's statistics. `skip_old`: leave old_log_probs None for the update to fill (an
    on-policy update)."""
    corr = correction_for(algo.spec.rollout_correction)
    otb = algo.advantage in OLD_POLICY_ESTIMATORS
    if otb and (skip_old or corr.old_from_sampler):
        raise ValueError(f"advantage={algo.advantage} reads the old policy's forward: skip_old=False "
                         "and no bypass-mode rollout correction")
    with precision.autocast():
        old, pi_sq = corr.old_log_probs(batch), None  # bypass: π_old := π_rollout
        if old is None and otb:
            old, pi_sq = eval_log_probs(policy, batch, chunk, of=_log_probs_sum_pi_squared)
        elif old is None and not skip_old:
            old = eval_log_probs(policy, batch, chunk)
        ref_lp = forward_in_chunks(_log_probs(ref), batch, chunk) if ref is not None else None
        values = (forward_in_chunks(lambda i, m, p: critic.values(i, m, positions=p), batch, chunk)
                  if critic is not None else None)

    metrics: dict[str, float] = {}
    rewards = outcome_rewards(batch)
    if ref_lp is not None and algo.kl.in_reward and algo.kl.coef > 0:
        if old is None:
            raise ValueError("the KL penalty in the reward needs the old log-probs: skip_old=False")
        rewards, kl_m = kl_in_reward(rewards, old, ref_lp, batch.loss_mask,
                                     beta=algo.kl.coef, kind=algo.kl.estimator)
        metrics.update({k: float(v) for k, v in kl_m.items()})
    batch, corr_m = corr.prepare(batch, old, gather)  # decoupled: rejection and IS weights
    metrics.update(corr_m)
    adv, ret = compute_advantages(
        algo.advantage, loss_mask=batch.loss_mask, turn_ids=batch.turn_ids, rewards=rewards,
        values=values, scores=real_scores(batch), group_ids=batch.group_ids, gamma=algo.gamma,
        gae_lambda=algo.gae_lambda, eps=algo.grpo_eps, whiten=algo.whiten_advantages, reduce=reduce,
        old_log_probs=old, sum_pi_squared=pi_sq,
        rollout_is_weights=batch.rollout_is_weights if otb else None)
    mean, std, mx, mn = masked_stats(adv, batch.loss_mask)
    metrics.update({ADV_MEAN: mean, ADV_STD: std, ADV_MAX: mx, ADV_MIN: mn,
                    RETURNS_MEAN: masked_stats(ret, batch.loss_mask)[0]})
    if values is not None:
        metrics[VALUES_MEAN] = masked_stats(values, batch.loss_mask)[0]
    segs = (batch_subsentence_ids(batch, policy) if LOSS_MODES[algo.spec.runs].segments
            else None)
    out = replace(batch, old_log_probs=old, ref_log_probs=ref_lp, values=values, rewards=rewards,
                  advantages=adv, returns=ret, segment_ids=segs)
    return out, metrics

