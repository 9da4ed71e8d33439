"""The search tool as verl loads it (`initialize_tools_from_config` on the converter's tool config):
against the shipped retrieval server (`python -m stppo.envs.retrieval_server`), with the server
down, in process over bm25; and the `search_r1` tool parser and stop tags of the agent loop."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import yaml

from stppo.envs import BM25Retriever, Doc, Question, format_information, write_corpus_jsonl
from stppo.envs.actions import INVALID_ACTION_OBSERVATION

DOCS = [Doc("0", "Paris", "Paris is the capital of France."),
        Doc("1", "Berlin", "Berlin is the capital of Germany."),
        Doc("2", "Lyon", "Lyon is a city in France known for food."),
        Doc("3", "Rhine", "The Rhine flows through Germany and the Netherlands.")]


def tools_from(tmp_path: Path, retriever: dict, topk: int = 2):
    """verl's own loader over a tool config in the converter's form."""
    from verl.tools.tool_registry import initialize_tools_from_config

    from stppo.integrations.verl.data import TOOL_CLASS

    path = tmp_path / "tool_config.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": TOOL_CLASS, "config": {
        "type": "native", "topk": topk, "retriever": retriever}}]}))
    (tool,) = initialize_tools_from_config(str(path))
    return tool


def execute(tool, parameters: dict):
    async def go():
        instance, _ = await tool.create()
        try:
            return await tool.execute(instance, parameters)
        finally:
            await tool.release(instance)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    return write_corpus_jsonl(DOCS, tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="module")
def server(corpus_file):
    from servers import start_on_free_port

    proc, url = start_on_free_port(lambda port: [sys.executable, "-m", "stppo.envs.retrieval_server", "--corpus",
                                                 str(corpus_file), "--host", "127.0.0.1", "--port", str(port)],
                                   "/health", 120, corpus_file.parent / "server.log")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_the_tool_answers_from_the_shipped_server_with_search_r1s_information_text(server, tmp_path):
    tool = tools_from(tmp_path, {"kind": "http", "url": server, "timeout_s": 5, "retries": 0})
    assert tool.name == "search" and tool.tool_schema.function.parameters.required == ["query"]
    response, reward, metrics = execute(tool, {"query": "capital of France"})
    expected = BM25Retriever(DOCS, use_cache=False).retrieve(["capital of France"], 2)[0]
    assert response.text == format_information(expected)
    assert response.text.startswith("\n\n<information>Doc 1(Title: \"Paris\") Paris is the capital of France.")
    assert metrics["retrieval_error"] == 0 and reward == 0.0


def test_a_retriever_error_becomes_an_observation_not_a_crash(tmp_path):
    from servers import free_port

    tool = tools_from(tmp_path, {"kind": "http", "url": f"http://127.0.0.1:{free_port()}", "timeout_s": 1,
                                 "retries": 0})
    response, _, metrics = execute(tool, {"query": "capital of France"})
    assert response.text.startswith("\n\n<information>Search failed: ConnectionError: retrieval server")
    assert response.text.endswith("</information>\n\n") and metrics["retrieval_error"] == 1


def test_bm25_in_process_over_the_corpus_file(corpus_file, tmp_path):
    tool = tools_from(tmp_path, {"kind": "bm25", "corpus": str(corpus_file)}, topk=1)
    response, _, _ = execute(tool, {"query": "Rhine Netherlands"})
    assert response.text == format_information([DOCS[3]])
    invalid, _, metrics = execute(tool, {})
    assert invalid.text == INVALID_ACTION_OBSERVATION and metrics == {"invalid_action": 1}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from local_model import make_local_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_local_model(tmp_path_factory.mktemp("model")))


@pytest.mark.parametrize("turn, calls", [
    ("<think>need it</think>\n<search> capital of France </search>", [{"query": "capital of France"}]),
    ("<think>done</think><answer> Paris </answer>", []),
    ("<answer>Paris</answer> then <search>x</search>", []),  # the earliest complete tag wins
    ("I am not sure.<|im_end|>", [{}]),  # invalid action: the tool answers Search-R1's correction
])
def test_the_search_r1_parser_reads_one_turn_as_the_own_environment(turn, calls, tokenizer):
    from verl.experimental.agent_loop.tool_parser import ToolParser

    import stppo.integrations.verl.tool  # noqa: F401  (registers the parser)

    parser = ToolParser.get_tool_parser("search_r1", tokenizer)
    ids = tokenizer.encode(turn, add_special_tokens=False)
    text, found = asyncio.run(parser.extract_tool_calls(ids))
    assert [json.loads(c.arguments) for c in found] == calls
    assert all(c.name == "search" for c in found) and "<|im_end|>" not in text


def test_the_agent_loop_stops_generation_after_search_r1s_tags():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from stppo.integrations.verl.overrides import AGENT_LOOP
    from stppo.integrations.verl.tool import SearchR1AgentLoop, stop_params

    assert _agent_loop_registry[AGENT_LOOP]["_target_"] == f"{SearchR1AgentLoop.__module__}.SearchR1AgentLoop"
    assert stop_params("vllm") == {"stop": ["</search>", "</answer>"], "include_stop_str_in_output": True}
    assert stop_params("sglang") == {"stop": ["</search>", "</answer>"], "no_stop_trim": True}


class ScriptedServer:
    """Stands in for the vLLM/SGLang server (none on a CPU): returns the scripted agent turns and
    records the sampling parameters the agent loop sent."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.params = tokenizer, list(turns), []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.params.append(dict(sampling_params))
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        return TokenOutput(token_ids=ids, stop_reason="completed")


