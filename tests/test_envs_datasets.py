"""File-backed tasks (search_r1 parquet/jsonl, hf, mcq), corpus files and the task registry."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stppo.envs import SearchEnv, build_retriever, build_task, read_corpus_jsonl, write_corpus_jsonl
from stppo.envs.base import Doc
from stppo.envs.prompts import SEARCH_R1_TEMPLATE


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _search_r1_row(i, question, answers, with_question_column):
    prompt = SEARCH_R1_TEMPLATE.format(question=question + "?")  # as nq_search.py writes it
    row = {"data_source": "nq", "prompt": [{"role": "user", "content": prompt}],
           "ability": "fact-reasoning",
           "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
           "extra_info": {"split": "train", "index": i}}
    if with_question_column:
        row.update(id=f"train_{i}", question=question, golden_answers=answers)
    return row


def test_search_r1_parquet_with_and_without_question_column(tmp_path):
    rows = [_search_r1_row(0, "who wrote hamlet", ["Shakespeare", "William Shakespeare"], True),
            _search_r1_row(1, "capital of france", ["Paris"], True)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    bare = [_search_r1_row(i, q, a, False) for i, (q, a) in enumerate([("when did x happen", ["1999"])])]
    pq.write_table(pa.Table.from_pylist(bare), tmp_path / "test.parquet")
    task = build_task("search_r1", data_dir=str(tmp_path))
    train, val = task.split("train"), task.split("val")
    assert [q.id for q in train] == ["train_0", "train_1"]
    assert train[0].question == "who wrote hamlet"  # the raw question, not the prompt
    assert train[0].golden_answers == ("Shakespeare", "William Shakespeare")
    assert val[0].question == "when did x happen?"  # extracted after 'Question: '
    assert val[0].golden_answers == ("1999",) and val[0].id == "nq_train_0"
    assert val[0].meta["data_source"] == "nq" and task.reward == "em" and task.corpus == []
    env = SearchEnv.for_task(task, build_retriever("bm25", corpus=[Doc("d", "Title", "Some text")]))
    assert env.prompt(train[0]) == rows[0]["prompt"][0]["content"]  # Search-R1's own prompt text


def test_search_r1_jsonl_and_corpus(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"id": "a", "question": "q one", "golden_answers": ["x", "y"]},
                                      {"id": 2, "question": "q two", "golden_answers": "z"}])
    corpus = write_corpus_jsonl([Doc("d1", "Hamlet", "A play."), Doc("d2", "Paris", "A city.\nBig.")],
                                tmp_path / "corpus.jsonl")
    assert json.loads(corpus.read_text().splitlines()[0]) == {"id": "d1", "contents": '"Hamlet"\nA play.'}
    task = build_task("search_r1", splits={"train": str(tmp_path / "train.jsonl")}, corpus=str(corpus))
    assert [(q.id, q.golden_answers) for q in task.split("train")] == [("a", ("x", "y")), ("2", ("z",))]
    assert task.corpus == read_corpus_jsonl(corpus) == [Doc("d1", "Hamlet", "A play."),
                                                        Doc("d2", "Paris", "A city.\nBig.")]


def test_missing_and_malformed_files_name_the_file_and_fields(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet: no such file"):
        build_task("search_r1", splits={"train": str(tmp_path / "nope.parquet")})
    pq.write_table(pa.Table.from_pylist([{"foo": 1, "bar": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 0: expected fields 'prompt'.*got \['bar', 'foo'\]"):
        build_task("search_r1", splits={"train": str(tmp_path / "bad.parquet")})
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet file"):
        build_task("search_r1", splits={"train": str(tmp_path / "junk.parquet")})
    (tmp_path / "broken.jsonl").write_text('{"id": 1, "question": "q", "golden_answers": ["a"]}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not a JSON object"):
        build_task("search_r1", splits={"train": str(tmp_path / "broken.jsonl")})
    _jsonl(tmp_path / "c.jsonl", [{"id": 1, "body": "x"}])
    with pytest.raises(ValueError, match="c.jsonl: row 0: expected fields 'id' and 'contents'"):
        read_corpus_jsonl(tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match="give splits"):
        build_task("search_r1")


def test_hf_task_from_a_local_json_directory_and_save_to_disk(tmp_path):
    import datasets

    d = tmp_path / "qa"
    d.mkdir()
    _jsonl(d / "train.jsonl", [{"id": "t1", "question": " who? ", "golden_answers": ["Bob", "Robert"]}])
    _jsonl(d / "validation.jsonl", [{"id": "v1", "question": "where?", "golden_answers": ["Paris"]}])
    task = build_task("hf", name=str(d), cache_dir=str(tmp_path / "hf"))
    assert [(q.id, q.question, q.golden_answers) for q in task.split("train")] == [
        ("t1", "who?", ("Bob", "Robert"))]
    assert task.split("val")[0].golden_answers == ("Paris",)
    with pytest.raises(ValueError, match="cannot load split 'test'"):
        build_task("hf", name=str(d), splits={"test": "test"}, cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"missing column\(s\) \['answer'\]"):
        build_task("hf", name=str(d), answers_key="answer", cache_dir=str(tmp_path / "hf"))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"dev": datasets.Dataset.from_list(
        [{"q": "a?", "ans": "x"}, {"q": "b?", "ans": "y"}])}).save_to_disk(str(saved))
    t2 = build_task("hf", name=str(saved), splits={"val": "dev"}, question_key="q", answers_key="ans",
                    id_key=None, max_questions=1)
    assert [(q.id, q.question, q.golden_answers) for q in t2.split("val")] == [("val-0", "a?", ("x",))]


def test_mcq_task_and_reward(tmp_path):
    _jsonl(tmp_path / "m.jsonl", [
        {"id": "m1", "question": "Which drug?", "options": {"A": "Aspirin", "B": "Ibuprofen",
                                                            "C": "Paracetamol"}, "answer": "C"},
        {"id": "m2", "question": "Pick", "options": ["x", "y"], "answer": "b"}])
    task = build_task("mcq", splits={"val": str(tmp_path / "m.jsonl")})
    q1, q2 = task.split("val")
    assert task.reward == "mcq" and q1.golden_answers == ("C",) and q2.meta["options"] == {"A": "x", "B": "y"}
    env = SearchEnv.for_task(task, build_retriever("bm25", corpus=[Doc("d", "Title", "Some text")]),
                             prompt_style="compact")
    assert env.prompt(q1) == "Question: Which drug?\nA. Aspirin\nB. Ibuprofen\nC. Paracetamol\n"
    assert [env.score(q1, a) for a in ("C", "(C)", "C. Paracetamol", "paracetamol", "B", None)] == [
        1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    _jsonl(tmp_path / "bad.jsonl", [{"id": "m", "question": "q", "options": {"A": "x"}, "answer": "D"}])
    with pytest.raises(ValueError, match="bad.jsonl: row 0: expected fields 'id', 'question', 'options'"):
        build_task("mcq", splits={"val": str(tmp_path / "bad.jsonl")})


def test_registries_list_valid_names():
    with pytest.raises(ValueError, match="allowed: synthetic_multihop, testbed, search_r1, hf, mcq"):
        build_task("nq")
    with pytest.raises(ValueError, match="allowed: bm25, http"):
        build_retriever("dense")
    with pytest.raises(ValueError, match=r"unknown; valid: .*url"):
        build_retriever("bm25", corpus=[Doc("d", "Title", "Some text")], urll="http://x")
    with pytest.raises(ValueError, match="corpus is empty"):
        build_retriever("bm25", corpus=[], url="http://127.0.0.1:1")  # url: an http-only option
    with pytest.raises(ValueError, match="give name="):
        build_task("hf")
