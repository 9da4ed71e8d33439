"""The work counts benchmarks/bench_rollout.py prints beside its ratio, on hand-built layouts."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_rollout import generate_work, rollout_work  # noqa: E402


def test_rollout_work_counts_fed_tokens_and_keys_of_decoding_steps():
    # one trajectory: prompt (0-2), turn 0 (3-4), observation (5-6), turn 1 (7-8), padding (9)
    loss = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    turn = torch.tensor([[-1, -1, -1, 0, 0, -1, -1, 1, 1, -1]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    fed, keys = rollout_work(SimpleNamespace(loss_mask=loss, turn_ids=turn, attention_mask=attn))
    assert fed == pytest.approx(8 / 4)  # 9 real tokens, the last never fed; 4 agent tokens
    # decoded: t=4 (after 3, same turn) and t=8 (after 7); 3 and 7 come from prefills
    assert keys == pytest.approx((4 + 8) / 2)


def test_generate_work_counts_prompt_prefill_and_growing_contexts():
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # prompts of 3 and 5 tokens
    fed, keys = generate_work(attn, per_row=3)
    assert fed == pytest.approx((8 + 2 * 2) / 6)
    assert keys == pytest.approx((4 + 5 + 6 + 7) / 4)
    assert generate_work(attn, per_row=1) == (pytest.approx(8 / 2), 0.0)
