"""stppo.rollout: episode layout, sampling, and the multi-turn engine on a deterministic test env
with real tiny models (random-init, and briefly trained on the test env's episodes)."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from stppo.envs.actions import parse_action
from stppo.envs.base import Question, StepResult
from stppo.models import MODEL_PRESETS, build_random_model, policy_log_probs, train_tokenizer
from stppo.rollout import (RolloutConfig, collate_episodes, encode_episode, rollout, sample_next,
                           top_p_filter)
from stppo.rollout import engine as engine_module

PEOPLE = {"Alice": "Lyon", "Bob": "Paris", "Carol": "Berlin", "Dan": "Rome"}
QUESTIONS = [Question(n, f"where was {n} born?", (c,)) for n, c in PEOPLE.items()]


class PeopleEnv:
    """A deterministic AgentEnv: '<search> NAME …</search>' → that person's birthplace."""

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns
        self.calls = []  # (question ids, actions, turns) of every step_batch call

    def prompt(self, q):
        return f"Question: {q.question}\n"

    @staticmethod
    def fact(name):
        return f"\n<information> {name} was born in {PEOPLE.get(name, 'Nowhere')}.</information>\n"

    def step_batch(self, questions, actions, turns):
        self.calls.append(([q.id for q in questions], list(actions), list(turns)))
        out = []
        for a in actions:
            kind, content = parse_action(a)
            if kind == "answer":
                out.append(StepResult("answer", "", True, answer=content))
            elif kind == "search":
                name = content.split()[0] if content else ""
                out.append(StepResult("search", self.fact(name), False, query=content))
            else:
                out.append(StepResult("invalid", "\nInvalid action.\n", False))
        return out

    def score(self, q, answer):
        return float(answer is not None and answer.strip() in q.golden_answers)


def episode(name):
    env = PeopleEnv()
    city = PEOPLE[name]
    return (env.prompt(QUESTIONS[list(PEOPLE).index(name)]),
            [(f"<search> {name} born</search>", StepResult("search", env.fact(name), False)),
             (f"<answer> {city}</answer>", StepResult("answer", "", True, answer=city))])


EPISODES = [episode(n) for n in PEOPLE]
TEXTS = [p + "".join(a + r.observation for a, r in turns) for p, turns in EPISODES] * 5


def sft(model, tok, steps=80):
    """The warm start in miniature: maximise log π of the episodes' action tokens."""
    batch = collate_episodes(tok, EPISODES)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        lp = policy_log_probs(model, batch.input_ids, batch.attention_mask)
        loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def text_tag_tokenizer():
    """A byte-level BPE whose tags are ordinary multi-token text (like SmolLM2's / Qwen's)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|pad|>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def random_model(tok):
    return build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()


@pytest.fixture(scope="module")
def trained(tok):
    torch.manual_seed(0)
    return sft(build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0), tok)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def agent_ids(batch, i, k):
    """Row i's ids of turn k, read from the batch layout."""
    return batch.input_ids[i][batch.turn_ids[i] == k].tolist()


# --- episode layout ----------------------------------------------------------------------------

def test_encode_episode_masks_prompt_and_observations(tok):
    prompt, turns = EPISODES[0]
    enc = encode_episode(tok, prompt, turns)
    ids, loss, turn = enc["input_ids"], enc["loss_mask"], enc["turn_ids"]
    n_prompt = len(tok.encode(prompt, add_special_tokens=False))
    assert not loss[:n_prompt].any() and (turn[:n_prompt] == -1).all()
    assert torch.equal(loss, turn >= 0)
    for k, (action, _) in enumerate(turns):  # each action's tokens carry its turn id, in order
        assert tok.decode(ids[turn == k]) == action
    obs = tok.decode(ids[~loss][n_prompt:], skip_special_tokens=False)
    assert obs == turns[0][1].observation  # the last turn's (empty) observation is not appended
    assert tok.decode(ids, skip_special_tokens=False) == TEXTS[0]


def test_collate_episodes_right_pads_and_counts(tok):
    batch = collate_episodes(tok, EPISODES + [("Question: hi\n", [("junk", "\nInvalid.\n"),
                                                                  ("<answer> x</answer>", "")])])
    for i, (prompt, turns) in enumerate(EPISODES):
        enc = encode_episode(tok, prompt, turns)
        n = len(enc["input_ids"])
        assert torch.equal(batch.input_ids[i, :n], enc["input_ids"])
        assert torch.equal(batch.loss_mask[i, :n], enc["loss_mask"])
        assert torch.equal(batch.turn_ids[i, :n], enc["turn_ids"])
        assert batch.attention_mask[i, :n].all() and not batch.attention_mask[i, n:].any()
        assert not batch.loss_mask[i, n:].any() and (batch.turn_ids[i, n:] == -1).all()
    assert batch.num_turns.tolist() == [2, 2, 2, 2, 2]
    assert batch.num_searches.tolist() == [1, 1, 1, 1, 0]  # string observations are not judged
    assert batch.finished.tolist() == [True] * 4 + [False]
    assert batch.group_ids.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(batch.response_length, batch.loss_mask.sum(1))
    assert batch.meta["answers"][:4] == list(PEOPLE.values())


