"""stppo tasks → verl's RL parquet, plus the search tool's config (verl-free).

    python -m stppo.integrations.verl.data [stppo overrides...]
    python -m stppo.integrations.verl.data +experiment=paper_search task.options.data_dir=DIR \
        task.retriever.url=http://HOST:8000 backend.data_dir=/shared/verl_data

Writes into `<backend.data_dir or the stppo cache>/<content key of the task settings>/` (the folder
the launcher then finds for the same settings): `train.parquet` (the task's `train` split), `val.parquet` (`val`),
`tool_config.yaml` (verl's `multi_turn.tool_config_path`: the stppo search tool with the task's
retriever) and, for bm25, `corpus.jsonl` (the tool's corpus). A row, in verl's RLHFDataset form:

    data_source   the stppo task name (one val-core metric over the whole split, as the own
                  trainer's val/success_rate; the question's own source is extra_info.source)
    prompt        [{"role": "user", "content": Search-R1's instruction + question}] — verl applies
                  the model's chat template
    reward_model  {"style": "rule", "ground_truth": {"target": [gold answers]}}
    agent_name    the Search-R1 tool agent loop (stppo.integrations.verl.tool)
    extra_info    {split, index, id, question, source,
                   tools_kwargs: {"search": {"create_kwargs": {"question_id": id}}}}

The launcher converts each job's task on its own when that folder is missing; this command does it
ahead, e.g. on a cluster's login node (for several nodes, backend.data_dir on a shared filesystem:
the tool's workers read the corpus file and the tool config).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stppo.cache import cache_dir, content_hash
from stppo.config import Config
from stppo.envs.base import Question, Task
from stppo.envs.prompts import CHAT_STYLES, chat_messages
from stppo.integrations.verl.overrides import AGENT_LOOP

FORMAT_VERSION = 1  # bump when the row layout or the tool config changes
TOOL_CLASS = "stppo.integrations.verl.tool.SearchTool"
TOOL_NAME = "search"
_COMPLETE = "stppo_verl_data.json"  # written last: a folder without it is incomplete


@dataclass(frozen=True)
class ConvertedData:
    dir: Path
    train: Path
    val: Path
    tool_config: Path
    data_source: str
    rows: dict[str, int]


def data_key(cfg: Config) -> str:
    """Content key of a conversion: the task, its retriever and the format version."""
    return content_hash(FORMAT_VERSION, asdict(cfg.task))


def default_dir(cfg: Config) -> Path:
    root = Path(cfg.backend.data_dir) if cfg.backend.data_dir else cache_dir("verl_data")
    return (root / data_key(cfg)).resolve()


def planned(cfg: Config, out_dir: Path | None = None) -> ConvertedData:
    """The paths a conversion writes (nothing is read or written)."""
    d = Path(out_dir).resolve() if out_dir else default_dir(cfg)
    return ConvertedData(d, d / "train.parquet", d / "val.parquet", d / "tool_config.yaml", cfg.task.name, {})


def row(q: Question, split: str, index: int, data_source: str, prompt_style: str = "search_r1") -> dict[str, Any]:
    """One verl RL row of a question: its prompt as chat messages (verl applies the model's chat
    template): `instruct`'s system and user messages, else Search-R1's instruction as the user's."""
    return {
        "data_source": data_source,
        "prompt": chat_messages(q, prompt_style if prompt_style in CHAT_STYLES else "chat"),
        "ability": "search",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(q.golden_answers)}},
        "agent_name": AGENT_LOOP,
        "extra_info": {"split": split, "index": index, "id": q.id, "question": q.question,
                       "source": str(q.meta.get("data_source", data_source)),
                       "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"question_id": q.id}}}},
    }


