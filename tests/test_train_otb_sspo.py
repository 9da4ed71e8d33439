"""What the trainer's batch preparation gives the new presets (stppo.train.prepare): the optimal
token baseline its old-policy forward (log-probs and Σπ², one pass) and its TIS weights, and
SSPO its subsentences from the tokenizer's punctuation (docs/design.md §2). The equality of the
estimator itself with verl's: tests/verl/test_baselines_vs_verl.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from layouts import multi_turn_layout
from stppo.algos import PRESETS
from stppo.algos.advantages import tir_optimal_token_baseline
from stppo.algos.segments import subsentence_ids
from stppo.batch import Batch
from stppo.config import AlgoConfig, compose, to_config
from stppo.models import policy_log_probs_sum_pi_squared, train_tokenizer
from stppo.train.prepare import (outcome_rewards, prepare_batch, set_subsentence_ends,
                                 subsentence_end_table)
from stppo.train.update import old_log_probs_from_update

N, T, VOCAB = 8, 26, 40


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).double().eval()


def _batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    ids, attn, loss, turns = multi_turn_layout(g, N, T, VOCAB, prompt=3, action=(2, 6), gap=(1, 4),
                                               shortest=8, no_agent_rows=(7,))
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, turn_ids=turns,
                 group_ids=torch.tensor([0, 0, 0, 1, 1, 2, 3, 3]),
                 scores=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]))


# --- the optimal token baseline -------------------------------------------------------------------
def test_the_optimal_token_baseline_reads_the_old_forwards_sum_pi_squared():
    policy, batch = _model(), _batch()
    algo = AlgoConfig(name="tir_optimal_token_baseline")
    out, metrics = prepare_batch(batch, policy, None, None, algo, chunk=3)
    old, s2 = policy_log_probs_sum_pi_squared(policy, batch.input_ids, batch.attention_mask,
                                              positions=batch.loss_mask)
    want, ret = tir_optimal_token_baseline(outcome_rewards(batch), batch.loss_mask,
                                           batch.group_ids, old, s2)
    assert torch.equal(out.old_log_probs, old)  # the same forward, chunked
    assert torch.allclose(out.advantages, want, atol=1e-12) and torch.allclose(out.returns, ret)
    assert out.advantages[batch.loss_mask].abs().max() > 0 and out.values is None
    ones = (s2 - old.exp() ** 2)[batch.loss_mask]  # Σ_v π(v)² ≥ π(y)²: the other ids add
    assert (ones > 0).all() and (s2[batch.loss_mask] <= 1).all()


def test_the_optimal_token_baseline_scales_its_energies_by_the_rollout_correction_weights():
    """A decoupled correction with IS weights: the energies take the batch's ω² (verl's
    `compute_advantage` reads `rollout_is_weights` from the batch)."""
    policy, batch = _model(), _batch()
    g = torch.Generator().manual_seed(5)
    batch = replace(batch, rollout_log_probs=torch.where(
        batch.loss_mask, -torch.rand(N, T, generator=g, dtype=torch.float64) * 3, 0.0))
    plain, _ = prepare_batch(batch, policy, None, None,
                             AlgoConfig(name="tir_optimal_token_baseline"))
    algo = AlgoConfig(name="tir_optimal_token_baseline", rollout_correction="decoupled_token_is",
                      rollout_correction_options={"threshold": 1.5})
    tis, _ = prepare_batch(batch, policy, None, None, algo)
    w = tis.rollout_is_weights
    assert w is not None and (w[batch.loss_mask] <= 1.5).all()
    want, _ = tir_optimal_token_baseline(outcome_rewards(batch), batch.loss_mask, batch.group_ids,
                                         tis.old_log_probs, policy_log_probs_sum_pi_squared(
                                             policy, batch.input_ids, batch.attention_mask,
                                             positions=batch.loss_mask)[1], w)
    assert torch.allclose(tis.advantages, want, atol=1e-12)
    assert not torch.allclose(plain.advantages, tis.advantages)


def test_the_optimal_token_baseline_refuses_a_bypass_correction():
    """Bypass mode takes the sampler's log-probs as π_old: no old-policy forward, no Σπ²."""
    with pytest.raises(ValueError, match="bypass_pg_is.*tir_optimal_token_baseline") as e:
        AlgoConfig(name="tir_optimal_token_baseline", rollout_correction="bypass_pg_is")
    assert "\n" not in str(e.value)


def test_the_optimal_token_baseline_never_skips_the_old_forward(tiny_cfg):
    one_pass = ["trainer.ppo_epochs=1", "trainer.minibatch_size=16"]  # one minibatch: on-policy
    assert old_log_probs_from_update(to_config(tiny_cfg("algo=grpo", *one_pass)))
    assert not old_log_probs_from_update(to_config(tiny_cfg("algo=tir_optimal_token_baseline",
                                                            *one_pass)))
    assert not old_log_probs_from_update(to_config(tiny_cfg(
        "algo=grpo", "algo.advantage=tir_optimal_token_baseline", *one_pass)))
    with pytest.raises(ValueError, match="reads the old policy's forward"):
        prepare_batch(_batch(), _model(), None, None, AlgoConfig(name="tir_optimal_token_baseline"),
                      skip_old=True)


def test_the_optimal_token_baseline_takes_no_critic():
    assert not PRESETS["tir_optimal_token_baseline"].use_critic
    with pytest.raises(ValueError, match="algo.advantage=gae needs a critic"):
        to_config(compose(["algo=tir_optimal_token_baseline", "algo.advantage=gae"]))


# --- SSPO's subsentences --------------------------------------------------------------------------
def test_the_subsentence_table_marks_the_ids_whose_text_holds_a_delimiter():
    tok = train_tokenizer(["Paris is big. Rome, too!\nYes", "a b c. d, e"] * 20, vocab_size=300,
                          use_cache=False)
    table = subsentence_end_table(tok, ".,\\n", len(tok) + 7)  # a vocabulary padded beyond it
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    assert table.shape == (len(tok) + 7,) and not table[len(tok):].any()
    for i, text in enumerate(texts):
        assert bool(table[i]) == any(c in text for c in ".,\n"), repr(text)
    assert table.any() and not table.all()
    assert not subsentence_end_table(tok, "!", len(tok))[tok.convert_tokens_to_ids(".")]
    with pytest.raises(ValueError, match="algo.subsentence_delimiters must name at least one"):
        to_config(compose(["algo=sspo", "algo.subsentence_delimiters=''"]))


def test_sspo_batches_carry_subsentences_from_the_policys_table():
    policy, batch = _model(), _batch()
    with pytest.raises(ValueError, match="needs the tokenizer's subsentence ends"):
        prepare_batch(batch, policy, None, None, AlgoConfig(name="sspo"))
    table = torch.arange(VOCAB) % 5 == 0  # ids 0, 5, 10, …: "punctuation"
    set_subsentence_ends(policy, table)
    out, _ = prepare_batch(batch, policy, None, None, AlgoConfig(name="sspo"))
    assert torch.equal(out.segment_ids, subsentence_ids(table[batch.input_ids], batch.loss_mask,
                                                        batch.turn_ids))
    assert out.segment_ids.max() > batch.turn_ids.max()  # finer than the turns
    grpo, _ = prepare_batch(batch, policy, None, None, AlgoConfig(name="grpo"))
    assert grpo.segment_ids is None  # only the modes that read them