# --- sampling ----------------------------------------------------------------------------------

def test_sampling_greedy_top_p_and_raw_log_probs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    raw = torch.log_softmax(logits[0], -1)
    tok, lp = sample_next(logits, RolloutConfig(greedy=True))
    assert (tok == 0).all() and torch.allclose(lp, raw[0].expand(4000))
    kept = top_p_filter(logits[:1], 0.7)  # mass before token 2 is 0.8 ≥ 0.7 ⇒ tokens 0, 1 kept
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    tok, lp = sample_next(logits, RolloutConfig(top_p=0.7, temperature=0.5), gen(0))
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp, raw[tok])  # the untempered, unfiltered log-prob
    tok, _ = sample_next(logits, RolloutConfig(), gen(0))
    freq = torch.bincount(tok, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("max_total_tokens", 1),
                                         ("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.5)])
def test_rollout_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"rollout.{field}="):
        RolloutConfig(**{field: value})


# --- the engine ----------------------------------------------------------------------------------

def test_random_model_rollout_layout_matches_generation_exactly(tok, random_model, monkeypatch):
    recorded = []  # (new-token chunks, outputs) of every generation call, as produced

    def spy(model, seqs, *args, **kwargs):
        outs = real(model, seqs, *args, **kwargs)
        recorded.append(([list(s) for s in seqs], outs))
        return outs

    real = engine_module.generate_turn
    monkeypatch.setattr(engine_module, "generate_turn", spy)
    env = PeopleEnv(max_turns=3)
    cfg = RolloutConfig(max_new_tokens=12, max_total_tokens=200)
    batch = rollout(random_model, tok, env, QUESTIONS * 2, cfg, generator=gen(0))
    n = len(batch)
    assert len(recorded) == 3 and batch.num_turns.max() == 3
    re_encoded_differs = False
    for k, (chunks, outs) in enumerate(recorded):
        rows = [i for i in range(n) if batch.num_turns[i] > k]  # active rows, in order
        assert len(rows) == len(outs) and env.calls[k][2] == [k] * len(rows)
        for i, chunk, out in zip(rows, chunks, outs):
            assert agent_ids(batch, i, k) == out.ids  # sampled ids kept exactly
            pos = (batch.turn_ids[i] == k).nonzero()[:, 0]
            start = int(pos[0])
            assert pos.tolist() == list(range(start, start + len(out.ids)))
            # The context fed before turn k: the prompt, later the previous turn's last sampled
            # token (not yet in the KV cache) and the observation.
            assert batch.input_ids[i, start - len(chunk):start].tolist() == chunk
            if k == 0:
                assert len(chunk) == start
            else:
                assert batch.turn_ids[i, start - len(chunk)] == k - 1
                assert not batch.loss_mask[i, start - len(chunk) + 1:start].any()
            assert batch.rollout_log_probs[i, pos].tolist() == out.log_probs
            text = tok.decode(out.ids, skip_special_tokens=False)
            assert batch.meta["actions"][i][k] == text and text in env.calls[k][1]
            re_encoded_differs |= tok.encode(text, add_special_tokens=False) != out.ids
            assert 1 <= len(out.ids) <= cfg.max_new_tokens
    assert re_encoded_differs  # so the equality above could not hold for re-encoded text
    assert torch.equal(batch.loss_mask, batch.turn_ids >= 0)
    assert not (batch.loss_mask & ~batch.attention_mask).any()
    assert (batch.rollout_log_probs[~batch.loss_mask] == 0).all()
    assert torch.equal(batch.response_length, batch.loss_mask.sum(1))
    assert batch.group_ids.tolist() == [0, 1, 2, 3] * 2  # same question ⇒ same group
    assert (batch.num_valid + batch.num_invalid == batch.num_turns).all()


def test_rollout_log_probs_equal_a_fresh_forward(tok, random_model, trained):
    for model, cfg in ((random_model, RolloutConfig(max_new_tokens=10, max_total_tokens=120)),
                       (trained, RolloutConfig(max_new_tokens=12, temperature=0.7, top_p=0.9))):
        batch = rollout(model, tok, PeopleEnv(), QUESTIONS * 3, cfg, generator=gen(1))
        assert batch.num_turns.min() >= 2  # several turns, observations in between
        with torch.no_grad():
            fresh = policy_log_probs(model, batch.input_ids, batch.attention_mask)
        delta = (fresh - batch.rollout_log_probs)[batch.loss_mask]
        assert delta.abs().max() < 1e-4


def test_same_seed_same_rollout_other_seed_differs(tok, random_model):
    cfg = RolloutConfig(max_new_tokens=8, max_total_tokens=100)
    a, b, c = (rollout(random_model, tok, PeopleEnv(), QUESTIONS, cfg, generator=gen(s))
               for s in (5, 5, 6))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
    assert a.input_ids.shape != c.input_ids.shape or not torch.equal(a.input_ids, c.input_ids)


def test_trained_model_stops_on_tag_ids_and_gets_observations(tok, trained):
    env = PeopleEnv(max_turns=3)
    batch = rollout(trained, tok, env, QUESTIONS, RolloutConfig(max_new_tokens=12, greedy=True))
    search_id, answer_id = tok.convert_tokens_to_ids(["</search>", "</answer>"])
    assert batch.scores.tolist() == [1.0] * 4 and batch.finished.all()
    assert batch.num_turns.tolist() == [2] * 4 and batch.num_searches.tolist() == [1] * 4
    for i, name in enumerate(PEOPLE):
        assert agent_ids(batch, i, 0)[-1] == search_id and agent_ids(batch, i, 1)[-1] == answer_id
        assert batch.meta["actions"][i] == [f"<search> {name} born</search>", f"<answer> {PEOPLE[name]}</answer>"]
        obs = tok.decode(batch.input_ids[i][~batch.loss_mask[i] & batch.attention_mask[i]],
                         skip_special_tokens=False)
        assert obs == env.prompt(QUESTIONS[i]) + env.fact(name)
    assert batch.meta["answers"] == list(PEOPLE.values())


def test_per_turn_limit_and_max_turns(tok, random_model, trained):
    batch = rollout(random_model, tok, PeopleEnv(max_turns=2), QUESTIONS, RolloutConfig(
        max_new_tokens=5, max_total_tokens=200), generator=gen(0))
    assert batch.num_turns.max() == 2
    for i in range(len(batch)):
        for k in range(int(batch.num_turns[i])):
            ids = agent_ids(batch, i, k)
            assert 1 <= len(ids) <= 5
    # The trained model needs 5 tokens for '<search> Alice born</search>': with 3 it is cut off,
    # every turn is invalid, and the episode ends after max_turns without an answer.
    batch = rollout(trained, tok, PeopleEnv(max_turns=3), QUESTIONS, RolloutConfig(
        max_new_tokens=3, greedy=True))
    assert batch.num_turns.tolist() == [3] * 4 and batch.num_invalid.tolist() == [3] * 4
    assert not batch.finished.any() and batch.scores.sum() == 0
    assert all(len(agent_ids(batch, i, k)) == 3 for i in range(4) for k in range(3))


def test_total_length_truncation_scores_zero(tok, trained):
    env, cfg = PeopleEnv(), RolloutConfig(max_new_tokens=12, greedy=True)
    full = rollout(trained, tok, env, QUESTIONS[:1], cfg)
    assert full.scores.tolist() == [1.0]
    length = int(full.attention_mask.sum())
    n_answer = len(agent_ids(full, 0, 1))
    # (a) the answer turn is cut by the limit; (b) the observation does not fit.
    obs_end = length - n_answer
    for limit in (length - 1, obs_end - 2):
        cut = rollout(trained, tok, env, QUESTIONS[:1], RolloutConfig(
            max_new_tokens=12, max_total_tokens=limit, greedy=True))
        assert cut.truncated.tolist() == [True] and cut.scores.tolist() == [0.0]
        assert not cut.finished.any() and int(cut.attention_mask.sum()) == limit
        assert torch.equal(cut.input_ids[0, :limit], full.input_ids[0, :limit])
    with pytest.raises(ValueError, match="max_total_tokens=5 leaves no room"):
        rollout(trained, tok, env, QUESTIONS[:1], RolloutConfig(max_total_tokens=5))


def test_multi_token_tags_stop_on_text():
    ttok = text_tag_tokenizer()
    assert len(ttok.encode("</search>", add_special_tokens=False)) > 1
    torch.manual_seed(0)
    model = sft(build_random_model(MODEL_PRESETS["tiny"].arch, ttok, seed=0), ttok)
    env = PeopleEnv(max_turns=3)
    batch = rollout(model, ttok, env, QUESTIONS, RolloutConfig(max_new_tokens=20, greedy=True))
    assert batch.finished.all() and batch.scores.tolist() == [1.0] * 4
    for i, name in enumerate(PEOPLE):  # each turn ends the token the tag is complete
        search, answer = batch.meta["actions"][i]
        assert search == f"<search> {name} born</search>"
        assert answer == f"<answer> {PEOPLE[name]}</answer>"
        assert len(agent_ids(batch, i, 0)) < 20
