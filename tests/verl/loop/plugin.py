"""TEST-ONLY verl plugin of the end-to-end harness: `load()` runs in every process of a verl run,
through `VERL_USE_EXTERNAL_MODULES=loop.autoload` (with `tests/verl` on PYTHONPATH; `harness.py`
sets both). Importing this module changes nothing (the tests check it). Never imported by stppo.

`load()` registers, in its process:
  - always: the HF rollout (`hf_rollout.py`) — its replica with `RolloutReplicaRegistry.register`
    and its worker-side `BaseRollout` adapter, so that `actor_rollout_ref.rollout.name=stppo_hf`
    works without vLLM / SGLang;
  - with `VERL_PLATFORM=stppo_cpu` (the CPU run): the CPU platform with `PlatformRegistry`
    (`cpu_platform.register_cpu_platform`, which also registers verl's FSDP engines for device
    "cpu"), and the gloo start-up of the process group;
  - where the flash-attn package is missing: verl's critic built under sdpa attention (5. below).

Every verl internal the harness touches — each checked by `check_verl_internals()`, which
`test_verl_loop_internals.py` runs, so that a verl upgrade that moves one fails with its name:

  1. `verl.workers.rollout.base._ROLLOUT_REGISTRY` (private dict, (name, mode) → "module.Class"):
     `get_rollout_class` has no public registration; the adapter is added there, only here.
  2. `verl.utils.distributed.initialize_global_process_group_ray(timeout_second, backend)` and
     its binding in `verl.workers.engine_workers` (imported by name): on a CPU platform verl
     builds the backend "cpu:gloo,cpu:gloo", which torch rejects (duplicate device). The wrapper
     passes backend="gloo" — the same rendezvous (verl's MASTER_ADDR / MASTER_PORT, RANK,
     WORLD_SIZE), a backend string torch takes. Installed before `engine_workers` is imported
     (`import verl` loads this plugin first), and patched there too if it already was.
  3. `verl.workers.engine.base.EngineRegistry.register(model_type, backend, device)` and
     `verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead / FSDPEngineWithValueHead`
     (public registry, verl's own classes, registered once more for device "cpu").
  4. `verl.plugin.platform.platform_manager.PlatformRegistry.register` and
     `verl.plugin.platform.platform_cuda.PlatformCUDA` (the CPU platform subclasses it).
  5. `verl.utils.model.load_valuehead_model(local_path, torch_dtype, model_config,
     trust_remote_code)`, which the FSDP engine imports at call time to build the critic: it
     hard-codes `attn_implementation="flash_attention_2"` (its fallback through trl too), so
     without the flash-attn package (any CPU; a CUDA machine without it) the critic cannot be
     built. Where flash-attn is missing the plugin replaces it with verl's own first branch
     (`AutoModelForTokenClassification.from_pretrained`, num_labels = 1 set by the engine)
     under `attn_implementation="sdpa"`, the attention the actor gets from
     `model.override_config.attn_implementation`.
  6. `verl.workers.rollout.replica.RolloutReplicaRegistry.register(name, loader)`,
     `RolloutReplica` (its `workers`, `replica_rank`, `name_suffix`, `config`, `model_config`,
     `max_concurrency`, `servers`, `_server_handle`, `_server_address`: read by verl's
     `LLMServerManager`), `TokenOutput`, and `BaseRollout` (public base classes).
  7. The stale job only (`ckpt_engine.py`, loaded by verl's own config key
     `actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module`):
     `verl.checkpoint_engine.base.CheckpointEngine` (its abstract methods prepare,
     build_topology, init_process_group, finalize, send_weights, receive_weights) and
     `CheckpointEngineRegistry.register(backend)`.
Not internals, but verl behaviour the test reads: `trainer.rollout_data_dir`'s `<step>.jsonl`
dumps (key "output"), verl's metric `training/rollout_probs_diff_max`, its checkpoint layout
`global_step_<n>/actor/model_world_size_1_rank_0.pt`, and one bug of 0.9.1 avoided
(`OneStepOffRayTrainer` has no `_dump_executor`, so the stale job dumps no trajectories).
"""

from __future__ import annotations

import os
import sys

CPU_PLATFORM = "stppo_cpu"  # == cpu_platform.PLATFORM_NAME; VERL_PLATFORM of the CPU run
REPLICA_NAME = "stppo_hf"  # actor_rollout_ref.rollout.name of the HF test rollout
ADAPTER = "loop.hf_rollout.HFServerAdapter"
_GLOO_MARK = "_stppo_gloo_wrapper"
_SDPA_MARK = "_stppo_sdpa_value_model"


