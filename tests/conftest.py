"""Shared test fixtures. Caches (tokenizers, bm25 indexes, warm starts) live in one session-wide
temporary folder, so tests that build the same tiny setup share it, as a study's runs would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from servers import free_port, wait_healthy  # noqa: F401 (re-exported: `from conftest import ...`)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
VERL_TESTS = ROOT / "tests" / "verl"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/verl run in .venv-verl only, and only when named (`make test` runs
    `.venv-verl/bin/python -m pytest tests/verl`): a plain `pytest` in stppo's .venv skips them."""
    if collection_path == VERL_TESTS:
        named = (Path(a.split("::")[0]).resolve() for a in config.args)
        if not any(p == VERL_TESTS or VERL_TESTS in p.parents for p in named):
            return True
    return None


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """One cache for the whole session; under pytest-xdist the workers share it (its entries are
    content-addressed and written under a lock or atomically, as a study's parallel jobs do)."""
    if "STPPO_CACHE_DIR" not in os.environ:
        if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is per worker; its parent is shared
            cache = tmp_path_factory.getbasetemp().parent / "stppo_cache"
            cache.mkdir(exist_ok=True)
        else:
            cache = tmp_path_factory.mktemp("stppo_cache")
        os.environ["STPPO_CACHE_DIR"] = str(cache)
    yield


# Torch threads of an in-process run: the suite's own (OMP_NUM_THREADS, which `make test` and
# `make test-portable` set), so a run inside a test does not change the thread count of the
# tests after it; 1 when unset.
THREADS = f"trainer.threads={os.environ.get('OMP_NUM_THREADS', '1')}"


def pytest_report_header(config) -> str:
    import torch

    return (f"torch {torch.__version__}: {torch.get_num_threads()} thread(s), CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY="
            f"{os.environ.get('ATEN_CPU_CAPABILITY', 'unset')})")


# A tiny but complete training setup: 1-hop questions of the default world, a warm start that
# reaches ~0.4 greedy / ~0.2 sampled success (so groups have mixed outcomes), two RL steps.
TINY_OVERRIDES = [
    "model=tiny",
    "task.options.n_people=180", "task.options.n_cities=60", "task.options.n_countries=15",
    "task.options.n_orgs=45", "task.options.n_distractors=300", "task.options.n_sft=200", "task.options.n_train=100", "task.options.n_val=16",
    "task.options.n_test=16", "task.options.hop_mix=[1.0,0.0,0.0]",
    "trainer.total_steps=2", "trainer.questions_per_step=4", "trainer.group_size=4",
    "trainer.minibatch_size=8", "trainer.val_every=0", "trainer.val_questions=16",
    "trainer.save_every=0", "trainer.progress=false", THREADS,
    "trainer.warmstart.steps=400", "trainer.warmstart.batch_size=32", "trainer.warmstart.lr=3e-3",
    "trainer.rollout.max_new_tokens=16",
]


# `STPPO_TEST_DEVICE=cuda pytest tests/test_precision.py` runs the tests that compose the tiny
# setup on a GPU machine (scripts/gpu_run.sh does); unset, they run on the config's device.
TEST_DEVICE = os.environ.get("STPPO_TEST_DEVICE")


def compose(overrides: list[str]):
    from stppo.config import compose as _compose

    return _compose(overrides + ([f"trainer.device={TEST_DEVICE}"] if TEST_DEVICE else []))


@pytest.fixture
def tiny_cfg(tmp_path):
    """compose(extra) → a DictConfig of the tiny setup logging to a fresh sqlite store."""
    def make(*extra: str):
        return compose(TINY_OVERRIDES + [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                         f"tracking.buffer_dir={tmp_path}/buffer",  # not the cwd's, shared
                                         f"trainer.out_dir={tmp_path}/runs", *extra])
    return make
