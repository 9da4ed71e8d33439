"""File-backed tasks: `search_r1` (Search-R1 parquet or jsonl), `hf` (datasets.load_dataset) and
`mcq` (multiple-choice jsonl), and the Search-R1 corpus jsonl form.

Formats:
  corpus jsonl     {"id", "contents": "\\"Title\\"\\ntext"} per line ({"id", "title", "text"} too)
  search_r1 parquet columns data_source, prompt ([{role, content}], the question after
                   'Question: ' in the user content), reward_model ({"ground_truth": {"target":
                   [...]}}), extra_info; the raw question is taken from a `question` column or
                   extra_info['question'] when present
  search_r1 jsonl  {"id", "question", "golden_answers"} per line
  mcq jsonl        {"id", "question", "options": {"A": ..., ...}, "answer": "C"} per line
A missing or malformed file raises one error naming the file and the expected fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from stppo.envs.base import Doc, Question, Task

CORPUS_FIELDS = "'id' and 'contents' (Search-R1 corpus form) or 'id', 'title' and 'text'"
SEARCH_R1_FIELDS = ("'prompt' (chat messages whose user content holds 'Question: ...') or "
                    "'question', and 'reward_model' with ground_truth.target or 'golden_answers'")
MCQ_FIELDS = "'id', 'question', 'options' ({letter: text}) and 'answer' (a letter among options)"


def _exists(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file (expected {what})")
    return p


def read_jsonl(path: str | Path, what: str) -> list[dict]:
    """Rows of a jsonl file; a line that is not a JSON object raises ValueError naming it."""
    p = _exists(path, what)
    rows = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{n}: not a JSON object; expected one object per line with {what}")
            rows.append(row)
    return rows


def read_corpus_jsonl(path: str | Path) -> list[Doc]:
    """A Search-R1 corpus file as `Doc`s (ids as strings, line numbers when absent)."""
    from stppo.envs.actions import doc_from_contents

    docs = []
    for i, row in enumerate(read_jsonl(path, CORPUS_FIELDS)):
        doc_id = str(row.get("id", i))
        if isinstance(row.get("contents"), str):
            docs.append(doc_from_contents(doc_id, row["contents"]))
        elif isinstance(row.get("title"), str) and isinstance(row.get("text"), str):
            docs.append(Doc(doc_id, row["title"], row["text"]))
        else:
            raise ValueError(f"{path}: row {i}: expected fields {CORPUS_FIELDS}; got {sorted(row)}")
    return docs


def write_corpus_jsonl(docs: Iterable[Doc], path: str | Path) -> Path:
    """Write `docs` in Search-R1's corpus form (readable by the retrieval server)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.id, "contents": d.contents}, ensure_ascii=False) + "\n")
    return p


