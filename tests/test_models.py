"""stppo.models: tokenizer, presets, loaders, per-token log-probs, reference model, critic."""

import pytest
import torch

from stppo.envs.base import TAGS
from stppo.models import (MODEL_PRESETS, ModelPreset, ValueModel, build_random_model,
                          count_parameters, load_model, policy_log_probs, reference_model,
                          register_model_preset, tags_are_single_tokens, train_tokenizer)
from stppo.models import tokenizer as tokenizer_module
from stppo.models.loading import default_dtype, resolve_dtype

TEXTS = [
    "Question: where was Alice Smith born?\n<think> I need to search.</think>"
    "<search> Alice Smith born</search><information>Doc 1(Title: \"Alice Smith\") Alice Smith was "
    "born in Lyon.</information><answer> Lyon</answer>",
    "Bob Jones works at Acme Corp. Acme Corp is based in Paris. Paris is a city in France.",
    "The city of Lyon is in France. Carol White was born in Berlin.",
] * 30


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tok(cache):
    return train_tokenizer(TEXTS, vocab_size=400)


def _tiny(tok, seed=0):
    return build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=seed).eval()


# --- tokenizer ---------------------------------------------------------------------------------

def test_tags_are_single_special_tokens_and_text_round_trips(tok):
    assert tags_are_single_tokens(tok)
    text = "Question: x?\n<search> Alice Smith born</search><answer> Lyon</answer><|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # A tag never merges with neighbouring text: '</search>' stays one id right after a word.
    assert tok.convert_tokens_to_ids("</search>") in ids
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.eos_token_id != tok.pad_token_id
    assert len(tok) <= 400


def test_tokenizer_is_cached_and_reused(cache, monkeypatch):
    first = train_tokenizer(TEXTS, vocab_size=400)
    entries = list((cache / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded, not retrained")

    monkeypatch.setattr(tokenizer_module, "_train", no_training)
    second = train_tokenizer(TEXTS, vocab_size=400)
    assert second.get_vocab() == first.get_vocab()
    with pytest.raises(AssertionError, match="cached"):  # other settings ⇒ another cache entry
        train_tokenizer(TEXTS, vocab_size=420)


def test_tokenizer_rejects_bad_inputs(cache):
    with pytest.raises(ValueError, match="texts is empty"):
        train_tokenizer([])
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(TEXTS, vocab_size=100)


# --- presets and loading ---------------------------------------------------------------------

def test_random_presets_have_the_intended_sizes(cache):
    rng = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(letters[j] for j in torch.randint(0, 26, (7,), generator=rng).tolist())
             for _ in range(3000)]
    tok = train_tokenizer(TEXTS + [" ".join(words)] * 2, 1500)
    assert len(tok) == 1500
    counts = {name: count_parameters(build_random_model(MODEL_PRESETS[name].arch, tok))
              for name in ("tiny", "small", "base")}
    assert counts == {"tiny": 588_384, "small": 2_948_160, "base": 14_747_520}
    assert 0.4e6 < counts["tiny"] < 0.8e6 and 2e6 < counts["small"] < 4e6
    assert 10e6 < counts["base"] < 20e6


def test_random_init_depends_only_on_seed(tok):
    torch.manual_seed(123)
    before = torch.rand(1)
    a, b, c = _tiny(tok, seed=1), _tiny(tok, seed=1), _tiny(tok, seed=2)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # global RNG untouched by the init
    assert a.config.tie_word_embeddings and a.get_output_embeddings().weight is a.get_input_embeddings().weight


def test_unknown_preset_and_duplicate_registration_are_clear_errors(tok):
    with pytest.raises(ValueError, match="unknown model preset 'tinny'; valid: tiny, small, base"):
        load_model("tinny", tokenizer=tok)
    with pytest.raises(ValueError, match="already registered"):
        register_model_preset(ModelPreset("tiny", "random", {"hidden_size": 8}))
    with pytest.raises(ValueError, match="kind='nope'"):
        ModelPreset("x", "nope")
    with pytest.raises(ValueError, match="pass tokenizer= or texts="):
        load_model("tiny")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))


def test_load_random_preset_trains_tokenizer_from_texts(cache):
    model, tok = load_model("tiny", texts=TEXTS, vocab_size=400, device="cpu")
    assert model.dtype == torch.float32 == default_dtype("cpu")
    assert model.config.vocab_size == len(tok) and tags_are_single_tokens(tok)
    assert (cache / "tokenizers").is_dir()


