"""TEST-ONLY: run verl 0.9.1's FSDP actor on the CPU (gloo, one rank). Never import this in stppo.

verl has no CPU platform: `verl.plugin.platform` knows cuda / npu / rocm, and the FSDP engine is
registered for devices cuda and npu only (`EngineRegistry.register(..., device=["cuda", "npu"])`
in `workers/engine/fsdp/transformer_impl.py`). `use_cpu_platform()` makes verl see a CPU device:

- `CPUPlatform`: verl's `PlatformCUDA` reporting device "cpu", the gloo backend, the current device
  "cpu" (verl moves modules with `.to(get_device_id())`), and as device module `torch.cpu` plus
  the memory queries verl logs (always 0) and the device name its FLOP counter reads;
- the FSDP engines (language model: actor and reference; value model: critic) registered once
  more for device "cpu".

Two ways in: `use_cpu_platform()` sets the platform of this process (the actor-update tests, one
process); `register_cpu_platform()` registers it with verl's `PlatformRegistry` as
`PLATFORM_NAME`, which `VERL_PLATFORM=stppo_cpu` then selects in every process of a Ray run
(`loop/plugin.py`, loaded by `VERL_USE_EXTERNAL_MODULES`). Either must run before anything calls
`verl.plugin.platform.get_platform()` (the platform is resolved once per process); the tests'
conftest calls neither, the actor-update module calls the first at import.
"""

from __future__ import annotations

import torch

PLATFORM_NAME = "stppo_cpu"
_DONE = False
_ENGINES = False


class _CPUDeviceModule:
    """`torch.cpu` plus what verl asks of a device module that `torch.cpu` lacks."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def _zero(*args, **kwargs) -> int:
        return 0

    memory_allocated = memory_reserved = max_memory_allocated = max_memory_reserved = _zero

    @staticmethod
    def mem_get_info(*args, **kwargs) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(*args, **kwargs) -> None:
        return None

    @staticmethod
    def get_device_name(*args, **kwargs) -> str:
        return "CPU"


def _platform_class():
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CPUPlatform(PlatformCUDA):
        device_name = "cpu"
        device_module = _CPUDeviceModule()

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def communication_backend_name(self) -> str:
            return "gloo"

        def set_allocator_settings(self, settings: str) -> None:
            return None  # CUDA's caching allocator only

        def is_ipc_supported(self) -> bool:
            return False  # no CUDA IPC between the trainer and a rollout server on the CPU

    return CPUPlatform


def register_engines() -> None:
    """verl's FSDP engines for device "cpu": the language model (actor, reference) and the value
    model (critic); verl registers them for cuda and npu only (idempotent)."""
    global _ENGINES
    if _ENGINES:
        return
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        FSDPEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device="cpu")(
        FSDPEngineWithValueHead)
    _ENGINES = True


def register_cpu_platform() -> None:
    """Register the CPU platform with verl's PlatformRegistry (selected by VERL_PLATFORM=stppo_cpu)
    and the FSDP engines for it."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register(platform=PLATFORM_NAME)(_platform_class())
    register_engines()


def use_cpu_platform() -> None:
    """Make verl's platform the CPU and register its FSDP engine for it (idempotent)."""
    global _DONE
    if _DONE:
        return
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(_platform_class()())
    register_engines()
    _DONE = True