def _answers(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    if hasattr(value, "tolist"):  # numpy arrays from pandas-read parquet
        return _answers(value.tolist())
    return None


def _question_from_prompt(prompt: Any) -> str | None:
    """The text after the last 'Question: ' of the last user message of a chat prompt."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, list):
        return None
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str) or "Question: " not in users[-1]:
        return None
    return users[-1].rsplit("Question: ", 1)[1].strip()


def _search_r1_question(row: dict, i: int, split: str, path: Path) -> Question:
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    text = row.get("question") or extra.get("question") or _question_from_prompt(row.get("prompt"))
    rm = row.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    golds = _answers(gt.get("target")) if isinstance(gt, dict) else None
    golds = golds or _answers(row.get("golden_answers"))
    if not isinstance(text, str) or not text.strip() or not golds:
        raise ValueError(f"{path}: row {i}: expected fields {SEARCH_R1_FIELDS}; got {sorted(row)}")
    source = row.get("data_source") or "search_r1"
    if row.get("id") is not None:
        qid = str(row["id"])
    elif extra.get("index") is not None:
        qid = f"{source}_{extra.get('split', split)}_{extra['index']}"
    else:
        qid = f"{split}-{i}"
    return Question(qid, text.strip(), golds, meta={"data_source": source})


def load_search_r1_split(path: str | Path, split: str = "train") -> list[Question]:
    """Questions of one Search-R1 data file (.parquet, or .jsonl/.json lines)."""
    p = _exists(path, f"a Search-R1 .parquet or .jsonl file with {SEARCH_R1_FIELDS}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as err:  # pyarrow raises its own error types on corrupt files
            raise ValueError(f"{p}: not a readable parquet file ({err}); expected columns "
                             f"{SEARCH_R1_FIELDS}") from None
    else:
        rows = read_jsonl(p, SEARCH_R1_FIELDS)
    return [_search_r1_question(r, i, split, p) for i, r in enumerate(rows)]


def _cap(questions: list[Question], max_questions: int | None) -> list[Question]:
    return questions if max_questions is None else questions[: int(max_questions)]


def _splits_arg(splits: Mapping[str, Any] | None, data_dir: str | None) -> dict[str, str]:
    if splits:
        return {str(k): str(v) for k, v in splits.items()}
    if data_dir:  # Search-R1's layout: train.parquet (RL) and test.parquet (evaluation)
        d = Path(data_dir)
        return {"train": str(d / "train.parquet"), "val": str(d / "test.parquet")}
    raise ValueError("search_r1 task: give splits={split: file} (e.g. {train: nq/train.parquet, "
                     "val: nq/test.parquet}) or data_dir=DIR holding train.parquet and test.parquet")


def build_search_r1_task(splits: Mapping[str, str] | None = None, *, data_dir: str | None = None,
                         corpus: str | None = None, max_questions: int | None = None) -> Task:
    """Search-R1 data files as a Task; `corpus` is a Search-R1 corpus jsonl (optional with an
    http retriever, whose server holds the corpus)."""
    files = _splits_arg(splits, data_dir)
    qs = {s: _cap(load_search_r1_split(f, s), max_questions) for s, f in files.items()}
    return Task("search_r1", read_corpus_jsonl(corpus) if corpus else [], qs, reward="em")


def _hf_split(name: str, split: str, load_kwargs: Mapping[str, Any]):
    import datasets

    local = Path(name)
    try:
        saved = [local / "dataset_dict.json", local / "state.json"]
        if local.is_dir() and any(p.is_file() for p in saved):
            ds = datasets.load_from_disk(str(local))  # a save_to_disk directory
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(name, split=split, **load_kwargs)
    except Exception as err:  # datasets raises many types (missing split, no files, offline hub)
        raise ValueError(f"hf task: cannot load split {split!r} of {name!r}: {err}") from None


def build_hf_task(name: str, splits: Mapping[str, str] | None = None, *,
                  question_key: str = "question", answers_key: str = "golden_answers",
                  id_key: str | None = "id", corpus: str | None = None,
                  max_questions: int | None = None, **load_kwargs: Any) -> Task:
    """A Hugging Face dataset (hub name or local path) as a Task. `splits` maps this suite's
    split names to the dataset's (default {train: train, val: validation}); the answers column
    holds a string or a list of strings."""
    splits = dict(splits or {"train": "train", "val": "validation"})
    out: dict[str, list[Question]] = {}
    for ours, theirs in splits.items():
        ds = _hf_split(name, theirs, load_kwargs)
        missing = [k for k in (question_key, answers_key) if k not in ds.column_names]
        if missing:
            raise ValueError(f"hf task {name!r} split {theirs!r}: missing column(s) {missing}; it has "
                             f"{ds.column_names}; set question_key/answers_key")
        qs = []
        for i, row in enumerate(ds):
            golds = _answers(row[answers_key])
            if not isinstance(row[question_key], str) or not golds:
                raise ValueError(f"hf task {name!r} split {theirs!r} row {i}: {question_key!r} must be "
                                 f"a string and {answers_key!r} a string or list of strings")
            qid = str(row[id_key]) if id_key and id_key in row else f"{ours}-{i}"
            qs.append(Question(qid, row[question_key].strip(), golds, meta={"data_source": name}))
            if max_questions is not None and len(qs) >= max_questions:
                break
        out[ours] = qs
    return Task("hf", read_corpus_jsonl(corpus) if corpus else [], out, reward="em")


def _mcq_question(row: dict, i: int, path: str) -> Question:
    options, answer = row.get("options"), row.get("answer")
    if isinstance(options, list):
        options = {chr(ord("A") + k): v for k, v in enumerate(options)}
    ok = (isinstance(row.get("question"), str) and isinstance(options, dict) and options
          and all(isinstance(v, str) for v in options.values()) and isinstance(answer, str)
          and answer.strip().upper() in options)
    if not ok:
        raise ValueError(f"{path}: row {i}: expected fields {MCQ_FIELDS}; got {sorted(row)}")
    opts = {str(k).strip().upper(): v for k, v in options.items()}
    return Question(str(row.get("id", i)), row["question"].strip(), (answer.strip().upper(),),
                    meta={"options": opts, "data_source": "mcq"})


def build_mcq_task(splits: Mapping[str, str], *, corpus: str | None = None,
                   max_questions: int | None = None) -> Task:
    """Multiple-choice jsonl files ({split: file}) as a Task scored on option letters."""
    if not splits:
        raise ValueError("mcq task: give splits={split: file.jsonl}, e.g. {train: medqa_train.jsonl}")
    qs = {s: _cap([_mcq_question(r, i, f) for i, r in enumerate(read_jsonl(f, MCQ_FIELDS))],
                  max_questions) for s, f in splits.items()}
    return Task("mcq", read_corpus_jsonl(corpus) if corpus else [], qs, reward="mcq")


def all_questions(task: Task, splits: Sequence[str] | None = None) -> list[Question]:
    """The questions of `splits` (default: all) in split order."""
    return [q for s in (splits or list(task.splits)) for q in task.split(s)]
