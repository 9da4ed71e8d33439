"""stppo.rollout.leanstep: the lean decoding step is the model's forward, bit for bit, where it
is used; everywhere else (and wherever it would differ) the engine steps through the forward."""

import functools
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from stppo.envs.base import Question
from stppo.models import MODEL_PRESETS, build_random_model, train_tokenizer
from stppo.rollout import RolloutConfig, rollout
from stppo.rollout import engine as engine_module
from stppo.rollout import leanstep
from stppo.rollout.kvcache import GrowingCache, GrowingLayer
from echo_env import EchoEnv

TEXTS = ["Question: where was Alice born?\n<search> Alice born</search>\n<information> Alice was "
         "born in Lyon.</information>\n<answer> Lyon</answer>"] * 10


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return train_tokenizer(TEXTS, vocab_size=300)


def _qwen2(tok):
    return build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()


def _llama(tok, **overrides):
    """A random Llama (SmolLM2's family) with grouped-query attention: 4 heads, 2 KV heads."""
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _llama_biased(tok):
    return _llama(tok, attention_bias=True, mlp_bias=True)


def _prefilled(model, rows=5, length=23, seed=0):
    """A growing cache holding `length` random positions per row (rows 1 and 3 left-padded) and
    the (B, 1, 1, length + 1) mask of the next step."""
    cfg = model.config
    h = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k, v = torch.randn(rows, h, 64, d, generator=g), torch.randn(rows, h, 64, d, generator=g)
        layers.append(GrowingLayer.over(k, v, length))
    mask = torch.ones(rows, length + 1, dtype=torch.bool)
    mask[1, :7] = mask[3, :2] = False
    return GrowingCache(layers=layers), mask[:, None, None, :]


def _step_inputs(model, rows=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, 1), generator=g)
    return ids, torch.randint(10, 30, (rows, 1), generator=g)


def _forward(model, ids, pos, mask, cache):
    return model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                 cache=cache).logits[:, -1]


@pytest.mark.parametrize("make", [_qwen2, _llama, _llama_biased],
                         ids=["qwen2", "llama-gqa", "llama-biases"])
@pytest.mark.parametrize("masked", [True, False])
def test_lean_step_is_the_forward_bit_for_bit(tok, make, masked):
    model = make(tok)
    assert leanstep.supported(model)
    ids, pos = _step_inputs(model)
    theirs_cache, mask = _prefilled(model)
    mine_cache, _ = _prefilled(model)
    mask = mask if masked else None
    with torch.inference_mode():
        theirs = _forward(model, ids, pos, mask, theirs_cache)
        mine = leanstep.LeanStep(model)(ids, pos, mask, mine_cache)
    assert mine.shape == (5, model.config.vocab_size) and mine.dtype == theirs.dtype
    assert torch.equal(mine, theirs)
    for a, b in zip(mine_cache.layers, theirs_cache.layers):  # the same keys/values appended
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama-gqa"])
def test_lean_step_under_bf16_autocast_and_bf16_parameters(tok, make):
    model = make(tok)
    ids, pos = _step_inputs(model)
    for cast_params in (False, True):
        if cast_params:
            model = model.to(torch.bfloat16)
        caches = [_prefilled(model) for _ in range(2)]
        if cast_params:
            for cache, _ in caches:
                for layer in cache.layers:
                    layer.keys, layer.values = (layer.keys.bfloat16(), layer.values.bfloat16())
                    layer._kbuf = layer._vbuf = None  # re-buffered on the next append
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = _forward(model, ids, pos, caches[0][1], caches[0][0])
            mine = leanstep.LeanStep(model)(ids, pos, caches[1][1], caches[1][0])
        assert mine.dtype == theirs.dtype == torch.bfloat16
        assert torch.equal(mine, theirs)


def test_models_it_does_not_reproduce_step_through_their_forward(tok):
    qwen = _qwen2(tok)
    assert leanstep.supported(qwen)
    hooked = _qwen2(tok)
    hooked.model.layers[0].mlp.register_forward_hook(lambda m, i, o: o * 2)
    assert not leanstep.supported(hooked)
    patched = _qwen2(tok)  # how accelerate's device-map hooks wrap a module
    patched.model.norm.forward = lambda x, f=patched.model.norm.forward: f(x)
    assert not leanstep.supported(patched)
    eager = _qwen2(tok)
    eager.config._attn_implementation = "eager"
    assert not leanstep.supported(eager)
    arch = dict(MODEL_PRESETS["tiny"].arch, use_sliding_window=True, sliding_window=16,
                max_window_layers=1)  # layers 1.. attend within a window
    sliding = build_random_model(arch, tok, seed=0).eval()
    assert "sliding_attention" in sliding.config.layer_types
    assert not leanstep.supported(sliding)

    class Wrapped(torch.nn.Linear):  # an adapter-style projection (LoRA and the like)
        pass
    adapted = _llama(tok)
    old = adapted.model.layers[1].self_attn.v_proj
    adapted.model.layers[1].self_attn.v_proj = Wrapped(old.in_features, old.out_features, bias=False)
    assert not leanstep.supported(adapted)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1,
                                                       n_head=2, n_positions=64))
    assert not leanstep.supported(gpt2)
    steps = leanstep.ModelSteps(hooked, "cache")
    assert steps.lean is None
    ids, pos = _step_inputs(hooked)
    cache, mask = _prefilled(hooked)
    ref_cache, _ = _prefilled(hooked)
    with torch.inference_mode():
        assert torch.equal(steps.decode(ids, pos, mask, cache),
                           _forward(hooked, ids, pos, mask, ref_cache))


