"""stppo.envs.single_turn: one generation per episode, ended by EOS or the token limit (not by
the tool tags), scored by a function of the completion text."""

import pytest
import torch

from stppo.envs.base import STOP_TAGS, Question
from stppo.envs.single_turn import SingleTurnEnv
from stppo.models import MODEL_PRESETS, build_random_model, train_tokenizer
from stppo.rollout import RolloutConfig, rollout

TEXTS = ["The cat sat on the mat. <answer> yes</answer> <search> cats</search>",
         "A dog ran in the park and the sun was out."] * 20


def vowels(question, text):
    letters = [c for c in text if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(1, len(letters))


def test_single_turn_env_judges_every_completion_as_the_answer():
    env = SingleTurnEnv(vowels)
    q = Question("0", "Say something.", ())
    assert env.prompt(q) == "Say something." and env.max_turns == 1 and env.stop_tags == ()
    (res,) = env.step_batch([q], ["aab <search> x</search>"], [0])
    assert res.kind == "answer" and res.done and res.answer == "aab <search> x</search>"
    assert env.score(q, "aab") == pytest.approx(2 / 3) and env.score(q, None) == 0.0
    with pytest.raises(ValueError, match="max_turns=2"):
        SingleTurnEnv(vowels, max_turns=2)


def test_rollout_runs_one_turn_to_eos_or_the_limit_through_tags(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    tok = train_tokenizer(TEXTS, vocab_size=300)
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()
    questions = [Question(str(i), f"Prompt number {i}:", ()) for i in range(8) for _ in range(4)]
    env = SingleTurnEnv(vowels)
    batch = rollout(model, tok, env, questions, RolloutConfig(max_new_tokens=30),
                    generator=torch.Generator().manual_seed(0))
    tags = set(tok.convert_tokens_to_ids(list(STOP_TAGS)))
    assert batch.num_turns.tolist() == [1] * 32 and batch.finished.all()
    assert batch.group_ids.tolist() == [i // 4 for i in range(32)]
    through_tags = 0
    for i in range(32):
        ids = batch.input_ids[i][batch.loss_mask[i]].tolist()
        assert len(ids) == 30 or ids[-1] == tok.eos_token_id
        through_tags += any(t in tags for t in ids[:-1])
        text = batch.meta["actions"][i][0]
        assert text == tok.decode(ids, skip_special_tokens=False)
        assert batch.scores[i].item() == pytest.approx(vowels(questions[i], text))
    assert through_tags > 0  # a tag was sampled and the turn went on