def tool_config(cfg: Config, corpus: Path | None) -> dict[str, Any]:
    """verl's tool config (`tools: [{class_name, config}]`) for the task's retriever."""
    r = cfg.task.retriever
    retriever: dict[str, Any] = ({"kind": "bm25", "corpus": str(corpus)} if r.kind == "bm25" else
                                 {"kind": "http", "url": r.url, "timeout_s": r.timeout_s, "retries": r.retries})
    return {"tools": [{"class_name": TOOL_CLASS,
                       "config": {"type": "native", "topk": r.topk, "retriever": retriever}}]}


def convert(cfg: Config, out_dir: Path | None = None, *, task: Task | None = None) -> ConvertedData:
    """Write the job's data (see the module docstring); an existing complete folder is reused."""
    plan = planned(cfg, out_dir)
    done = _read_marker(plan.dir)
    if done is not None:
        if done.get("key") != data_key(cfg):
            raise ValueError(f"{plan.dir} holds the data of another task setting; choose another folder")
        return ConvertedData(plan.dir, plan.train, plan.val, plan.tool_config, plan.data_source, done["rows"])
    task = task or _build_task(cfg)
    if task.reward != "em":
        raise ValueError(f"task {cfg.task.name} is scored by {task.reward}; backend=verl has the exact-match "
                         "reward only (stppo.integrations.verl.reward)")
    for split in ("train", "val"):
        if not task.splits.get(split):
            raise ValueError(f"task {cfg.task.name} has no {split!r} questions; backend=verl needs train and val")
    plan.dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=plan.dir.parent))
    try:
        _write(cfg, task, tmp, final_dir=plan.dir)
        if plan.dir.exists():  # an incomplete leftover
            shutil.rmtree(plan.dir, ignore_errors=True)
        os.rename(tmp, plan.dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if _read_marker(plan.dir) is None:  # not a concurrent job that finished first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return convert(cfg, out_dir)


def _read_marker(d: Path) -> dict | None:
    import json

    p = d / _COMPLETE
    return json.loads(p.read_text()) if p.is_file() else None


def _build_task(cfg: Config) -> Task:
    from stppo.envs import build_task

    return build_task(cfg.task.name, **dict(cfg.task.options))


def _write(cfg: Config, task: Task, tmp: Path, *, final_dir: Path) -> dict[str, int]:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    counts = {}
    for split, name in (("train", "train.parquet"), ("val", "val.parquet")):
        rows = [row(q, split, i, cfg.task.name, cfg.task.prompt_style) for i, q in enumerate(task.split(split))]
        pq.write_table(pa.Table.from_pylist(rows), tmp / name)
        counts[split] = len(rows)
    corpus = None
    if cfg.task.retriever.kind == "bm25":
        from stppo.envs import write_corpus_jsonl

        if not task.corpus:
            raise ValueError(f"task {cfg.task.name} has no corpus for the bm25 retriever; set "
                             "task.options.corpus=FILE.jsonl or task.retriever.kind=http")
        write_corpus_jsonl(task.corpus, tmp / "corpus.jsonl")
        corpus = final_dir / "corpus.jsonl"
    (tmp / "tool_config.yaml").write_text(yaml.safe_dump(tool_config(cfg, corpus), sort_keys=False))
    (tmp / _COMPLETE).write_text(json.dumps({"version": FORMAT_VERSION, "key": data_key(cfg), "rows": counts}))
    return counts


def main(argv: list[str] | None = None) -> int:
    """`python -m stppo.integrations.verl.data [overrides...]`: convert, print the folder."""
    args = sys.argv[1:] if argv is None else argv
    if any(a.startswith("-") for a in args):
        print("usage: python -m stppo.integrations.verl.data [stppo overrides...]", file=sys.stderr)
        return 2
    from stppo.config import compose, to_config

    try:
        out = convert(to_config(compose(args)))
    except (ValueError, FileNotFoundError) as e:
        print(f"stppo.integrations.verl.data: error: {e}", file=sys.stderr)
        return 1
    print(f"{out.dir}: train.parquet ({out.rows['train']} rows), val.parquet ({out.rows['val']} rows), "
          f"tool_config.yaml (data_source {out.data_source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
