"""synthetic_multihop: determinism, disjoint splits, unguessable answers, hop mix, plans."""

import json
from collections import Counter
from dataclasses import asdict

import pytest

from stppo.envs import build_task
from stppo.envs.rewards import normalize_answer
from stppo.envs.synthetic import SPLITS, SyntheticConfig, build_synthetic_task
from stppo.envs.synthetic_world import RELATIONS


def _serialise(task) -> str:
    return json.dumps({
        "corpus": [asdict(d) for d in task.corpus],
        "splits": {s: [[q.id, q.question, list(q.golden_answers), q.meta] for q in qs]
                   for s, qs in task.splits.items()},
        "world": [asdict(e) for e in task.world.entities] + [asdict(f) for f in task.world.facts],
    }, sort_keys=True)


@pytest.fixture(scope="module")
def task():
    return build_synthetic_task()


def test_same_seed_same_bytes_other_seed_differs(task):
    again = build_task("synthetic_multihop")
    assert _serialise(again) == _serialise(task)
    other = build_synthetic_task(seed=1)
    assert _serialise(other) != _serialise(task)
    assert [d.text for d in other.corpus] != [d.text for d in task.corpus]


def test_the_default_world_is_the_one_runs_compose(task):
    """`build_synthetic_task()` builds SyntheticConfig's world with the sizes it says — entities
    per kind, one document per fact plus the distractors, the split sizes and hop mix — and that
    world is `task=synthetic_multihop`'s (conf/ sets none of it: the defaults live in Python)."""
    from stppo.config import compose, to_config

    c = SyntheticConfig()
    assert task.config == c
    kinds = Counter(e.kind for e in task.world.entities)
    assert kinds == {"person": c.n_people, "city": c.n_cities, "country": c.n_countries, "org": c.n_orgs}
    assert len(task.corpus) == len(task.world.facts) + c.n_distractors
    assert len({d.id for d in task.corpus}) == len(task.corpus)
    sizes = {"sft": c.n_sft, "train": c.n_train, "val": c.n_val, "test": c.n_test}
    assert {s: len(q) for s, q in task.splits.items()} == sizes
    for s, n in sizes.items():  # the hop mix, split by split (rounded as `build_splits` does)
        hops = Counter(q.meta["hops"] for q in task.split(s))
        assert all(abs(hops[h + 1] - n * f) <= 1 for h, f in enumerate(c.hop_mix)), (s, hops)
    options = to_config(compose(["task=synthetic_multihop"])).task.options
    assert SyntheticConfig(**{**options, "hop_mix": tuple(options["hop_mix"])}) == c


def test_splits_disjoint_and_deduplicated(task):
    texts = [q.question for s in SPLITS for q in task.split(s)]
    assert len(texts) == len(set(texts))
    ids = [q.id for s in SPLITS for q in task.split(s)]
    assert len(ids) == len(set(ids))


def test_answer_never_in_question(task):
    for s in SPLITS:
        for q in task.split(s):
            assert q.golden_answers[0].lower() not in q.question.lower(), q
            assert normalize_answer(q.golden_answers[0]) not in normalize_answer(q.question), q


def test_hop_mix_as_configured():
    cfg = SyntheticConfig(seed=3, hop_mix=(0.5, 0.3, 0.2), n_sft=50, n_train=100, n_val=30, n_test=7)
    t = build_synthetic_task(cfg)
    expected = {"sft": {1: 25, 2: 15, 3: 10}, "train": {1: 50, 2: 30, 3: 20},
                "val": {1: 15, 2: 9, 3: 6}, "test": {1: 4, 2: 2, 3: 1}}  # 3.5/2.1/1.4 → 4/2/1
    for s in SPLITS:
        assert dict(Counter(q.meta["hops"] for q in t.split(s))) == expected[s]
    only_one = build_synthetic_task(hop_mix=(1, 0, 0), n_sft=10, n_train=10, n_val=10, n_test=10)
    assert {q.meta["hops"] for s in SPLITS for q in only_one.split(s)} == {1}


def test_plan_is_consistent_with_corpus_and_answer(task):
    by_id = {d.id: d for d in task.corpus}
    for q in task.split("val"):
        plan, chain = q.meta["plan"], q.meta["chain"]
        assert len(plan) == len(chain) == q.meta["hops"]
        entity = q.meta["subject"]
        assert entity in q.question
        for (query, doc_id, answer), rel in zip(plan, chain):
            assert query == f"{entity} {RELATIONS[rel].word}"
            doc = by_id[doc_id]
            assert doc.title == entity and answer in doc.text and RELATIONS[rel].word in doc.text
            entity = answer
        assert entity == q.golden_answers[0]


def test_corpus_documents_are_one_fact_each(task):
    facts = {(f.subject, RELATIONS[f.relation].text.format(s=f.subject, o=f.object))
             for f in task.world.facts}
    fact_docs = [d for d in task.corpus if (d.title, d.text) in facts]
    assert len(fact_docs) == len(task.world.facts)
    words = {r.word for r in RELATIONS.values()}
    for d in task.corpus:
        if (d.title, d.text) not in facts:  # distractors never state a relation
            assert not words & set(d.text.lower().rstrip(".").split()), d


@pytest.mark.parametrize("field,value,match", [
    ("hop_mix", (0.5, 0.5, 0.5), "hop_mix"),
    ("n_val", -1, "n_val"),
    ("n_countries", 1, "n_countries"),
    ("works_for_frac", 1.5, "works_for_frac"),
])
def test_config_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**{field: value})


def test_too_many_questions_is_a_clear_error():
    with pytest.raises(ValueError, match="hop questions but the world has"):
        build_synthetic_task(n_people=10, n_orgs=4, n_cities=5, n_countries=2, n_train=200)
    with pytest.raises(ValueError, match="unknown option"):
        build_task("synthetic_multihop", n_peeple=3)
