"""backend=verl: which verl trainer a run gets, and a missing dependency of it as one line before
Ray starts (stppo's environment; verl only as the `.venv-verl` interpreter the launcher probes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stppo.config import compose, to_config
from stppo.integrations.verl import launcher as L
from stppo.integrations.verl import overrides as O

ROOT = Path(__file__).resolve().parents[1]
VERL_PY = ROOT / ".venv-verl" / "bin" / "python"
BASE = ["backend=verl", "model=qwen2_5_0_5b"]


def cfg_of(*extra: str):
    return to_config(compose([*BASE, *extra]))


def test_stppo_runs_verls_legacy_trainer_unless_only_v1_is_right():
    """trainer.use_v1=false (RayPPOTrainer, no TransferQueue) by default; v1 for bypass mode,
    which the legacy trainer cannot run with stppo's loss; an override of the user wins."""
    assert not O.uses_v1(cfg_of()) and not O.uses_v1(cfg_of("algo.rollout_correction=decoupled_token_is"))
    assert O.uses_v1(cfg_of("algo.rollout_correction=bypass_ppo_clip"))
    assert O.uses_v1(cfg_of("backend.overrides=['trainer.use_v1=true']"))
    assert not O.uses_v1(cfg_of("trainer.offpolicy.lag=1", "backend.n_gpus_per_node=2"))  # its own trainer
    files = O.JobFiles("/d/train.parquet", "/d/val.parquet", "/d/tools.yaml", "/ckpt")
    assert "trainer.use_v1=false" in O.verl_overrides(cfg_of(), files)
    assert "trainer.use_v1=true" in O.verl_overrides(cfg_of("algo.rollout_correction=bypass_ppo_clip"), files)
    stale = O.verl_overrides(cfg_of("trainer.offpolicy.lag=1", "backend.n_gpus_per_node=2"), files)
    assert not any(o.startswith("trainer.use_v1=") for o in stale)


def test_the_packages_a_run_needs_are_named_with_their_install():
    assert L.required_packages(cfg_of()) == {
        "vllm": "the vllm rollout engine (backend.rollout_engine=vllm): pip install 'verl[vllm]'"}
    assert set(L.required_packages(cfg_of("backend.rollout_engine=sglang"))) == {"sglang"}
    v1 = L.required_packages(cfg_of("algo.rollout_correction=bypass_ppo_clip"))
    assert v1["transfer_queue"] == ("verl's v1 trainer (trainer.use_v1=true) imports it: "
                                    "pip install 'TransferQueue>=0.1.10'")
    plugin_engine = "backend.overrides=['actor_rollout_ref.rollout.name=my_engine']"  # a verl plugin's engine
    assert L.required_packages(cfg_of(plugin_engine)) == {} and O.rollout_engine(cfg_of(plugin_engine)) == "my_engine"


def test_the_probe_names_the_modules_the_verl_environment_lacks():
    if not VERL_PY.exists():
        pytest.fail(f"{VERL_PY} is missing: run `make verl-env`")
    got = L.probe(str(VERL_PY), modules=("torch", "no_such_module_stppo"))
    assert got["missing"] == ["no_such_module_stppo"] and got["gpus"] == 0 and got["verl"]


def test_a_missing_rollout_engine_is_one_line_and_exit_1_before_ray_starts(tmp_path):
    """The user's command on a node whose verl has no vLLM (verl's device set to the CPU so that
    this GPU-less machine passes the GPU check): one line naming the package, exit 1, no Ray,
    the MLflow run FAILED with the same line."""
    from mlflow import MlflowClient

    if not VERL_PY.exists():
        pytest.fail(f"{VERL_PY} is missing: run `make verl-env`")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = subprocess.run([sys.executable, "run.py", "backend=verl", f"model.path={model}", f"backend.python={VERL_PY}",
                          "backend.overrides=['trainer.device=cpu']", f"tracking.uri={uri}", "tracking.experiment=pre",
                          f"hydra.run.dir={tmp_path / 'hydra'}", f"backend.data_dir={tmp_path / 'data'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == (f"run.py: error: the verl environment ({VERL_PY}) has no module 'vllm': the vllm rollout "
                         "engine (backend.rollout_engine=vllm): pip install 'verl[vllm]'")
    assert "Traceback" not in out.stderr and "ray" not in out.stderr.lower()
    assert not (tmp_path / "data").exists()  # stopped before the data conversion, long before Ray
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pre").experiment_id])
    assert run.info.status == "FAILED" and "has no module 'vllm'" in run.data.tags["error"]
