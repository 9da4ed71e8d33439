"""The rollout engine with the real agent environment: SearchEnv + bm25 over a small synthetic
world, a tokenizer trained on the task's texts, and a real tiny Qwen2 model."""

import pytest
import torch

from stppo.envs import BM25Retriever, SearchEnv, build_synthetic_task, run_oracle, tokenizer_texts
from stppo.models import MODEL_PRESETS, build_random_model, policy_log_probs, train_tokenizer
from stppo.rollout import RolloutConfig, collate_episodes, rollout

WORLD = dict(n_people=40, n_cities=12, n_countries=4, n_orgs=10, n_distractors=40,
             n_sft=4, n_train=8, n_val=0, n_test=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        task = build_synthetic_task(**WORLD)
        env = SearchEnv.for_task(task, BM25Retriever(task.corpus), max_turns=4, topk=2,
                                 prompt_style="compact")
        tok = train_tokenizer(tokenizer_texts(task, env), vocab_size=1500)
    return task, env, tok


def test_oracle_episodes_collate_to_the_rollout_layout(setup):
    task, env, tok = setup
    episodes = run_oracle(env, task, task.split("sft"))
    batch = collate_episodes(tok, episodes, scores=[e.score for e in episodes])
    for i, ep in enumerate(episodes):
        ids, loss, turn = batch.input_ids[i], batch.loss_mask[i], batch.turn_ids[i]
        assert [tok.decode(ids[turn == k], skip_special_tokens=False)
                for k in range(len(ep.turns))] == [a for a, _ in ep.turns]
        context = ids[~loss & batch.attention_mask[i]]
        expected = ep.prompt + "".join(r.observation for _, r in ep.turns[:-1])
        assert tok.decode(context, skip_special_tokens=False) == expected
    assert batch.num_searches.tolist() == [len(e.turns) - 1 for e in episodes]
    assert batch.finished.all() and batch.scores.tolist() == [1.0] * len(episodes)


def test_random_model_through_search_env(setup):
    task, env, tok = setup
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).eval()
    questions = task.split("train")[:4] * 2
    batch = rollout(model, tok, env, questions, RolloutConfig(max_new_tokens=16, max_total_tokens=400),
                    generator=torch.Generator().manual_seed(0))
    assert (batch.num_turns <= env.max_turns).all()
    assert (batch.num_turns == env.max_turns).any() or batch.finished.any()
    assert batch.group_ids.tolist() == [0, 1, 2, 3] * 2
    assert batch.meta["question_ids"] == [q.id for q in questions]
    with torch.no_grad():
        fresh = policy_log_probs(model, batch.input_ids, batch.attention_mask)
    assert (fresh - batch.rollout_log_probs)[batch.loss_mask].abs().max() < 1e-4


def test_a_model_trained_on_oracle_episodes_replays_them_token_for_token(setup):
    """Warm-start data (collate_episodes) and rollouts (rollout) share one layout: a model that
    memorised the oracle's episodes regenerates exactly the collated batch, greedily."""
    task, env, tok = setup
    episodes = run_oracle(env, task, task.split("sft"))
    target = collate_episodes(tok, episodes)
    torch.manual_seed(0)
    model = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    for _ in range(200):
        lp = policy_log_probs(model, target.input_ids, target.attention_mask)
        loss = -(lp * target.loss_mask).sum() / target.loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.03:
            break
    model.eval()
    batch = rollout(model, tok, env, task.split("sft"),
                    RolloutConfig(max_new_tokens=24, max_total_tokens=512, greedy=True))
    assert batch.meta["actions"] == [[a for a, _ in e.turns] for e in episodes]
    for name in ("input_ids", "attention_mask", "loss_mask", "turn_ids"):
        assert torch.equal(getattr(batch, name), getattr(target, name)), name
    assert batch.scores.tolist() == [e.score for e in episodes] == [1.0] * len(episodes)
