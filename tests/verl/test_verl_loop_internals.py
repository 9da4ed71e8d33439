"""The end-to-end harness's hold on verl (tests/verl/loop/): every verl internal it touches is
still there (a verl upgrade that moves one fails here, naming it), the plugin registers what it
should in a fresh process — the CPU platform only when asked — and the device selection of the
harness (CPU here; one CUDA GPU with STPPO_TEST_DEVICE=cuda) picks the right settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loop import harness as H
from loop import plugin as P

VERL_TESTS = Path(__file__).resolve().parent

PROBE = """
import json, os, sys
import verl  # loads loop.autoload (VERL_USE_EXTERNAL_MODULES)
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl.utils.device import get_device_name
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers import engine_workers
from verl.utils import model as verl_model
out = {"device": get_device_name(), "platforms": list(PlatformRegistry.registered_names()),
       "adapter": get_rollout_class("stppo_hf").__qualname__,
       "replica": RolloutReplicaRegistry.get("stppo_hf").__qualname__,
       "gloo_wrapper": getattr(engine_workers.initialize_global_process_group_ray, "_stppo_gloo_wrapper", False),
       "sdpa_critic": getattr(verl_model.load_valuehead_model, "_stppo_sdpa_value_model", False)}
if out["gloo_wrapper"]:
    import socket
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    engine_workers.initialize_global_process_group_ray(timeout_second=60)
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
print(json.dumps(out))
"""


def _fresh_process(env: dict[str, str]) -> dict:
    """PROBE in a new verl process with the harness's environment for one device."""
    base = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env, "GLOO_SOCKET_IFNAME": "lo"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_plugin_changes_nothing_in_verl():
    from verl.utils import model as verl_model
    from verl.workers.rollout import base

    assert ("stppo_hf", "async") not in base._ROLLOUT_REGISTRY
    assert not getattr(verl_model.load_valuehead_model, "_stppo_sdpa_value_model", False)


def test_every_verl_internal_the_harness_touches_is_there():
    problems = P.check_verl_internals()
    assert problems == [], ("verl changed what tests/verl/loop/plugin.py relies on (its docstring lists "
                            f"each and why): {problems}")


def test_a_missing_rollout_registry_fails_with_a_message_naming_it(monkeypatch):
    from verl.workers.rollout import base

    monkeypatch.delattr(base, "_ROLLOUT_REGISTRY")
    with pytest.raises(RuntimeError, match=r"_ROLLOUT_REGISTRY is gone or changed shape .*tests/verl/loop/plugin.py"):
        P.register_rollout()
    assert P.check_verl_internals()[0].startswith("verl.workers.rollout.base._ROLLOUT_REGISTRY")


def test_the_cpu_run_gets_the_cpu_platform_the_hf_rollout_and_gloo():
    got = _fresh_process(H.process_env("cpu"))
    assert got["device"] == "cpu" and "stppo_cpu" in got["platforms"]
    assert (got["adapter"], got["replica"]) == ("HFServerAdapter", "HFReplica")
    assert got["gloo_wrapper"] and got["backend"] == "gloo"  # verl's start-up, a backend torch takes
    assert got["sdpa_critic"]  # no flash-attn on this machine: verl's critic under sdpa


def test_the_cuda_run_keeps_verls_own_platform_with_the_hf_rollout():
    """STPPO_TEST_DEVICE=cuda: no CPU platform, no gloo wrapper — verl's CUDA platform resolves
    (here, without a GPU, to verl's 'nvidia' fallback) — but the HF rollout is registered."""
    got = _fresh_process(H.process_env("cuda"))
    assert got["device"] == "cuda" and "stppo_cpu" not in got["platforms"]
    assert (got["adapter"], got["replica"]) == ("HFServerAdapter", "HFReplica") and not got["gloo_wrapper"]


def test_device_settings_differ_only_where_the_device_does():
    cpu, cuda = H.device_settings("cpu"), H.device_settings("cuda")
    assert cpu.env == {"VERL_PLATFORM": "stppo_cpu", "GLOO_SOCKET_IFNAME": "lo"} and cpu.ray_gpus == 2
    assert cuda.env == {} and cuda.ray_gpus is None and cuda.overrides == ("trainer.device=cuda",)
    assert "trainer.device=cpu" in cpu.overrides and any("mixed_precision" in o for o in cpu.overrides)
    common = set(H.verl_overrides("cpu", Path("/r"))) & set(H.verl_overrides("cuda", Path("/r")))
    assert "actor_rollout_ref.rollout.name=stppo_hf" in common and "trainer.rollout_data_dir=/r" in common
    assert H.process_env("cuda")["VERL_USE_EXTERNAL_MODULES"] == "loop.autoload"
    assert H.process_env("cuda")["PYTHONPATH"] == str(VERL_TESTS)
    with pytest.raises(ValueError, match="STPPO_TEST_DEVICE='tpu': one of cpu, cuda"):
        H.device_settings("tpu")


def test_verl_overrides_survive_hydras_list_grammar():
    """backend.overrides=[…] as the harness writes it composes back to the same strings."""
    from stppo.config import compose

    for items in (H.verl_overrides("cpu", Path("/tmp/r o"), hydra_dir=Path("/tmp/h")),
                  H.verl_overrides("cuda", None, stale=True)):
        cfg = compose(["backend=verl", f"backend.overrides={H.hydra_list(items)}"])
        assert list(cfg.backend.overrides) == items
    stale = H.verl_overrides("cpu", Path("/r"), stale=True)
    assert "actor_rollout_ref.rollout.checkpoint_engine.backend=stppo_object_store" in stale
    assert not any(o.startswith("trainer.rollout_data_dir=") for o in stale)  # verl 0.9.1's one-step trainer
