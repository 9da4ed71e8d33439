"""Helpers for equality tests of reorganised computations (micro-batches, ranks, chunks): compare
what a reorganisation can change — gradients before the optimizer, losses, metrics — in float64,
with tolerances relative to the compared tensor's scale. Importable by pytest modules and by the
torchrun script tests/dp_update.py."""

from __future__ import annotations

import torch

# Which weights produced a log-prob: the same weights in another batch shape, cache layout or
# kernel set agree to float32 rounding — ε = 1.2e-7 over the 4 layers and 1,500 logits of `tiny`
# (logits up to |20|) moves a log-prob by at most ~1e-5 — while the policy one update apart
# differs by more than 100× that (tests/test_offpolicy.py asserts it).
FORWARD_TOL = 1e-5


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of every step's gradients, taken before the step. SGD moves a
    weight by lr × gradient, so the rounding of two reorganised gradients reaches the weights
    unchanged; Adam's m/√v would turn rounding noise on a near-zero gradient into a step of ~lr
    (whose size then depends on the CPU's kernels)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                           if p.grad is not None])
        return super().step(closure)


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """Equal up to `rtol` × the largest |entry| of `want`: a sum's rounding is relative to its
    terms, so an entry near 0 among large ones carries the large ones' absolute error."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")
