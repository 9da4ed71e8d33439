"""TEST-ONLY: run verl 0.9.1's FSDP actor on the CPU (gloo, one rank). Never import this in stppo.

verl has no CPU platform: `verl.plugin.platform` knows cuda / npu / rocm, and the FSDP engine is
registered for devices cuda and npu only (`EngineRegistry.register(..., device=["cuda", "npu"])`
in `workers/engine/fsdp/transformer_impl.py`). `use_cpu_platform()` makes verl see a CPU device:

- `CPUPlatform`: verl's `PlatformCUDA` reporting device "cpu", the gloo backend, the current device
  "cpu" (verl moves modules with `.to(get_device_id())`), and as device module `torch.cpu` plus
  the memory queries verl logs (always 0) and the device name its FLOP counter reads;
- the FSDP language-model engine registered once more for device "cpu".

It must run before anything calls `verl.plugin.platform.get_platform()` (the platform is resolved
once per process); the tests' conftest does not call it, the actor-update module does at import.
"""

from __future__ import annotations

import torch

_DONE = False


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

    return CPUPlatform


def use_cpu_platform() -> None:
    """Make verl's platform the CPU and register its FSDP engine for it (idempotent)."""
    global _DONE
    if _DONE:
        return
    from verl.plugin.platform.platform_manager import set_platform
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    set_platform(_platform_class()())
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        FSDPEngineWithLMHead)
    _DONE = True