@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama-gqa"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_lean_prefill_runs_the_last_layer_on_the_last_position_only(tok, make, bf16):
    """The prefill's cache is the forward's bit for bit; its last-position logits come from the
    same computation on fewer rows (other matrix kernels: equal up to their rounding)."""
    model = make(tok)
    rows, cached, width = 5, 23, 17
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (rows, width), generator=g)
    held = torch.ones(rows, cached + width, dtype=torch.bool)
    held[1, :7] = held[3, :2] = False  # left padding of the cached part
    held[2, cached:cached + 4] = False  # a shorter chunk, left-padded
    pos = engine_module.position_ids_from_mask(held)[:, -width:]
    mask = engine_module._prefill_mask(held, cached, width, True)  # (B, 1, W, C+W)
    assert mask.shape == (rows, 1, width, cached + width)
    mine_cache, _ = _prefilled(model, rows, cached)
    theirs_cache, _ = _prefilled(model, rows, cached)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        theirs = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                       cache=theirs_cache, logits_to_keep=1).logits[:, -1]
        mine = leanstep.LeanStep(model)(ids, pos, mask, mine_cache)
    for a, b in zip(mine_cache.layers, theirs_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    # bfloat16 keeps 8 bits: a value rounded the other way moves by 2^-8 of itself
    atol = 4 * 2.0 ** -8 * float(theirs.abs().max()) if bf16 else 1e-5
    torch.testing.assert_close(mine, theirs, atol=atol, rtol=0)


class PlainSteps(leanstep.ModelSteps):
    """Every call through the model's forward."""

    def __init__(self, model, cache_key):
        super().__init__(model, cache_key)
        self.lean = None


def _later_turn_firsts(batch) -> torch.Tensor:
    """(N, T) bool: the first agent token of every turn but the first (a prefill's token)."""
    agent = batch.loss_mask
    firsts = agent & ~torch.cat([torch.zeros_like(agent[:, :1]), agent[:, :-1]], dim=1)
    return firsts & (firsts.cumsum(1) >= 2)


@pytest.mark.parametrize("make", [_qwen2, _llama], ids=["qwen2", "llama-gqa"])
def test_rollout_with_the_lean_steps_is_the_rollout_through_the_forward(tok, make, monkeypatch):
    model = make(tok)
    lean_calls, forward_calls = [], []
    real_call, real_forward = leanstep.LeanStep.__call__, type(model).forward
    monkeypatch.setattr(leanstep.LeanStep, "__call__",
                        lambda self, ids, *a: lean_calls.append(ids.shape[1]) or real_call(self, ids, *a))

    @functools.wraps(real_forward)  # a class-level spy, with the forward's signature
    def spy(self, *a, **k):
        forward_calls.append(k["input_ids"].shape[1])
        return real_forward(self, *a, **k)
    monkeypatch.setattr(type(model), "forward", spy)
    # prompts of several lengths: turn 0's decoding steps have a mask (checked), so turn 1's
    # prefill, which has one too, may be lean
    questions = [Question(str(i), f"where was person {'x y ' * i}born?", ("Lyon",))
                 for i in range(7)]
    cfg = RolloutConfig(max_new_tokens=9, max_total_tokens=400)
    lean = rollout(model, tok, EchoEnv(), questions, cfg, generator=torch.Generator().manual_seed(3))
    assert set(leanstep._checked[model].values()) == {True}
    # the forward: turn 0's prefill (nothing cached) and one decoding step per check; the lean
    # step: every other decoding step and the prefills of turns 1 and 2
    assert sum(n == 1 for n in forward_calls) == len(leanstep._checked[model])
    assert sum(n > 1 for n in forward_calls) == 1 and sum(n > 1 for n in lean_calls) == 2
    assert sum(n == 1 for n in lean_calls) >= 3 * 4
    monkeypatch.setattr(type(model), "forward", real_forward)
    monkeypatch.setattr(engine_module, "ModelSteps", PlainSteps)
    plain = rollout(model, tok, EchoEnv(), questions, cfg, generator=torch.Generator().manual_seed(3))
    assert lean.num_turns.tolist() == [3] * 7
    assert torch.equal(lean.input_ids, plain.input_ids)
    firsts = _later_turn_firsts(lean)
    assert int(firsts.sum()) == 2 * 7
    assert torch.equal(lean.rollout_log_probs[~firsts], plain.rollout_log_probs[~firsts])
    torch.testing.assert_close(lean.rollout_log_probs[firsts], plain.rollout_log_probs[firsts],
                               atol=1e-5, rtol=0)


def test_a_lean_step_that_differs_is_dropped_with_one_warning(tok, monkeypatch, caplog):
    model = _qwen2(tok)
    real_call = leanstep.LeanStep.__call__
    monkeypatch.setattr(leanstep.LeanStep, "__call__",
                        lambda self, *a: real_call(self, *a) + 1e-4)  # a release that drifted
    questions = [Question(str(i), f"where was person {i} born?", ("Lyon",)) for i in range(4)]
    cfg = RolloutConfig(max_new_tokens=6, max_total_tokens=300)
    with caplog.at_level(logging.WARNING, logger="stppo.rollout.leanstep"):
        drifted = rollout(model, tok, EchoEnv(), questions, cfg,
                          generator=torch.Generator().manual_seed(5))
    warnings = [r for r in caplog.records if "lean decoding step" in r.getMessage()]
    assert len(warnings) == 1
    assert set(leanstep._checked[model].values()) == {False}
    monkeypatch.setattr(engine_module, "ModelSteps", PlainSteps)
    plain = rollout(model, tok, EchoEnv(), questions, cfg, generator=torch.Generator().manual_seed(5))
    assert torch.equal(drifted.input_ids, plain.input_ids)  # prefills and steps: the forward's
    assert torch.equal(drifted.rollout_log_probs, plain.rollout_log_probs)
