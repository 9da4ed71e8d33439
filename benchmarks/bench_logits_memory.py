"""Peak memory of the LM head's log-probs and entropies, forward and backward, in one pass over
every position vs in chunks (`stppo.models.logprobs.head_log_probs`, `model.logits_chunk`).

Prints, measured in one run (each side in a fresh process, the same shapes):
  logits_peak_one_pass_gib: X   peak memory above the inputs and weights while computing the
                                log-probs and entropies of M positions under a V-row head and
                                back-propagating them (CPU: peak RSS, reset before; CUDA:
                                max_memory_allocated)
  logits_peak_chunked_gib: Y    the same with the automatic chunk (256 MiB of float32 logits)
  logits_peak_ratio: X / Y

    python benchmarks/bench_logits_memory.py [--positions 2048] [--hidden 896] [--device cuda]

Default shapes: Qwen2.5-0.5B's head (151,936 × 896) over 2,048 agent positions (e.g. 8 rows of
256 agent tokens; one (M, V) float32 tensor is 1.16 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(positions: int, hidden: int, vocab: int, chunk: int, device: str) -> float:
    """GiB above the setup's memory at the peak of one forward + backward of the head."""
    from stppo.models.logprobs import head_log_probs

    torch.manual_seed(0)
    dev = torch.device(device)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev)
    h = torch.randn(positions, hidden, device=dev, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,), device=dev)
    head.weight.grad = torch.zeros_like(head.weight)  # allocated before the measurement
    h.grad = torch.zeros_like(h)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current
        base = _rss_kib("VmRSS") * 1024
    lp, ent = head_log_probs(h, head, targets, chunk=chunk, entropy=True)
    (lp.sum() + ent.sum()).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _rss_kib("VmHWM") * 1024
    return (peak - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)  # child: the chunk
    a = ap.parse_args()
    if a.side is not None:
        torch.set_num_threads(1)
        print(json.dumps(measure(a.positions, a.hidden, a.vocab, a.side, a.device)))
        return
    from stppo.models.logprobs import LOGITS_CHUNK_BYTES

    auto = max(1, LOGITS_CHUNK_BYTES // (4 * a.vocab))
    out = {}
    for name, chunk in (("one_pass", a.positions), ("chunked", auto)):
        p = subprocess.run([sys.executable, __file__, "--side", str(chunk), "--positions",
                            str(a.positions), "--hidden", str(a.hidden), "--vocab", str(a.vocab),
                            "--device", a.device], capture_output=True, text=True, check=True,
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"shapes: {a.positions} positions, head {a.vocab} x {a.hidden}, chunk {auto}, "
          f"one (M, V) float32 tensor {a.positions * a.vocab * 4 / 2**30:.2f} GiB ({a.device})")
    print(f"logits_peak_one_pass_gib: {out['one_pass']:.2f}")
    print(f"logits_peak_chunked_gib: {out['chunked']:.2f}")
    print(f"logits_peak_ratio: {out['one_pass'] / out['chunked']:.1f}")


if __name__ == "__main__":
    main()
