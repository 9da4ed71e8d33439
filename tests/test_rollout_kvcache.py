"""stppo.rollout.kvcache: the growing cache layer and carrying keys/values across turns."""

import warnings

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from stppo.envs.base import Question
from stppo.models import MODEL_PRESETS, build_random_model, train_tokenizer
from stppo.rollout import RolloutConfig, rollout
from stppo.rollout import engine as engine_module
from stppo.rollout import kvcache
from stppo.rollout.kvcache import GrowingCache, GrowingLayer
from echo_env import EchoEnv

TEXTS = ["Question: where was Alice born?\n<search> Alice born</search>\n<information> Alice was "
         "born in Lyon.</information>\n<answer> Lyon</answer>"] * 10


def test_growing_layer_matches_concatenation():
    g = torch.Generator().manual_seed(0)
    grow, ref = GrowingLayer(), DynamicLayer()
    for step, n in enumerate([5, 1, 1, 70, 1, 3, 1]):  # crosses the initial capacity (64)
        k, v = torch.randn(4, 2, n, 8, generator=g), torch.randn(4, 2, n, 8, generator=g)
        if step == 4:  # drop rows 1 and 2, as the engine does when rows finish
            idx = torch.tensor([0, 3])
            grow.batch_select_indices(idx)
            ref.batch_select_indices(idx)
        if grow.get_seq_length() and grow.keys.shape[0] == 2:
            k, v = k[:2], v[:2]
        gk, gv = grow.update(k, v)
        rk, rv = ref.update(k, v)
        assert torch.equal(gk, rk) and torch.equal(gv, rv)
        assert grow.get_seq_length() == ref.get_seq_length()
    grow.crop(-2)  # another method replacing the views: the next update still appends correctly
    ref.crop(-2)
    k = torch.randn(2, 2, 1, 8, generator=g)
    assert torch.equal(grow.update(k, k)[0], ref.update(k, k)[0])


ENV = EchoEnv(max_turns=4)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return train_tokenizer(TEXTS, vocab_size=300)


def test_growing_cache_gives_the_same_logits_as_the_default_cache(tok):
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()
    ids = torch.tensor([tok.encode(TEXTS[0])[:30]] * 2)
    outs = []
    with torch.no_grad():
        for cache in (DynamicCache(config=model.config), GrowingCache(model.config.num_hidden_layers)):
            key = kvcache.cache_kwarg(type(model).forward)
            logits = [model(input_ids=ids[:, :20], use_cache=True, **{key: cache}).logits]
            for t in range(20, 30):
                logits.append(model(input_ids=ids[:, t:t + 1], use_cache=True,
                                    **{key: cache}).logits)
            outs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    assert kvcache.supports_row_caches(model)


def test_carrying_caches_across_turns_changes_nothing(tok, monkeypatch):
    """Re-encoding every trajectory from scratch each turn (the fallback for sliding-window
    models) samples the same tokens with the same log-probs."""
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()
    questions = [Question(str(i), f"where was person {i} born?", ("Lyon",)) for i in range(10)]
    cfg = RolloutConfig(max_new_tokens=10, max_total_tokens=300)
    carried = rollout(model, tok, ENV, questions, cfg, generator=torch.Generator().manual_seed(3))
    for module in (engine_module, kvcache):
        monkeypatch.setattr(module, "supports_row_caches", lambda model: False)
    fresh = rollout(model, tok, ENV, questions, cfg, generator=torch.Generator().manual_seed(3))
    assert carried.num_turns.tolist() == [4] * 10
    assert torch.equal(carried.input_ids, fresh.input_ids)
    torch.testing.assert_close(carried.rollout_log_probs, fresh.rollout_log_probs, atol=1e-5, rtol=0)


def test_cache_kwarg_is_the_name_the_function_takes():
    def new(input_ids=None, cache=None, **kwargs): ...

    def old(input_ids=None, past_key_values=None, **kwargs): ...

    assert kvcache.cache_kwarg(new) == "cache"
    assert kvcache.cache_kwarg(old) == "past_key_values"
    assert kvcache.cache_kwarg(object()) == "past_key_values"  # no signature: the old name


def test_the_rollout_passes_the_cache_under_the_name_the_installed_transformers_takes(tok):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns,
    and is to be removed in 5.40); the engine uses whichever the installed model forward takes."""

    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()
    questions = [Question(str(i), f"where was person {i} born?", ("Lyon",)) for i in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = rollout(model, tok, ENV, questions, RolloutConfig(max_new_tokens=6),
                        generator=torch.Generator().manual_seed(0))
    assert batch.num_turns.tolist() == [4] * 3
    assert not [w for w in caught if "past_key_values" in str(w.message)]