def test_hub_path_loads_a_local_directory(tok, tmp_path):
    model = _tiny(tok)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, tok2 = load_model(str(tmp_path / "m"), device="cpu")
    ids = torch.tensor([tok.encode("Alice Smith was born in Lyon.")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert tok2.encode("<search> Lyon</search>") == tok.encode("<search> Lyon</search>")


def test_missing_local_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory .*nope does not exist"):
        load_model(str(tmp_path / "nope"), device="cpu")


def test_unreachable_hub_names_the_id_and_the_local_path_fix(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    with pytest.raises(OSError, match=r"'Qwen/Qwen2\.5-0\.5B-Instruct'.*model\.path=DIR"):
        load_model("qwen2_5_0_5b", device="cpu")


def test_gradient_checkpointing_gives_the_same_gradients(tok):
    ids = torch.tensor([tok.encode("Alice Smith was born in Lyon. Bob works at Acme.")])
    mask = torch.ones_like(ids, dtype=torch.bool)
    grads = []
    for ckpt in (False, True):
        model, _ = load_model("tiny", tokenizer=tok, device="cpu", gradient_checkpointing=ckpt)
        model.train()
        flag = getattr(model, "is_activation_checkpointing", None)
        assert (model.is_gradient_checkpointing if flag is None else flag) == ckpt
        policy_log_probs(model, ids, mask).sum().backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.slow
def test_smollm2_is_converted_once_then_reloaded(cache):
    model, tok = load_model("smollm2_135m", device="cpu")
    converted = list((cache / "models").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert "quantization_config" not in (converted[0] / "config.json").read_text()
    assert 130e6 < count_parameters(model) < 140e6 and model.dtype == torch.float32
    assert not tags_are_single_tokens(tok)  # the rollout engine must stop on text for it
    again, tok2 = load_model("smollm2_135m", device="cpu")
    assert list((cache / "models").iterdir()) == converted
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(again(ids).logits, logits)
    assert tok.decode(logits[0, -1].argmax()).strip() == "Paris"
    assert tok2.pad_token_id is not None


# --- log-probs, reference model ---------------------------------------------------------------

def _pad(rows, side, pad_id):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, sl], mask[i, sl] = torch.tensor(r), True
    return ids, mask


def test_policy_log_probs_match_per_row_forward_and_are_padding_invariant(tok):
    model = _tiny(tok)
    rows = [tok.encode(t) for t in ("Alice Smith was born in Lyon.", "Bob", "Paris is a city in France.")]
    ids_r, mask_r = _pad(rows, "right", tok.pad_token_id)
    ids_l, mask_l = _pad(rows, "left", tok.pad_token_id)
    with torch.no_grad():
        lp_r, ent_r = policy_log_probs(model, ids_r, mask_r, return_entropy=True)
        lp_l, ent_l = policy_log_probs(model, ids_l, mask_l, return_entropy=True)
        for i, r in enumerate(rows):
            logits = model(torch.tensor([r])).logits[0].float()  # (L, V), unpadded
            ref = torch.log_softmax(logits, -1)
            want = torch.cat([torch.zeros(1), ref[:-1].gather(1, torch.tensor(r[1:])[:, None])[:, 0]])
            want_ent = torch.cat([torch.zeros(1), -(ref.exp() * ref).sum(-1)[:-1]])
            n = len(r)
            torch.testing.assert_close(lp_r[i, :n], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(lp_l[i, -n:], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(ent_r[i, :n], want_ent, atol=1e-5, rtol=0)
            torch.testing.assert_close(ent_l[i, -n:], want_ent, atol=1e-5, rtol=0)
    assert (lp_r[~mask_r] == 0).all() and (lp_l[~mask_l] == 0).all() and (lp_r[:, 0] == 0).all()


def test_reference_model_is_a_frozen_copy(tok):
    model = _tiny(tok).train()
    ref = reference_model(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters()) and model.training
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(next(model.parameters()), next(ref.parameters()))


# --- critic ------------------------------------------------------------------------------------

def test_critic_values_at_t_depend_only_on_ids_before_t(tok):
    critic = ValueModel.from_policy(_tiny(tok)).eval()
    ids = torch.tensor([tok.encode("Alice Smith was born in Lyon. Bob works at Acme.")])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        v = critic.values(ids, mask)  # (1, T)
        for j in (3, 7, ids.shape[1] - 1):
            changed = ids.clone()
            changed[0, j] = (ids[0, j] + 1) % len(tok)
            w = critic.values(changed, mask)
            assert torch.equal(v[:, :j + 1], w[:, :j + 1])  # V(s_t), t ≤ j, sees ids[:t] only
            if j + 1 < ids.shape[1]:
                assert not torch.allclose(v[:, j + 1], w[:, j + 1])
    assert v[0, 0] == 0 and v.dtype == torch.float32


def test_critic_copies_the_policy_backbone_and_is_padding_invariant(tok):
    policy = _tiny(tok)
    critic = ValueModel.from_policy(policy).eval()
    fresh = ValueModel.from_policy(policy, init_from_policy=False)
    ids = torch.tensor([tok.encode("Bob works at Acme.")])
    with torch.no_grad():
        h_policy = policy.model(ids).last_hidden_state
        assert torch.equal(critic.backbone(ids).last_hidden_state, h_policy)
        assert not torch.allclose(fresh.backbone(ids).last_hidden_state, h_policy)
        v = critic.values(ids, torch.ones_like(ids, dtype=torch.bool))
        expected = critic.value_head(h_policy[:, :-1]).squeeze(-1)
        torch.testing.assert_close(v[:, 1:], expected)
        rows = [tok.encode("Alice was born in Lyon."), tok.encode("Bob")]
        vr = critic.values(*_pad(rows, "right", tok.pad_token_id))
        vl = critic.values(*_pad(rows, "left", tok.pad_token_id))
    for i, r in enumerate(rows):
        torch.testing.assert_close(vr[i, :len(r)], vl[i, -len(r):], atol=1e-6, rtol=0)
    assert vr[1, len(rows[1]):].abs().sum() == 0


def test_critic_save_load_round_trip(tok, tmp_path):
    critic = ValueModel.from_policy(_tiny(tok))
    with torch.no_grad():
        critic.value_head.bias.fill_(0.5)
    critic.save(tmp_path / "critic")
    loaded = ValueModel.load(tmp_path / "critic")
    ids = torch.tensor([tok.encode("Carol White was born in Berlin.")])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(loaded.values(ids, mask), critic.eval().values(ids, mask))
    with pytest.raises(FileNotFoundError, match="expected a directory written by ValueModel.save"):
        ValueModel.load(tmp_path / "missing")
