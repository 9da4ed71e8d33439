"""The oracle on synthetic_multihop: retrieval recall of its queries, scores through the env."""

import pytest

from stppo.envs import SearchEnv, build_task, run_oracle, tokenizer_texts
from stppo.envs.actions import INVALID_ACTION_OBSERVATION, parse_action
from stppo.envs.oracle import oracle_actions
from stppo.envs.retrievers import BM25Retriever


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("STPPO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    task = build_task("synthetic_multihop")
    retriever = BM25Retriever(task.corpus)
    yield task, retriever
    mp.undo()


def test_oracle_queries_hit_the_gold_document_at_rank_1(world):
    task, retriever = world
    hops = [h for s in task.splits for q in task.split(s) for h in q.meta["plan"]]
    top = retriever.retrieve([query for query, _, _ in hops], 1)
    recall = sum(docs[0].id == gold for docs, (_, gold, _) in zip(top, hops)) / len(hops)
    entity_only = retriever.retrieve([query.rsplit(" ", 1)[0] for query, _, _ in hops], 2)
    recall_e2 = sum(gold in [d.id for d in docs] for docs, (_, gold, _) in zip(entity_only, hops))
    print(f"oracle query rank-1 recall (bm25, {len(hops)} hops): {recall:.4f}; "
          f"entity-only top-2 recall: {recall_e2 / len(hops):.4f}")
    assert recall >= 0.95


def test_oracle_without_errors_scores_one_and_follows_the_plan(world):
    task, retriever = world
    env = SearchEnv.for_task(task, retriever, max_turns=4, topk=2, prompt_style="compact")
    qs = task.split("val")
    episodes = run_oracle(env, task, qs, error_rate=0.0)
    assert [e.score for e in episodes] == [1.0] * len(qs)
    for ep in episodes:
        plan = ep.question.meta["plan"]
        assert ep.prompt == env.prompt(ep.question)
        assert len(ep.turns) == len(plan) + 1
        for (action, res), (query, _, answer) in zip(ep.turns, plan):
            assert action == f"<search> {query}</search>" and res.query == query
            assert answer in res.observation  # the observation is the real retriever's
        action, res = ep.turns[-1]
        assert action == f"<answer> {ep.question.golden_answers[0]}</answer>" and res.done
        assert ep.answer == ep.question.golden_answers[0]


def test_oracle_error_rate(world):
    task, retriever = world
    env = SearchEnv.for_task(task, retriever, max_turns=4, topk=2)
    qs = task.split("train") + task.split("val")
    episodes = run_oracle(env, task, qs, error_rate=0.3, seed=7)
    success = sum(e.score for e in episodes) / len(episodes)
    print(f"oracle p=0.3 success over {len(qs)} questions: {success:.3f}")
    assert 0.62 <= success <= 0.78  # 1 - p within ±3.5 standard errors
    wrong = [e for e in episodes if e.score == 0]
    assert all(e.turns[-1][1].kind == "answer" for e in wrong)  # mistakes, not unfinished episodes
    wrong_query = [e for e in wrong if any(a != f"<search> {p[0]}</search>"
                                           for (a, _), p in zip(e.turns, e.question.meta["plan"]))]
    assert 0 < len(wrong_query) < len(wrong)  # both kinds of mistakes occur
    again = run_oracle(env, task, qs[::-1], error_rate=0.3, seed=7)[::-1]
    assert [[a for a, _ in e.turns] for e in again] == [[a for a, _ in e.turns] for e in episodes]


def test_oracle_needs_enough_turns_and_a_world(world):
    task, retriever = world
    short = SearchEnv.for_task(task, retriever, max_turns=2)
    three_hop = [q for q in task.split("val") if q.meta["hops"] == 3][:1]
    with pytest.raises(ValueError, match="needs 4 turns but env max_turns=2"):
        run_oracle(short, task, three_hop)
    from stppo.envs.base import Task
    with pytest.raises(ValueError, match="synthetic_multihop"):
        run_oracle(short, Task("x", task.corpus, {}), three_hop)


def test_tokenizer_texts_cover_corpus_prompts_and_actions(world):
    task, retriever = world
    env = SearchEnv.for_task(task, retriever, prompt_style="compact")
    texts = list(tokenizer_texts(task, env))
    joined = "\n".join(texts)
    assert INVALID_ACTION_OBSERVATION in texts
    assert all(d.text in joined for d in task.corpus[:50])
    q = task.split("test")[0]
    assert env.prompt(q) in texts
    for action in oracle_actions(q, task.world):
        assert action in texts and parse_action(action)[0] in ("search", "answer")
    assert len(list(tokenizer_texts(task))) > len(texts)  # both prompt styles without an env
