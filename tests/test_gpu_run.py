"""`scripts/gpu_run.sh`, the one GPU run, as a CPU dry run (GPU_RUN_DRY=1: the device check
accepts this CPU, every part runs its tiny CPU version), so the script a lent GPU runs cannot rot:
every part's commands run and pass, the parts whose packages are not here (TRL, verl in this
environment) are skipped by name, the figures reach summary.json, and a part whose budget does
not fit in what is left of the deadline is not started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smollm2_stand_in import write_stand_in

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["static-tests", "bench-rollout", "smollm2-steps", "smollm2-learn", "sizes", "trl", "verl-loop", "verl-update"]
pytestmark = pytest.mark.timeout(1800)


def gpu_run(out: Path, deadline: int, stand_in: Path, cache: Path) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "GPU_RUN_DRY": "1", "OUT": str(out), "DEADLINE_S": str(deadline), "PYTHON": sys.executable,
           "GPU_RUN_STAND_IN": str(stand_in), "STPPO_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1700)
    return p, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    return write_stand_in(tmp_path_factory.mktemp("stand_in"))


def test_a_part_that_does_not_fit_the_deadline_is_not_started(stand_in, tmp_path):
    p, summary = gpu_run(tmp_path / "out", 5, stand_in, tmp_path / "cache")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert summary["device"].startswith("CPU (dry run), torch ") and list(summary["parts"]) == ORDER
    for name, part in summary["parts"].items():
        assert part["status"] == "not_started" and "s left of the deadline, it needs up to" in part["reason"], name
    assert not list((tmp_path / "out").glob("*.log"))  # nothing ran


def test_the_dry_run_runs_every_part_end_to_end(stand_in, tmp_path):
    """A deadline that fits every part (on a GPU the default is 480 s)."""
    p, summary = gpu_run(tmp_path / "out", 1500, stand_in, tmp_path / "cache")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    parts = summary["parts"]
    assert list(parts) == ORDER and p.stdout.rstrip().splitlines()[-1].startswith("gpu_run: no part failed")
    for name in ORDER[:5]:
        assert parts[name]["status"] == "ok", (name, parts[name], (tmp_path / "out" / f"{name}.log").read_text()[-3000:])
        assert (tmp_path / "out" / parts[name]["log"]).is_file()
    for name, lacks in (("trl", "trl"), ("verl-loop", "verl"), ("verl-update", "verl")):  # not in stppo's .venv
        assert parts[name]["status"] == "skipped" and f"cannot import {lacks}" in parts[name]["reason"], parts[name]
    figures = {name: "\n".join(parts[name]["figures"]) for name in ORDER}
    assert "rollout_over_generate: " in figures["bench-rollout"]
    assert "gpu_figures: static" in figures["smollm2-steps"] and "gpu_figures: eager" in figures["smollm2-steps"]
    assert "gpu_figures: ppo" in figures["smollm2-learn"] and "gpu_figures: st_ppo" in figures["smollm2-learn"]
    assert "gpu_figures: tiny" in figures["sizes"]


def test_without_cuda_the_gpu_run_ends_in_one_line_and_nonzero(tmp_path):
    """`make gpu-check` on a machine without CUDA (and no .gpu parts): the device check's one
    line, exit non-zero, before any part runs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the whole check")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    env.pop("GPU_RUN_DRY", None)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("gpu_run: no CUDA device"), out.stderr[-1000:]
    assert not list((tmp_path / "out").glob("*.log"))