@pytest.mark.parametrize("turns, observation, score", [
    (["<think>look up</think><search> capital of France </search>", "<answer> Paris </answer><|im_end|>"],
     format_information(DOCS[:2]), 1.0),
    (["I do not know", "<answer> Lyon </answer><|im_end|>"], INVALID_ACTION_OBSERVATION, 0.0),
])
def test_verls_agent_loop_runs_an_episode_with_the_tool_parser_and_reward(turns, observation, score, corpus_file,
                                                                         tokenizer, tmp_path):
    """verl's real ToolAgentLoop (as `search_r1_agent`) with the tool, the parser and the stop tags;
    the inference server is scripted. The observation is masked out, turns = 2 x agent turns, and
    compute_score scores the episode from the decoded response as verl's reward manager passes it."""
    import hydra
    from test_verl_overrides import verl_compose
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from stppo.config import compose, to_config
    from stppo.integrations.verl import data as D
    from stppo.integrations.verl import overrides as O
    from stppo.integrations.verl.reward import compute_score

    cfg = to_config(compose(["backend=verl", "trainer.warmstart.enabled=false", "task.prompt_style=search_r1",
                             "trainer.rollout.max_total_tokens=1024", f"model.path={tokenizer.name_or_path}"]))
    tool = tools_from(tmp_path, {"kind": "bm25", "corpus": str(corpus_file)})
    c = verl_compose(O.verl_overrides(cfg, O.JobFiles("/t.parquet", "/v.parquet", "/tools.yaml", "/ckpt")))
    server = ScriptedServer(tokenizer, turns)
    messages = D.row(Question("q", "capital of France", ("Paris",)), "train", 0, "test")["prompt"]

    async def episode():
        loop = hydra.utils.instantiate(_agent_loop_registry[O.AGENT_LOOP], trainer_config=DictConfigWrap(c),
                                       server_manager=server, tokenizer=tokenizer, processor=None,
                                       hf_model_type="qwen2", dataset_cls=RLHFDataset,
                                       data_config=DictConfigWrap(c.data), tools=ToolListWrap([tool]))
        return await loop.run({"temperature": 1.0}, raw_prompt=messages, tools_kwargs={}, extra_info={})

    out = asyncio.run(episode())
    assert all(p["stop"] == ["</search>", "</answer>"] and p["include_stop_str_in_output"] for p in server.params)
    assert out.num_turns == 2 * len(turns)
    agent = [t for t, m in zip(out.response_ids, out.response_mask) if m]
    obs = [t for t, m in zip(out.response_ids, out.response_mask) if not m]
    assert tokenizer.decode(agent) == "".join(turns)
    assert observation.strip() in tokenizer.decode(obs)
    text = tokenizer.decode(out.response_ids, skip_special_tokens=True)  # what the reward manager passes
    assert compute_score("test", text, {"target": ["Paris"]}) == score
