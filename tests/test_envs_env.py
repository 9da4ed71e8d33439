"""SearchEnv: step semantics, one retriever call per turn, last-turn rule, scoring."""

import pytest

from stppo.envs import SearchEnv, build_task
from stppo.envs.actions import INVALID_ACTION_OBSERVATION, format_information
from stppo.envs.base import AgentEnv, Question, Task
from stppo.envs.retrievers import BM25Retriever


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))


class CountingBM25(BM25Retriever):
    """The real bm25 retriever, recording each call's queries."""

    def __init__(self, corpus):
        super().__init__(corpus)
        self.calls = []

    def retrieve(self, queries, topk):
        self.calls.append((list(queries), topk))
        return super().retrieve(queries, topk)


@pytest.fixture
def setup():
    task = build_task("synthetic_multihop", n_sft=5, n_train=5, n_val=20, n_test=5)
    retriever = CountingBM25(task.corpus)
    env = SearchEnv.for_task(task, retriever, max_turns=3, topk=2, prompt_style="compact")
    return task, retriever, env


def test_search_env_satisfies_the_protocol(setup):
    _, _, env = setup
    assert isinstance(env.max_turns, int)
    assert all(callable(getattr(env, m)) for m in ("prompt", "step_batch", "score"))
    _protocol: AgentEnv = env  # static contract: SearchEnv is an AgentEnv


def test_step_batch_kinds_and_single_retriever_call(setup):
    task, retriever, env = setup
    qs = task.split("val")[:5]
    plan0 = qs[0].meta["plan"][0]
    actions = [f"<search> {plan0[0]}</search>", "<answer> Foo</answer>", "gibberish",
               "<think>hm</think><search>x born</search>", "<search>unclosed"]
    res = env.step_batch(qs, actions, [0, 0, 0, 1, 0])
    assert len(retriever.calls) == 1  # all searches of the turn in one call
    assert retriever.calls[0] == ([plan0[0], "x born"], 2)
    assert [r.kind for r in res] == ["search", "answer", "invalid", "search", "invalid"]
    assert res[0].query == plan0[0] and not res[0].done
    expected = format_information(BM25Retriever(task.corpus).retrieve([plan0[0]], 2)[0])
    assert res[0].observation == expected
    assert f"Doc 1(Title: \"{qs[0].meta['subject']}\")" in res[0].observation
    assert plan0[2] in res[0].observation  # the gold doc's fact is shown
    assert res[1] .answer == "Foo" and res[1].done and res[1].observation == ""
    assert res[2].observation == INVALID_ACTION_OBSERVATION and not res[2].done
    assert res[4].observation == INVALID_ACTION_OBSERVATION


def test_last_turn_ends_the_episode_without_searching(setup):
    task, retriever, env = setup
    qs = task.split("val")[:3]
    res = env.step_batch(qs, ["<search>a born</search>", "junk", "<answer>x</answer>"], [2, 2, 2])
    assert retriever.calls == []
    assert [(r.kind, r.done, r.observation) for r in res] == [
        ("search", True, ""), ("invalid", True, ""), ("answer", True, "")]
    assert env.step_batch([], [], []) == [] and retriever.calls == []


def test_step_batch_rejects_bad_arguments(setup):
    task, _, env = setup
    q = task.split("val")[0]
    with pytest.raises(ValueError, match="same length"):
        env.step_batch([q], ["a", "b"], [0])
    with pytest.raises(ValueError, match="turns must be in"):
        env.step_batch([q], ["a"], [3])


def test_score_reads_only_the_answer(setup):
    task, _, env = setup
    q = task.split("val")[0]
    gold = q.golden_answers[0]
    assert env.score(q, gold) == 1.0
    assert env.score(q, f"the {gold.upper()}.") == 1.0
    assert env.score(q, None) == 0.0
    assert env.score(q, q.question) == 0.0
    mcq = Task("m", [], {"val": []}, reward="mcq")
    env2 = SearchEnv.for_task(mcq, env.retriever)
    mq = Question("1", "Which?", ("B",), meta={"options": {"A": "x", "B": "y"}})
    assert env2.score(mq, "(B)") == 1.0 and env2.score(mq, "y") == 1.0 and env2.score(mq, "A") == 0.0


def test_settings_are_validated(setup):
    _, retriever, _ = setup
    with pytest.raises(ValueError, match="max_turns"):
        SearchEnv(retriever, max_turns=0)
    with pytest.raises(ValueError, match="topk"):
        SearchEnv(retriever, topk=0)
    with pytest.raises(ValueError, match="allowed: search_r1, chat, instruct, compact"):
        SearchEnv(retriever, prompt_style="nope")
    chat = SearchEnv(retriever, prompt_style="chat")  # the tokenizer may come later
    with pytest.raises(ValueError, match="chat_template"):
        chat.prompt(Question("q", "who?", ("x",)))
    with pytest.raises(ValueError, match="reward"):
        SearchEnv(retriever, reward="f1")
