"""The chunked LM head of `policy_log_probs` (`model.logits_chunk`): the same log-probs,
entropies and gradients as one pass over every position, with the float32 logits of at most one
chunk alive at a time — in the forward and, through the per-chunk checkpoint, in the backward."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import stppo.models.logprobs as logprobs
from numerics import assert_close_to_scale
from stppo.models import logits_chunk, policy_log_probs, set_logits_chunk

VOCAB = 300


def _setup(seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(dtype).train()
    ids = torch.randint(0, VOCAB, (4, 20))
    mask = torch.ones(4, 20, dtype=torch.bool)
    mask[1, 15:] = False  # right padding
    positions = torch.rand(4, 20) < 0.7  # agent tokens
    return model, ids, mask, positions


def _run(model, ids, mask, positions, chunk):
    model.zero_grad(set_to_none=True)
    lp, ent = policy_log_probs(model, ids, mask, positions=positions, return_entropy=True,
                               chunk=chunk)
    w = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)
    ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
    return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk", [7, 1])
def test_chunked_head_gives_the_same_log_probs_entropies_and_gradients(chunk):
    """Float64: chunks change which rows one matrix product covers and the order in which the
    head's weight gradient sums over positions; 1e-12 of each tensor's scale is float64
    rounding over ~60 positions with room to spare."""
    model, ids, mask, positions = _setup(dtype=torch.float64)
    lp0, ent0, g0 = _run(model, ids, mask, positions, 10_000)  # one pass
    lp1, ent1, g1 = _run(model, ids, mask, positions, chunk)
    assert lp0.dtype == torch.float64
    assert_close_to_scale(lp1, lp0, 1e-12, "log-probs")
    assert_close_to_scale(ent1, ent0, 1e-12, "entropies")
    for i, (a, b) in enumerate(zip(g0, g1)):
        assert_close_to_scale(b, a, 1e-12, f"gradient {i}")


def _logits_and_saved(model, ids, mask, positions, chunk, monkeypatch):
    """Rows of every float32 logits tensor the head builds (forward and backward), and the
    largest tensor with a vocabulary dimension that autograd saves for backward."""
    rows, saved = [], []
    real = logprobs.linear_fp32

    def spy(x, layer):
        out = real(x, layer)
        rows.append(out.shape[0])
        return out

    monkeypatch.setattr(logprobs, "linear_fp32", spy)

    def pack(t):
        if t.dim() == 2 and t.shape[-1] == VOCAB and t.dtype == torch.float32 and \
                t.data_ptr() != model.lm_head.weight.data_ptr():
            saved.append(t.shape[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = policy_log_probs(model, ids, mask, positions=positions, return_entropy=True,
                                   chunk=chunk)
    n_forward = len(rows)
    (lp.sum() + ent.sum()).backward()
    return rows, n_forward, max(saved, default=0)


def test_at_most_one_chunk_of_logits_exists_also_in_backward(monkeypatch):
    model, ids, mask, positions = _setup()
    m = int(logprobs.target_positions(mask, positions).sum())
    rows, n_fwd, saved = _logits_and_saved(model, ids, mask, positions, 7, monkeypatch)
    chunks = -(-m // 7)
    assert max(rows) <= 7 and n_fwd == chunks and len(rows) == 2 * chunks  # recomputed per chunk
    assert saved == 0  # no logits saved for backward
    # the same probe sees the logits of every position in one pass (so it can fail)
    rows, n_fwd, saved = _logits_and_saved(model, ids, mask, positions, 10_000, monkeypatch)
    assert rows == [m] and saved == m


def test_no_grad_passes_are_chunked_without_recomputation(monkeypatch):
    """Without a graph each chunk's logits are built once (no checkpoint, nothing to recompute):
    ⌈m/5⌉ head calls of at most 5 rows covering the m positions once, with the log-probs of one
    pass up to the matrix kernel's rounding on fewer rows (float32: 1e-6 of their scale; 1 ulp
    measured)."""
    model, ids, mask, positions = _setup()
    m = int(logprobs.target_positions(mask, positions).sum())
    rows = []
    real = logprobs.linear_fp32
    monkeypatch.setattr(logprobs, "linear_fp32",
                        lambda x, layer: rows.append(len(x)) or real(x, layer))
    with torch.no_grad():
        lp = policy_log_probs(model, ids, mask, positions=positions, chunk=5)
        rows_chunked = list(rows)
        rows.clear()
        whole = policy_log_probs(model, ids, mask, positions=positions, chunk=10_000)
    assert not lp.requires_grad
    assert max(rows_chunked) <= 5 and sum(rows_chunked) == m and len(rows_chunked) == -(-m // 5)
    assert rows == [m]
    assert_close_to_scale(lp, whole, 1e-6, "log-probs")


def test_entropy_without_graph_keeps_its_values():
    model, ids, mask, positions = _setup()
    lp, ent = policy_log_probs(model, ids, mask, positions=positions, return_entropy=True, chunk=6)
    lp2, ent2 = policy_log_probs(model, ids, mask, positions=positions, return_entropy=True,
                                 chunk=6, entropy_grad=False)
    assert ent.requires_grad and not ent2.requires_grad and lp2.requires_grad
    assert torch.equal(ent.detach(), ent2) and torch.equal(lp.detach(), lp2.detach())


def test_chunk_size_setting():
    model, ids, mask, positions = _setup()
    assert logits_chunk(model, 151_936) == 441  # 256 MiB of float32 logits
    assert logits_chunk(model, VOCAB) == 256 * 2**20 // (4 * VOCAB)
    set_logits_chunk(model, 64)
    assert logits_chunk(model, 151_936) == 64
    with pytest.raises(ValueError, match="positive number of positions"):
        set_logits_chunk(model, 0)
    from stppo.config import ModelConfig

    with pytest.raises(ValueError, match=r"model\.logits_chunk must be null \(auto\) or >= 1"):
        ModelConfig(name="tiny", logits_chunk=0)
