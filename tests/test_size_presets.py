"""The random-init Qwen2.5 size presets (qwen2_5_0_5b_init, qwen2_5_1_5b_init) and the GPU size
check (`+experiment=size_probe`): the published architectures and parameter counts, a build next to
the small local tokenizer (ids beyond it decode to nothing), and the experiment running end to end
on CPU at a tiny override scale."""

from __future__ import annotations

import sqlite3

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import THREADS, TINY_OVERRIDES
from stppo.models import (MODEL_PRESETS, count_parameters, load_model, policy_log_probs,
                          published_arch, random_config, train_tokenizer)

TEXTS = ["Alice Smith was born in Lyon. <search> Alice </search><answer> Lyon </answer>"] * 40
PUBLISHED = {  # Qwen2.5-{0.5B,1.5B}-Instruct config.json, and the model cards' parameter counts
    "qwen2_5_0_5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, params=494_032_768),
    "qwen2_5_1_5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, params=1_543_714_304),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(TEXTS, vocab_size=300, use_cache=False)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_architecture_and_parameter_count_without_allocating(tok, name):
    arch = published_arch(name)
    want = dict(PUBLISHED[name])
    params = want.pop("params")
    assert {k: arch[k] for k in want} == want
    assert (arch["vocab_size"], arch["tie_word_embeddings"], arch["rope_theta"],
            arch["rms_norm_eps"], arch["use_sliding_window"]) == (151_936, True, 1e6, 1e-6, False)
    assert MODEL_PRESETS[f"{name}_init"].arch == arch
    config = random_config(arch, tok)
    assert config.vocab_size == 151_936 and config.eos_token_id == tok.eos_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert count_parameters(model) == params  # tied embeddings counted once


@pytest.mark.parametrize("name", ["qwen2_5_0_5b_init", "qwen2_5_1_5b_init"])
def test_truncated_preset_builds_next_to_a_small_tokenizer(tok, name):
    """2 layers of the real widths; the 151,936-row head stays. Ids beyond the tokenizer are
    valid model inputs and decode to nothing."""
    model, _ = load_model(name, tokenizer=tok, device="cpu", seed=1,
                          arch_overrides={"num_hidden_layers": 2})
    arch = MODEL_PRESETS[name].arch
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == arch["hidden_size"]
    assert model.get_output_embeddings().weight.shape == (151_936, arch["hidden_size"])
    ids = torch.tensor([[*tok.encode("Alice Smith was born"), 151_935, len(tok), 5]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        lp = policy_log_probs(model, ids, mask)
    assert torch.isfinite(lp).all()
    assert tok.decode([151_935, len(tok)]) == ""
    assert tok.decode(ids[0].tolist()) == tok.decode(ids[0, :-3].tolist()) + tok.decode([5])


def test_vocab_smaller_than_the_tokenizer_is_an_error(tok):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        random_config({"vocab_size": 10}, tok)


def test_arch_overrides_only_for_random_presets():
    from stppo.config import ModelConfig

    with pytest.raises(ValueError, match="model.arch_overrides applies to random-init presets"):
        ModelConfig(name="qwen2_5_0_5b", arch_overrides={"num_hidden_layers": 2})


def test_size_probe_composes_with_the_paper_per_gpu_shapes():
    from stppo.config import compose, to_config

    cfg = to_config(compose(["+experiment=size_probe", "model=qwen2_5_0_5b_init"]))
    t = cfg.trainer
    assert (t.questions_per_step, t.minibatch_size, t.micro_batch_size) == (64, 32, 8)
    assert (t.rollout.max_new_tokens, t.rollout.max_total_tokens) == (500, 4096)
    assert cfg.task.max_turns == 4
    assert cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing
    assert cfg.algo.use_critic and cfg.algo.name == "st_ppo" and not t.warmstart.enabled
    assert t.total_steps == 3 and t.val_questions == 0 and cfg.model.name == "qwen2_5_0_5b_init"
    assert to_config(compose(["+experiment=size_probe"])).model.name == "qwen2_5_1_5b_init"


@pytest.mark.slow
def test_size_probe_runs_on_cpu_at_a_tiny_scale(tmp_path):
    """The experiment end to end (rollout over the 151,936-id vocabulary, micro-batches, bf16
    autocast, gradient checkpointing, critic, reference, chunked head), 2 steps of a 1-layer,
    64-wide cut of the 0.5B preset."""
    from stppo.config import compose
    from stppo.train.job import run

    task = [o for o in TINY_OVERRIDES if o.startswith("task.")]
    db = tmp_path / "mlflow.db"
    run(compose(["+experiment=size_probe", "model=qwen2_5_0_5b_init", "trainer.device=cpu",
                 "+model.arch_overrides={num_hidden_layers: 1, hidden_size: 64, "
                 "intermediate_size: 128, num_attention_heads: 2, num_key_value_heads: 1}",
                 "model.logits_chunk=16", *task, "trainer.total_steps=2",
                 "trainer.questions_per_step=4", "trainer.minibatch_size=2",
                 "trainer.micro_batch_size=1", "trainer.rollout.max_new_tokens=6",
                 "trainer.rollout.max_total_tokens=160", "trainer.progress=false",
                 THREADS, f"trainer.out_dir={tmp_path}",
                 f"tracking.uri=sqlite:///{db}"]))
    con = sqlite3.connect(db)
    assert con.execute("select status from runs").fetchall() == [("FINISHED",)]
    metric = dict(con.execute("select key, value from metrics where step=2").fetchall())
    assert metric["actor/skipped_steps"] == 0 and metric["perf/step_time_s"] > 0
    assert metric["actor/grad_norm"] > 0 and metric["critic/vf_loss"] == metric["critic/vf_loss"]
