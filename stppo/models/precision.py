"""Mixed precision: float32 master weights, low-precision compute under autocast.

    parameters, gradients, optimizer state   param_dtype    (float32 unless asked otherwise)
    forward / backward matmuls               compute_dtype  (autocast; bfloat16 on CUDA)
    LM head, log-softmax, entropy, values    float32        (from float32 hidden states)

Why master weights: AdamW's update at the paper's lr 1e-6 is ~1e-6 of a weight of order 1e-2,
far below bfloat16's resolution (2^-8 ≈ 0.4% relative), so stepping bfloat16 parameters directly
rounds almost every update away (measured: 20 steps at lr 1e-6 change 1.9% of a bf16 896×896
layer's weights, against 99.99% in float32). Why float32 heads: importance ratios are
exp(log π_θ − log π_old) of two recomputations; bfloat16 logits give log-probs with errors of
~1e-2, i.e. ratios that are bf16 noise (verl computes log-probs from float32 logits too).

`model.dtype` in the config is the compute dtype (`auto`: bfloat16 on CUDA that supports it,
float32 elsewhere; `native_bf16`: bfloat16 wherever the device computes it natively — CUDA with
bf16 support, or a CPU with AVX-512-BF16 or AMX, as torch reports them — float32 elsewhere);
`model.param_dtype` the parameter dtype (`auto`: float32). Pure low-precision parameters only when
asked for explicitly, with one warning. `auto` keeps float32 on every CPU, so a CPU study's
numbers do not depend on which instructions its host has; `native_bf16` is for speed (a
pretrained model on a CPU: bf16 matmuls run about twice as fast where the CPU has them, and
emulated bf16 is slower than float32).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_PRECISION_PARAMS_WARNING = (
    "model.param_dtype={dtype}: parameters and AdamW state are held in {dtype}; updates smaller "
    "than ~0.4% of a weight round away (at lr 1e-6 most weights never change). Leave "
    "model.param_dtype=auto (float32 master weights, {dtype} compute) unless you need the memory.")


@dataclass(frozen=True)
class Precision:
    """The precision policy of a run: parameter dtype, compute dtype, device type."""

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    @property
    def mixed(self) -> bool:
        """True when matmuls run in a lower precision than the parameters (autocast on)."""
        return self.compute_dtype != self.param_dtype and self.compute_dtype != torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward runs in: autocast to `compute_dtype` when mixed, else none."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def describe(self) -> str:
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        return f"params {name(self.param_dtype)}, compute {name(self.compute_dtype)}"


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` computes bfloat16 matmuls natively: CUDA with bf16 support, or a CPU with
    AVX-512-BF16 or AMX tiles (torch's own capability report)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _dtype(name: str | torch.dtype | None, field: str, default: torch.dtype) -> torch.dtype:
    if name is None or name == "auto":
        return default
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r} is not valid; allowed: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_precision(dtype: str | torch.dtype | None, param_dtype: str | torch.dtype | None,
                      device: torch.device | str, *, warn: bool = True) -> Precision:
    """`model.dtype` (compute) and `model.param_dtype` → a Precision for `device`.

    compute `auto`: bfloat16 on CUDA with bf16 support, else float32; `native_bf16`: bfloat16
    where `native_bf16(device)`, else float32. params `auto`: float32 —
    master weights — whatever the compute dtype. Explicit low-precision params warn once."""
    device = torch.device(device)
    if dtype == "native_bf16":
        dtype = "bfloat16" if native_bf16(device) else "float32"
    compute = _dtype(dtype, "model.dtype", default_compute_dtype(device))
    params = _dtype(param_dtype, "model.param_dtype", torch.float32)
    if params != torch.float32 and warn:
        log.warning(LOW_PRECISION_PARAMS_WARNING.format(dtype=str(params).removeprefix("torch.")))
    if params != torch.float32 and compute == torch.float32:
        compute = params  # nothing to gain from float32 compute over low-precision weights
    return Precision(params, compute, device.type)


@contextlib.contextmanager
def full_precision(device_type: str):
    """Autocast off: what runs inside computes in its inputs' dtype (float32 heads)."""
    with torch.autocast(device_type, enabled=False):
        yield
