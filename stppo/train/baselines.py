"""The baselines' share of the update: what a config adds to the clip path's `policy_loss` call —
the loss mode and its options, and the truncated IS weights between the sampler's log-probs
(`Batch.rollout_log_probs`) and the trainer's π_old (DESIGN.md §2)."""

from __future__ import annotations

import torch

from stppo.algos import truncated_is_weights
from stppo.batch import Batch
from stppo.config import AlgoConfig


def loss_extras(algo: AlgoConfig, mb: Batch, old_log_probs: torch.Tensor) -> dict:
    """The extra `policy_loss` keywords for minibatch `mb` whose π_old log-probs are
    `old_log_probs` (N, T); {} for the plain clip path, so that path's call is unchanged. The TIS
    weights' statistics are logged every step whether TIS is on or not (the sampler-vs-trainer
    diagnostics, `stppo.algos.sampler_mismatch`)."""
    kwargs: dict = {}
    if algo.loss_mode != "clip":
        kwargs.update(loss_mode=algo.loss_mode, options=dict(algo.loss_options))
    if algo.rollout_is.kind == "token":
        if mb.rollout_log_probs is None:
            raise ValueError("algo.rollout_is.kind=token needs the sampler's log-probs "
                             "(Batch.rollout_log_probs)")
        w, _ = truncated_is_weights(old_log_probs, mb.rollout_log_probs, mb.loss_mask,
                                          algo.rollout_is.threshold)
        kwargs["rollout_is_weights"] = w
    return kwargs
