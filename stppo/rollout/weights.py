"""The sampler's weights: what the static decoding path reads (`static.py`).

Under autocast to a lower compute dtype (bfloat16 on CUDA) with float32 master weights, the
rollout decodes with a copy of the policy held in the compute dtype — as an inference engine
holds its own weights — instead of casting every weight at every matrix product. The copy is
refreshed in place (`torch._foreach_copy_`, one kernel per dtype group) whenever the policy's
parameters changed since the last refresh (their version counters moved: an optimizer step, a
checkpoint load, a rollback), so captured CUDA graphs keep valid pointers. Otherwise (float32
compute) the policy itself is the sampler.
"""

from __future__ import annotations

import copy
import weakref
from typing import Optional

import torch
from torch import nn

_COPIES: "weakref.WeakKeyDictionary[nn.Module, SamplerWeights]" = weakref.WeakKeyDictionary()


def compute_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The autocast dtype on the model's device when autocast is on and differs from the
    parameters' dtype; None otherwise."""
    p = next(model.parameters())
    device = p.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype != p.dtype and p.dtype == torch.float32 else None


class SamplerWeights:
    """A copy of `policy` in `dtype` (eval mode, no gradients), refreshed by `sync`."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        for p in self.model.parameters():  # buffers (rotary frequencies) keep their float32
            p.data = p.data.to(dtype)
        self._version: Optional[int] = None
        self.sync(policy)

    def sync(self, policy: nn.Module) -> nn.Module:
        """Copy the policy's parameters in place if they changed; returns the copy."""
        src = list(policy.parameters())
        version = sum(p._version for p in src)
        if version != self._version:
            with torch.no_grad():
                torch._foreach_copy_(list(self.model.parameters()), src)
            self._version = version
        return self.model


def sampler_model(policy: nn.Module) -> nn.Module:
    """The model the static path decodes with: the policy, or its low-precision copy under
    autocast (kept per policy, synced to its current weights)."""
    dtype = compute_dtype(policy)
    if dtype is None:
        return policy
    held = _COPIES.get(policy)
    if held is None or held.dtype != dtype:
        held = _COPIES[policy] = SamplerWeights(policy, dtype)
    return held.sync(policy)
