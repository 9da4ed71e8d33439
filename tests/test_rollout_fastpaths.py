"""The rollout engine's fast paths change nothing a user sees: the 4-D masks it hands the model
are the ones transformers builds, the shared prefill of a group's prompt samples the same ids,
the stop-text filter stops where checking every step does, the batch is an ordinary tensor."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.masking_utils import create_causal_mask

from stppo.envs.base import STOP_TAGS, Question
from stppo.models import MODEL_PRESETS, build_random_model, policy_log_probs, train_tokenizer
from stppo.rollout import RolloutConfig, StopChecker, rollout
from stppo.rollout import engine as engine_module
from stppo.rollout.episodes import encode_text, encode_texts
from stppo.rollout.kvcache import GrowingLayer, cache_kwarg, stack_row_caches
from echo_env import EchoEnv

TEXTS = ["Question: where was Alice born?\n<search> Alice born</search>\n<information> Alice was "
         "born in Lyon.</information>\n<answer> Lyon</answer>",
         "Question: where was Bob born?\n<search> Bob born</search>\n<information> Bob was born "
         "in Paris.</information>\n<answer> Paris</answer>"] * 10


ENV = EchoEnv(observation="\n<information> Bob was born in Paris.</information>\n")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    return build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()


def _cache(model, lengths, g):
    """Row caches of the given lengths (None for 0) with random keys/values."""
    h = model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    return [None if n == 0 else [(torch.randn(h, n, d, generator=g), torch.randn(h, n, d, generator=g))
                                 for _ in range(model.config.num_hidden_layers)] for n in lengths]


@pytest.mark.parametrize("lengths, chunk_lens", [
    ([5, 9, 7], [4, 4, 2]),  # padded cache and padded chunk
    ([6, 6, 6], [3, 3, 3]),  # no padding at all, several new tokens
    ([5, 9, 7], [1, 1, 1]),  # one new token over a padded cache
    ([6, 6, 6], [1, 1, 1]),  # one new token, no padding: transformers passes no mask
])
def test_handed_over_masks_are_the_ones_transformers_builds(model, lengths, chunk_lens):
    assert model.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(0)
    past, held = stack_row_caches(model, _cache(model, lengths, g), torch.device("cpu"), room=8)
    c0, width = held.shape[1], max(chunk_lens)
    mask = torch.zeros(len(lengths), c0 + width + 2, dtype=torch.bool)
    mask[:, :c0] = held
    for r, n in enumerate(chunk_lens):
        mask[r, c0 + width - n:c0 + width] = True
    embeds = torch.zeros(len(lengths), width, model.config.hidden_size)
    two_d = mask[:, :c0 + width].long()
    pos = (two_d.cumsum(-1) - 1).clamp(min=0)[:, -width:]
    theirs = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=two_d,
                                position_ids=pos, **{cache_kwarg(create_causal_mask): past})
    ours = engine_module._prefill_mask(mask, c0, width, True)
    assert (theirs is None) == (ours is None)
    if theirs is not None:
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    if width == 1:  # a decoding step is the same case
        step = engine_module._step_mask(mask, c0 + 1, True)
        assert (step is None) == (theirs is None) and (step is None or torch.equal(step, theirs))


def test_handed_over_masks_change_no_number(tok, model, monkeypatch):
    questions = [Question(str(i), f"where was person {i} born?", ("Lyon",)) for i in range(6)]
    cfg = RolloutConfig(max_new_tokens=8, max_total_tokens=200)
    # Both runs prefill through the forward: the lean prefill's last-layer trim rounds the turn's
    # first logits differently (~1e-7, tests/test_rollout_leanstep.py); only the masks differ here.
    monkeypatch.setattr(engine_module.ModelSteps, "prefill",
                        lambda self, ids, pos, mask, past: self.forward(ids, pos, mask, past,
                                                                        logits_to_keep=1))
    fast = rollout(model, tok, ENV, questions, cfg, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(engine_module, "_prefill_mask", lambda mask, c0, w, _: mask[:, :c0 + w])
    monkeypatch.setattr(engine_module, "_step_mask", lambda mask, n, _: mask[:, :n])
    plain = rollout(model, tok, ENV, questions, cfg, generator=torch.Generator().manual_seed(1))
    assert fast.num_turns.tolist() == [3] * 6
    assert torch.equal(fast.input_ids, plain.input_ids)
    assert torch.equal(fast.rollout_log_probs, plain.rollout_log_probs)


def test_a_groups_prompt_is_prefilled_once_and_samples_the_same(tok, model, monkeypatch):
    questions = [Question(str(i), f"where was person {i} born?", ("Lyon",))
                 for i in range(4) for _ in range(4)]
    cfg = RolloutConfig(max_new_tokens=8, max_total_tokens=200)
    widths = []
    real = model.forward

    def spy(*args, **kwargs):
        cache = kwargs[cache_kwarg(type(model).forward)]
        if kwargs["input_ids"].shape[1] > 1 and cache.get_seq_length() == 0:
            widths.append(kwargs["input_ids"].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    shared = rollout(model, tok, ENV, questions, cfg, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(engine_module, "_shared_prompts", lambda chunks, caches: None)
    each = rollout(model, tok, ENV, questions, cfg, generator=torch.Generator().manual_seed(2))
    assert widths == [4, 16]  # the first prefill ran on the 4 distinct prompts
    assert torch.equal(shared.input_ids, each.input_ids)
    torch.testing.assert_close(shared.rollout_log_probs, each.rollout_log_probs, atol=1e-5, rtol=0)
    assert not torch.equal(shared.input_ids[0], shared.input_ids[1])  # samples still differ


def byte_level_tokenizer():
    """A byte-level BPE whose tags are multi-token text (like SmolLM2's / Qwen's)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<|pad|>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", clean_up_tokenization_spaces=False)


