"""The Search-R1 search tool inside verl's tool agent loop (imports verl; runs in its environment).

Three pieces, all loaded by verl from the job's config (`data.py` writes it):

* `SearchTool` — a verl `BaseTool` named `search` (one string parameter, `query`), listed in the
  tool config yaml (`multi_turn.tool_config_path`). It answers a query with stppo's retriever
  (`bm25` in process over the task's corpus file, or `http`: a Search-R1 retrieval server such as
  `python -m stppo.envs.retrieval_server`) and returns Search-R1's observation text,
  `stppo.envs.format_information` — '\\n\\n<information>Doc 1(Title: …) …</information>\\n\\n'.
  A call without a query (the parser's invalid action) gets Search-R1's invalid-action message.
  A retriever error (server down, timeout, bad answer) becomes an observation text naming the
  error — the rollout goes on, never crashes — and the call's metrics carry `retrieval_error=1`.
* `SearchR1ToolParser`, registered as `multi_turn.format=search_r1`: reads one agent turn with
  stppo's `parse_action` (Search-R1's `<(search|answer)>(.*?)</\\1>` rule): `<search>q</search>`
  → a `search` call with {"query": q}; `<answer>…</answer>` → no call (the episode ends, as in
  the own environment); anything else → a `search` call without a query (the invalid-action
  observation, and the episode goes on, as in Search-R1).
* `SearchR1AgentLoop`, registered as agent `search_r1_agent`: verl's `ToolAgentLoop` whose
  generation stops after `</search>` or `</answer>` (Search-R1's stop tags; kept in the output),
  as the own rollout's turns do. verl's loop stops on EOS or token ids only.

Importing this module registers the parser and the agent loop; verl imports it when it loads
the tool config (in every agent-loop worker, before any agent loop is built).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from stppo.envs.actions import INVALID_ACTION_OBSERVATION, format_information, parse_action
from stppo.envs.base import STOP_TAGS

log = logging.getLogger(__name__)
TOOL_NAME = "search"
PARSER_NAME = "search_r1"  # == overrides.TOOL_FORMAT
AGENT_LOOP_NAME = "search_r1_agent"  # == overrides.AGENT_LOOP

SCHEMA = OpenAIFunctionToolSchema.model_validate({
    "type": "function",
    "function": {"name": TOOL_NAME,
                 "description": "Search the corpus; returns the top documents inside <information> tags.",
                 "parameters": {"type": "object",
                                "properties": {"query": {"type": "string", "description": "the search query"}},
                                "required": ["query"]}},
})


def retrieval_error_text(err: BaseException) -> str:
    """The observation after a failed retrieval (the agent sees that the search failed)."""
    return f"\n\n<information>Search failed: {type(err).__name__}: {err}</information>\n\n"


class SearchTool(BaseTool):
    """verl tool config: `{type: native, topk: k, retriever: {kind: bm25, corpus: FILE.jsonl} |
    {kind: http, url: URL, timeout_s: s, retries: n}}`. The retriever is built on first use."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema or SCHEMA)
        self.topk = int(config.get("topk", 3))
        self.retriever_options = dict(config.get("retriever") or {"kind": "http"})
        self._retriever = None

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    @property
    def retriever(self):
        if self._retriever is None:
            from stppo.envs import build_retriever, read_corpus_jsonl

            opts = dict(self.retriever_options)
            kind = opts.pop("kind")
            corpus = opts.pop("corpus", None)
            docs = read_corpus_jsonl(corpus) if corpus else ()
            self._retriever = build_retriever(kind, corpus=docs, **opts)
        return self._retriever

    def search(self, query: str) -> tuple[str, dict]:
        """(observation text, metrics) for one query; never raises for a retriever failure."""
        try:
            docs = self.retriever.retrieve([query], self.topk)[0]
        except Exception as err:  # noqa: BLE001 - any failure is the agent's observation
            log.warning("stppo search tool: retrieval failed for %r: %s", query[:100], err)
            return retrieval_error_text(err), {"retrieval_error": 1}
        return format_information(docs), {"retrieval_error": 0, "docs": len(docs)}

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        query = parameters.get("query") if isinstance(parameters, dict) else None
        if not isinstance(query, str):  # the parser's invalid action
            return ToolResponse(text=INVALID_ACTION_OBSERVATION), 0.0, {"invalid_action": 1}
        text, metrics = self.search(query)
        return ToolResponse(text=text), 0.0, metrics


@ToolParser.register(PARSER_NAME)
class SearchR1ToolParser(ToolParser):
    """One agent turn → at most one `search` call (see the module docstring)."""

    def calls(self, text: str) -> list[FunctionCall]:
        import json

        kind, content = parse_action(text)
        if kind == "answer":
            return []
        args = {"query": content} if kind == "search" else {}
        return [FunctionCall(name=TOOL_NAME, arguments=json.dumps(args, ensure_ascii=False))]

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, self.calls(text)


def stop_params(engine: str) -> dict[str, Any]:
    """Sampling parameters that end a turn after Search-R1's stop tags, kept in the output."""
    keep = {"vllm": "include_stop_str_in_output", "sglang": "no_stop_trim"}.get(engine)
    return {"stop": list(STOP_TAGS), **({keep: True} if keep else {})}


@register(AGENT_LOOP_NAME)
class SearchR1AgentLoop(ToolAgentLoop):
    """verl's tool agent loop with generation stopped at `</search>` / `</answer>`."""

    async def _handle_generating_state(self, agent_data, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False):
        params = {**sampling_params, **stop_params(self.rollout_config.name)}
        return await super()._handle_generating_state(agent_data, params, ignore_termination)
