"""The task registry: `build_task(name, **options)` → `Task`.

  synthetic_multihop  options: the fields of `SyntheticConfig` (seed, sizes, hop_mix, …)
  testbed             the same builder under its own name (conf/task/testbed.yaml: the default
                      world, calibrated in docs/results/testbed)
  search_r1           options: splits={split: file} or data_dir, corpus, max_questions
  hf                  options: name (hub id or local path), splits, question_key, answers_key,
                      id_key, corpus, max_questions, extra `datasets.load_dataset` arguments
  mcq                 options: splits={split: file.jsonl}, corpus, max_questions
"""

from __future__ import annotations

from typing import Any, Callable

from stppo.envs.base import Task
from stppo.registry import Registry

TASKS: Registry[Callable[..., Task]] = Registry("task")


def register_task(name: str):
    """Decorator adding a task builder `fn(**options) -> Task` to the registry."""
    return TASKS.register(name)


@register_task("synthetic_multihop")
def _synthetic(**options: Any) -> Task:
    from stppo.envs.synthetic import build_synthetic_task
    return build_synthetic_task(**options)


@register_task("testbed")
def _testbed(**options: Any) -> Task:
    from stppo.envs.synthetic import build_synthetic_task
    return build_synthetic_task(name="testbed", **options)


@register_task("search_r1")
def _search_r1(**options: Any) -> Task:
    from stppo.envs.datasets import build_search_r1_task
    return build_search_r1_task(**options)


@register_task("hf")
def _hf(**options: Any) -> Task:
    from stppo.envs.datasets import build_hf_task
    if "name" not in options and "path" not in options:
        raise ValueError("hf task: give name=<hub dataset id or local path> (task.options.name)")
    name = options.pop("name", None) or options.pop("path")
    return build_hf_task(name, **options)


@register_task("mcq")
def _mcq(**options: Any) -> Task:
    from stppo.envs.datasets import build_mcq_task
    return build_mcq_task(**options)


def resolved_options(name: str, options) -> dict:
    """The options task `name` is built with, as a run records them: for the synthetic worlds
    every `SyntheticConfig` field (its default where `options` says nothing), checked; for the
    others `options` as given (their builders check them)."""
    if name in ("synthetic_multihop", "testbed"):
        from stppo.envs.synthetic import synthetic_options
        return synthetic_options(name, options)
    return dict(options)


def build_task(name: str, /, **options: Any) -> Task:
    """Build a task by registry name; an unknown name lists the valid ones."""
    if name not in TASKS:
        raise ValueError(f"task name={name!r} is not valid; allowed: {', '.join(TASKS)}")
    try:
        return TASKS[name](**options)
    except TypeError as err:  # an option the builder does not take
        raise ValueError(f"task {name!r}: bad option ({err})") from None