def test_stop_text_filter_stops_where_checking_every_step_does():
    ttok = byte_level_tokenizer()
    stop = StopChecker(ttok, [ttok.eos_token_id])
    assert not stop.by_token_id
    ends = stop.may_end_text(torch.arange(len(ttok)))
    assert ends.tolist() == [">" in ttok.decode([i]) for i in range(len(ttok))]
    assert stop.may_end_text(torch.tensor([len(ttok) + 5])).tolist() == [True]  # unknown: check
    rng = random.Random(0)
    pieces = ["</search>", "</answer>", " Alice", " born", "<", "/", "search", ">", " in", "\n"]
    stopped = 0
    for _ in range(300):
        ids = encode_text(ttok, "".join(rng.choice(pieces) for _ in range(12)))
        ids = [rng.randrange(len(ttok)) if rng.random() < 0.2 else i for i in ids]
        every = next((s for s in range(len(ids)) if stop.text_hit(ids[:s + 1])), None)
        filtered = next((s for s in range(len(ids)) if stop.may_end_text(torch.tensor(ids[s:s + 1]))[0]
                         and stop.text_hit(ids[:s + 1])), None)
        assert filtered == every
        stopped += every is not None
    assert 50 < stopped < 300  # both kinds of sequences were seen


def test_no_stop_tags_stop_only_at_eos(tok):
    stop = StopChecker(tok, [tok.eos_token_id], stop_tags=())
    ids = torch.tensor(tok.convert_tokens_to_ids(list(STOP_TAGS)) + [tok.eos_token_id])
    assert stop.hits(ids).tolist() == [False] * len(STOP_TAGS) + [True]
    assert not stop.text_hit(ids.tolist())


def test_rollout_batch_is_an_ordinary_tensor_for_the_update(tok, model):
    questions = [Question(str(i), f"where was person {i} born?", ("Lyon",)) for i in range(3)]
    batch = rollout(model, tok, ENV, questions, RolloutConfig(max_new_tokens=5),
                    generator=torch.Generator().manual_seed(0))
    assert not batch.input_ids.is_inference() and not batch.rollout_log_probs.is_inference()
    model.train()
    lp = policy_log_probs(model, batch.input_ids, batch.attention_mask)
    (lp - batch.rollout_log_probs).exp().mul(batch.loss_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def test_encode_texts_is_encode_text_of_each(tok):
    texts = ["\n<information> Bob was born in Paris.</information>\n", "", "Lyon", ""]
    assert encode_texts(tok, texts) == [encode_text(tok, t) for t in texts]
    assert encode_texts(tok, []) == []


def test_layer_over_preallocated_buffers_appends_in_place():
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    kbuf, vbuf = torch.empty(2, 3, 9, 4), torch.empty(2, 3, 9, 4)
    kbuf[:, :, :5], vbuf[:, :, :5] = k0, v0
    layer = GrowingLayer.over(kbuf, vbuf, 5)
    k1, v1 = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    keys, values = layer.update(k1, v1)
    assert keys.data_ptr() == kbuf.data_ptr()  # no copy: the room was there
    assert torch.equal(keys, torch.cat([k0, k1], dim=2)) and torch.equal(values, torch.cat([v0, v1], dim=2))
    keys, _ = layer.update(k1[:, :, :1], v1[:, :, :1])  # past the room: grows, keeps the contents
    assert keys.shape[2] == 10 and torch.equal(keys[:, :, :9], torch.cat([k0, k1], dim=2))
