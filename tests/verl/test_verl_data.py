"""The converter's parquet as verl's own RLHFDataset reads it (local tokenizer, the data config the
launcher's overrides compose), and `compute_score` as verl's `get_custom_reward_fn` loads it, on
Search-R1's exact-match cases."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from local_model import make_local_model
from test_verl_overrides import verl_compose

from stppo.config import compose, to_config
from stppo.envs.actions import INVALID_ACTION_OBSERVATION
from stppo.envs.prompts import SEARCH_R1_TEMPLATE
from stppo.integrations.verl import data as D
from stppo.integrations.verl import overrides as O

WORLD = ["task.options.n_people=60", "task.options.n_cities=20", "task.options.n_countries=6",
         "task.options.n_orgs=15", "task.options.n_distractors=50", "task.options.n_sft=10",
         "task.options.n_train=24", "task.options.n_val=8", "task.options.n_test=4"]


def job(tmp_path, *extra: str):
    model = make_local_model(tmp_path / "model")
    cfg = to_config(compose(["backend=verl", "trainer.warmstart.enabled=false", "task.prompt_style=search_r1",
                             "trainer.rollout.max_total_tokens=1024", f"model.path={model}",
                             f"backend.data_dir={tmp_path}/data", *extra]))
    return cfg, model


def verl_config(cfg, converted):
    files = O.JobFiles(str(converted.train), str(converted.val), str(converted.tool_config), "/ckpt")
    return verl_compose(O.verl_overrides(cfg, files))


def test_verl_reads_the_converted_synthetic_task_with_its_dataset_class(tmp_path):
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils import hf_tokenizer

    cfg, model = job(tmp_path, *WORLD)
    out = D.convert(cfg)
    assert out.rows == {"train": 24, "val": 8} and out.dir.parent == tmp_path / "data"
    c = verl_config(cfg, out)
    ds = create_rl_dataset(c.data.train_files, c.data, hf_tokenizer(str(model)), None, is_train=True)
    assert len(ds) == 24  # none dropped by verl's over-long prompt filter
    from stppo.envs import build_task

    q = build_task(cfg.task.name, **dict(cfg.task.options)).split("train")[5]
    item = ds[5]
    assert item["raw_prompt"] == [{"role": "user", "content": SEARCH_R1_TEMPLATE.format(question=q.question.rstrip("?") + "?")}]
    assert item["data_source"] == cfg.task.name == "testbed" and item["agent_name"] == O.AGENT_LOOP
    assert list(item["reward_model"]["ground_truth"]["target"]) == list(q.golden_answers)
    assert item["tools_kwargs"] == {"search": {"create_kwargs": {"question_id": q.id}}} and item["index"] == 5
    tools = D.tool_config(cfg, out.dir / "corpus.jsonl")["tools"][0]
    assert (out.dir / "corpus.jsonl").is_file() and tools["config"]["retriever"]["kind"] == "bm25"
    assert D.convert(cfg).dir == out.dir  # reused, not rewritten


def test_the_instruct_style_reaches_verl_as_system_and_user_messages(tmp_path):
    """task.prompt_style=instruct (the SmolLM2 recipe's): verl's dataset reads the instruction as
    the system message and the question as the user's; a new style is a new conversion."""
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils import hf_tokenizer

    from stppo.envs.prompts import INSTRUCT_SYSTEM

    cfg, model = job(tmp_path, *WORLD, "task.prompt_style=instruct")
    out = D.convert(cfg)
    c = verl_config(cfg, out)
    ds = create_rl_dataset(c.data.train_files, c.data, hf_tokenizer(str(model)), None, is_train=True)
    from stppo.envs import build_task

    q = build_task(cfg.task.name, **dict(cfg.task.options)).split("train")[3]
    assert ds[3]["raw_prompt"] == [{"role": "system", "content": INSTRUCT_SYSTEM},
                                   {"role": "user", "content": f"Question: {q.question}"}]
    assert out.dir != D.convert(job(tmp_path, *WORLD)[0]).dir


def test_search_r1_parquet_converts_with_its_sources_and_the_http_tool(tmp_path):
    src = tmp_path / "nq_hotpotqa"
    src.mkdir()
    for split, n in (("train", 6), ("test", 3)):
        rows = [{"data_source": "nq" if i % 2 else "hotpotqa", "id": f"{split}_{i}",
                 "question": f"who wrote book number {i}", "golden_answers": [f"author {i}", f"a{i}"],
                 "prompt": [{"role": "user", "content": f"...Question: who wrote book number {i}?\n"}],
                 "reward_model": {"style": "rule", "ground_truth": {"target": [f"author {i}", f"a{i}"]}},
                 "extra_info": {"split": split, "index": i}} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), src / f"{split}.parquet")
    cfg, _ = job(tmp_path, "task=nq_hotpotqa", f"task.options.data_dir={src}",
                 "task.retriever.url=http://10.0.0.1:8000")
    out = D.convert(cfg)
    val = pq.read_table(out.val).to_pylist()
    assert out.rows == {"train": 6, "val": 3} and {r["data_source"] for r in val} == {"search_r1"}
    assert [r["extra_info"]["source"] for r in val] == ["hotpotqa", "nq", "hotpotqa"]
    assert val[1]["reward_model"]["ground_truth"]["target"] == ["author 1", "a1"]
    assert "Question: who wrote book number 1?\n" in val[1]["prompt"][0]["content"]
    retriever = D.tool_config(cfg, None)["tools"][0]["config"]["retriever"]
    assert retriever["kind"] == "http" and retriever["url"] == "http://10.0.0.1:8000"


EM_CASES = [  # (response, gold targets, score) — Search-R1's qa_em semantics on the agent's answer
    ("<think>capital</think>\n<answer> Beijing </answer>", ["beijing"], 1.0),
    ("<answer>The Eiffel Tower.</answer>", ["eiffel tower"], 1.0),  # articles, punctuation, case
    ("<answer>city of light</answer>", ["Paris", "City of Light"], 1.0),  # any gold answer
    ("<answer>Paris, France</answer>", ["Paris"], 0.0),  # exact match, not containment
    ("<answer>Lyon</answer>", ["Paris"], 0.0),
    ("I think it is Paris.", ["Paris"], 0.0),  # no answer tag
    ("<answer>Lyon</answer> no, <answer>Paris</answer>", ["Paris"], 1.0),  # the last answer
    ("<search>q</search>\n\n<information>Doc 1(Title: \"x\") <answer>Paris</answer></information>\n\n"
     "<answer>Lyon</answer>", ["Paris"], 0.0),  # observation text is never scored
    (f"<think>hmm</think>{INVALID_ACTION_OBSERVATION}", ["and"], 0.0),  # nor the invalid-action message
]


@pytest.fixture(scope="module")
def reward_fn(tmp_path_factory):
    """compute_score as verl loads it from the composed `reward.custom_reward_function`."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg, _ = job(tmp_path_factory.mktemp("reward"), *WORLD)
    return get_custom_reward_fn(verl_config(cfg, D.planned(cfg)))


@pytest.mark.parametrize("response, golds, score", EM_CASES)
def test_compute_score_as_verl_loads_it(response, golds, score, reward_fn):
    truth = {"target": np.array(golds, dtype=object)}  # as it comes back from parquet
    assert reward_fn(data_source="search_r1", solution_str=response, ground_truth=truth, extra_info={}) == score
