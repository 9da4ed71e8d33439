"""A tiny float64 policy and one multi-turn training batch for the update tests (the trainer's
micro-batches, the reference update)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from layouts import multi_turn_layout
from stppo.algos.segments import subsentence_ids
from stppo.batch import Batch
from stppo.models import policy_log_probs

N, T, VOCAB = 12, 24, 40


def tiny_policy(seed: int = 0) -> Qwen2ForCausalLM:
    """A random-init Qwen2 (hidden 32, 2 layers, a 40-id vocabulary) in float64, train mode."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).double().train()


def update_batch(policy) -> Batch:
    """N multi-turn rows of T tokens (prompt, turns separated by observations, right padding),
    one row without agent tokens; old log-probs off the current policy (ratios up to e^±0.6, so
    clips bind), sampler and reference log-probs, advantages, values and returns."""
    g = torch.Generator().manual_seed(7)
    ids, attn, loss, turns = multi_turn_layout(g, N, T, VOCAB, prompt=3, action=(1, 6), gap=(1, 4),
                                               shortest=10, no_agent_rows=(5,))  # row 5: prompt only
    with torch.no_grad():
        lp = policy_log_probs(policy, ids, attn, positions=loss)

    def noise(scale):
        u = torch.rand(N, T, generator=g, dtype=torch.float64)
        return torch.where(loss, scale * (2 * u - 1), 0.0)

    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, turn_ids=turns,
                 segment_ids=subsentence_ids(ids % 5 == 0, loss, turns),  # SSPO's subsentences
                 group_ids=torch.arange(N) // 2, scores=torch.rand(N, generator=g),
                 old_log_probs=lp + noise(0.6), rollout_log_probs=lp + noise(0.8),
                 ref_log_probs=lp + noise(0.5),
                 advantages=torch.randn(N, T, generator=g, dtype=torch.float64),
                 values=torch.randn(N, T, generator=g, dtype=torch.float64),
                 returns=torch.randn(N, T, generator=g, dtype=torch.float64))