def register_rollout() -> None:
    """The HF rollout's replica (public registry) and worker-side adapter (private dict, 1.)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    registry = _rollout_registry(base)  # fails first, registering nothing, when verl moved it
    RolloutReplicaRegistry.register(REPLICA_NAME, _replica_class)
    registry[(REPLICA_NAME, "async")] = ADAPTER


def _replica_class():
    """Imported on use: a process whose first import is `loop.hf_rollout` (Ray unpickling its
    server) imports verl, hence this plugin, while that module is half-initialised."""
    from loop.hf_rollout import HFReplica

    return HFReplica


def _rollout_registry(base) -> dict:
    reg = getattr(base, "_ROLLOUT_REGISTRY", None)
    if not isinstance(reg, dict) or ("vllm", "async") not in reg:
        raise RuntimeError("verl.workers.rollout.base._ROLLOUT_REGISTRY is gone or changed shape (verl "
                           f"{_verl_version()}): the HF test rollout cannot register its BaseRollout adapter; "
                           "update tests/verl/loop/plugin.py to verl's new rollout registration")
    return reg


def use_gloo_process_group() -> None:
    """2.: verl's process-group start-up with backend "gloo" on the CPU platform (idempotent)."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, _GLOO_MARK, False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    setattr(initialize_global_process_group_ray, _GLOO_MARK, True)
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    workers = sys.modules.get("verl.workers.engine_workers")
    if workers is not None:
        workers.initialize_global_process_group_ray = initialize_global_process_group_ray


def use_sdpa_value_model() -> None:
    """5.: build the critic with sdpa attention where flash-attn is not installed (idempotent)."""
    import importlib.util

    from verl.utils import model as verl_model

    if importlib.util.find_spec("flash_attn") is not None:
        return  # verl's own loader works
    if getattr(verl_model.load_valuehead_model, _SDPA_MARK, False):
        return

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation="sdpa", trust_remote_code=trust_remote_code)

    setattr(load_valuehead_model, _SDPA_MARK, True)
    verl_model.load_valuehead_model = load_valuehead_model


def check_verl_internals() -> list[str]:
    """What of 1.–7. this verl lacks (empty: all there); imports verl."""
    import inspect

    problems = []
    from verl.workers.rollout import base

    reg = getattr(base, "_ROLLOUT_REGISTRY", None)
    if not (isinstance(reg, dict) and isinstance(reg.get(("vllm", "async")), str)):
        problems.append("verl.workers.rollout.base._ROLLOUT_REGISTRY: no dict of (name, mode) -> 'module.Class'")
    from verl.utils import distributed

    init = getattr(distributed, "initialize_global_process_group_ray", None)
    if init is None or not {"timeout_second", "backend"} <= set(inspect.signature(init).parameters):
        problems.append("verl.utils.distributed.initialize_global_process_group_ray(timeout_second, backend)")
    from verl.workers import engine_workers

    if getattr(engine_workers, "initialize_global_process_group_ray", None) is None:
        problems.append("verl.workers.engine_workers.initialize_global_process_group_ray (imported by name)")
    from verl.utils import model as verl_model

    load = getattr(verl_model, "load_valuehead_model", None)
    wanted = ["local_path", "torch_dtype", "model_config", "trust_remote_code"]
    if load is None or list(inspect.signature(load).parameters) != wanted:
        problems.append("verl.utils.model.load_valuehead_model(local_path, torch_dtype, model_config, "
                        "trust_remote_code)")
    problems += _check_public_names()
    return problems


def _check_public_names() -> list[str]:
    import importlib

    wanted = {"verl.workers.engine.base": ["EngineRegistry"],
              "verl.workers.engine.fsdp.transformer_impl": ["FSDPEngineWithLMHead", "FSDPEngineWithValueHead"],
              "verl.plugin.platform.platform_manager": ["PlatformRegistry", "set_platform"],
              "verl.plugin.platform.platform_cuda": ["PlatformCUDA"],
              "verl.workers.rollout.replica": ["RolloutReplicaRegistry", "RolloutReplica", "TokenOutput"],
              "verl.workers.rollout.base": ["BaseRollout", "get_rollout_class"],
              "verl.checkpoint_engine.base": ["CheckpointEngine", "CheckpointEngineRegistry"]}
    missing = []
    for module, names in wanted.items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    from verl.workers.rollout.replica import RolloutReplica

    init = RolloutReplica.__init__
    import inspect

    if not {"replica_rank", "config", "model_config", "name_suffix"} <= set(inspect.signature(init).parameters):
        missing.append("verl.workers.rollout.replica.RolloutReplica.__init__(replica_rank, config, model_config, "
                       "..., name_suffix)")
    from verl.checkpoint_engine.base import CheckpointEngine

    wanted_abstract = {"prepare", "build_topology", "init_process_group", "finalize", "send_weights",
                       "receive_weights"}
    if set(CheckpointEngine.__abstractmethods__) != wanted_abstract:
        missing.append(f"verl.checkpoint_engine.base.CheckpointEngine's abstract methods: {sorted(wanted_abstract)}, "
                       f"now {sorted(CheckpointEngine.__abstractmethods__)}")
    return missing


def _verl_version() -> str:
    import verl

    return getattr(verl, "__version__", "?")


def load() -> None:
    """Everything above for this process (`loop.autoload` calls it when verl is imported)."""
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == CPU_PLATFORM:
        from cpu_platform import register_cpu_platform

        register_cpu_platform()
        use_gloo_process_group()
    use_sdpa_value_model()
    register_rollout()
