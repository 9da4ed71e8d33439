"""Tasks, retrievers, prompts, the action parser, rewards and the oracle (docs/design.md §3).

Torch-free. Entry points: `build_task`, `build_retriever`, `SearchEnv`, `run_oracle`,
`tokenizer_texts`; the retrieval server is `python -m stppo.envs.retrieval_server`.
"""

from stppo.envs.actions import (INVALID_ACTION_OBSERVATION, format_information, format_passages,
                                parse_action)
from stppo.envs.base import TAGS, AgentEnv, Doc, Question, Retriever, StepResult, Task
from stppo.envs.datasets import read_corpus_jsonl, write_corpus_jsonl
from stppo.envs.env import SearchEnv
from stppo.envs.oracle import Episode, oracle_actions, run_oracle, tokenizer_texts
from stppo.envs.prompts import PROMPT_STYLES, build_prompt
from stppo.envs.retrievers import RETRIEVERS, BM25Retriever, HttpRetriever, build_retriever
from stppo.envs.rewards import em_score, mcq_score, normalize_answer, option_letter
from stppo.envs.synthetic import SyntheticConfig, SyntheticTask, build_synthetic_task
from stppo.envs.tasks import TASKS, build_task, register_task

__all__ = [
    "TAGS", "AgentEnv", "Doc", "Question", "Retriever", "StepResult", "Task",
    "INVALID_ACTION_OBSERVATION", "format_information", "format_passages", "parse_action",
    "read_corpus_jsonl", "write_corpus_jsonl", "SearchEnv", "Episode", "oracle_actions",
    "run_oracle", "tokenizer_texts", "PROMPT_STYLES", "build_prompt", "RETRIEVERS",
    "BM25Retriever", "HttpRetriever", "build_retriever", "em_score", "mcq_score",
    "normalize_answer", "option_letter", "SyntheticConfig", "SyntheticTask",
    "build_synthetic_task", "TASKS", "build_task", "register_task",
]
