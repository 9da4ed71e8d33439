"""Bit identity of the numbers against an earlier commit: every preset's loss, gradients and first
training steps must come out the same, bit for bit, on the same machine.

What it records (one JSON file; floats as exact reprs, tensors as SHA-256 of their bytes):

- `loss/<preset>/<correction>` for every built-in preset × every rollout correction (and a few
  settings more: the dual clip, the clip bias's `grad` estimator, `sequence` granularity): the
  policy loss of one fixed float64 multi-turn batch, its gradient in the log-probs, its metrics,
  and the per-token ρ and κ — through `policy_loss`, with the correction applied as the trainer
  applies it (decoupled: weights and rejection from π_old; bypass: from π_θ against π_rollout,
  π_old := π_rollout, the denominators of all agent tokens);
- `config/<case>` for a matrix of compositions of `conf/` (every named experiment, the frontier's
  levels, the reuse regime, other tasks and models, backend=verl, a few presets): the resolved
  config (`to_config`), every field;
- `train/<case>` for every built-in preset, every rollout correction (on `grpo`, a few on `ppo`)
  and a few trainer settings (stale rollouts, micro-batches, the exact clip bias, the on-policy
  shortcut, KL in the loss and in the reward): the first 3 steps of a quick-style run of the tiny
  model on a small world (tracking off) — every logged metric but the `perf/*` timings, the loss
  of every backward, and the gradients of every optimizer step before clipping (hash and float64
  norm).

Use (from the repository root, stppo's .venv):

    .venv/bin/python scripts/bit_identity.py --against 1e10e16      # record that commit (once, in a
                                                                    # git worktree), then compare
    .venv/bin/python scripts/bit_identity.py record --out REF.json  # record this tree
    .venv/bin/python scripts/bit_identity.py check --ref REF.json   # record this tree, compare
    ... --only loss            # or config, train, train/ppo (a prefix of the case names)

`--against REV` checks out REV into a temporary git worktree and runs `record` there with the
same interpreter and that tree first on PYTHONPATH (it prints which `stppo` it imported), keeping
the reference in the system's temporary folder for the next call (`--refresh` records it again).
Installed stppo plugins are not loaded (they are written against one tree's API). A run of the
whole set takes about 10 minutes on 2 cores. Exit 0 when every case is identical; else each
differing case and its first differing entries, and exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the tiny setup of the train cases: a small 1-hop world, +experiment=quick's schedule
TRAIN_BASE = [
    "model=tiny", "+experiment=quick",
    "task.options.n_people=180", "task.options.n_cities=60", "task.options.n_countries=15",
    "task.options.n_orgs=45", "task.options.n_distractors=300", "task.options.n_sft=120",
    "task.options.n_train=100", "task.options.n_val=16", "task.options.n_test=16",
    "task.options.hop_mix=[1.0,0.0,0.0]",
    "trainer.val_questions=8", "trainer.collapse.questions=8", "trainer.threads=1",
    "trainer.progress=false", "tracking.enabled=false", "trainer.rollout.max_new_tokens=16",
]
EXTRA_TRAIN = {  # case → overrides beyond the preset
    "ppo+decoupled_token_is": ["algo=ppo", "algo.rollout_correction=decoupled_token_is"],
    "ppo+bypass_ppo_clip": ["algo=ppo", "algo.rollout_correction=bypass_ppo_clip"],
    "st_ppo+bypass_ppo_clip_geo_rs": ["algo=st_ppo", "algo.rollout_correction=bypass_ppo_clip_geo_rs"],
    "grpo+lag2+decoupled_geo_rs": ["algo=grpo", "trainer.offpolicy.lag=2",
                                   "algo.rollout_correction=decoupled_geo_rs"],
    "grpo+lag2uniform+bypass_pg_is": ["algo=grpo", "trainer.offpolicy.lag=2",
                                      "trainer.offpolicy.lag_mode=uniform",
                                      "algo.rollout_correction=bypass_pg_is"],
    "ppo+lag1": ["algo=ppo", "trainer.offpolicy.lag=1"],
    "st_ppo+micro4": ["algo=st_ppo", "trainer.micro_batch_size=4"],
    "s_ppo+micro4+grad": ["algo=s_ppo", "trainer.micro_batch_size=4", "algo.clip_bias.estimator=grad"],
    "s_ppo+grad": ["algo=s_ppo", "algo.clip_bias.estimator=grad"],
    "s_ppo+exact_every1": ["algo=s_ppo", "trainer.exact_clip_bias_every=1"],
    "st_ppo+sequence": ["algo=st_ppo", "algo.clip_bias.granularity=sequence"],
    "ppo+onpolicy": ["algo=ppo", "trainer.ppo_epochs=1", "trainer.minibatch_size=16"],
    "grpo+onpolicy+bypass_pg_is": ["algo=grpo", "trainer.ppo_epochs=1", "trainer.minibatch_size=16",
                                   "algo.rollout_correction=bypass_pg_is"],
    "grpo+kl_loss": ["algo=grpo", "algo.kl.coef=0.01"],
    "ppo+kl_reward": ["algo=ppo", "algo.kl.coef=0.01", "algo.kl.in_reward=true"],
    "ppo+dual_clip": ["algo=ppo", "algo.dual_clip=3.0"],
    "sapo+options": ["algo=sapo", "+algo.loss_options.tau_neg=2.0"],
    "grpo+entropy": ["algo=grpo", "algo.entropy_coef=0.01"],
}


def _digest(t) -> str:
    import torch

    if t is None:
        return "none"
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(t.numpy().tobytes()).hexdigest()[:32]


def _num(x) -> float | str:
    """A float as itself (json writes its exact repr); nan/inf as strings."""
    x = float(x.detach()) if hasattr(x, "detach") else float(x)
    return x if math.isfinite(x) else repr(x)


def _metrics(m) -> dict:
    return {k: _num(v) for k, v in sorted(m.items())}


def _no_plugins() -> None:
    import stppo.plugins

    stppo.plugins._entry_points = lambda: ()


# --- the loss of every preset × correction ---------------------------------------------------
def _loss_batch():
    import torch

    from stppo.algos.segments import subsentence_ids

    g = torch.Generator().manual_seed(7)
    n, t = 6, 48
    mask = torch.zeros(n, t, dtype=torch.bool)
    turns = torch.full((n, t), -1, dtype=torch.long)
    for i in range(n):
        pos, k = 3 + i % 3, 0
        while pos < t - 4 and k < 4:
            length = 2 + (i * 3 + k * 5) % 7
            mask[i, pos:pos + length] = True
            turns[i, pos:pos + length] = k
            pos, k = pos + length + 2 + (i + k) % 4, k + 1
    mask[5] = False  # a row without agent tokens
    turns[5] = -1
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3.0
    lp = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    roll = old + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, t, generator=g, dtype=torch.float64)
    ends = torch.rand(n, t, generator=g) < 0.25
    segs = subsentence_ids(ends, mask, turns)
    return lp, old, roll, adv, mask, turns, segs


def _one_loss(spec, batch, params_estimator: bool) -> dict:
    import torch

    from stppo.algos import policy_loss, rollout_correction
    from stppo.algos.aggregation import agg_denoms

    lp0, old, roll, adv, mask, turns, segs = batch
    torch.manual_seed(0)  # clip_cov draws from the global generator
    lp = lp0.clone().requires_grad_(True)
    rc = spec.rollout_correction
    kept, weights, denoms, used_old = mask, None, None, old
    if rc.bypass_mode:
        used_old = roll
        c = rollout_correction(lp.detach(), roll, mask, rc)
        kept, denoms = c.loss_mask, agg_denoms(mask)
        weights = c.weights if rc.applies_weights else None
    elif rc.decoupled:
        c = rollout_correction(old, roll, mask, rc)
        kept = c.loss_mask
        weights = c.weights if rc.applies_weights else None
    out = policy_loss(lp, used_old, adv, kept, turns, spec, global_denoms=denoms,
                      rollout_is_weights=weights, segment_ids=segs,
                      params=[lp] if params_estimator else None)
    (grad,) = torch.autograd.grad(out.loss, lp, allow_unused=True)
    return {"loss": _num(out.loss), "grad": _digest(grad),
            "grad_sq": _num(0.0 if grad is None else grad.double().square().sum()),
            "ratio": _digest(out.ratio), "clipped": _digest(out.clipped),
            "metrics": _metrics(out.metrics)}


def record_losses(only: str) -> dict:
    from stppo.algos import PRESETS, ROLLOUT_CORRECTIONS, ClipBias, RolloutCorrection
    from stppo.algos.presets import BUILT_IN

    batch = _loss_batch()
    out = {}
    for name in BUILT_IN:
        base = PRESETS[name].spec()
        variants = {c: dict(rollout_correction=RolloutCorrection(c)) for c in ROLLOUT_CORRECTIONS}
        if base.loss_mode == "clip":
            variants["dual_clip3"] = dict(dual_clip=3.0)
            variants["grad"] = dict(clip_bias=ClipBias("clip_bias_norm", 0.05, "grad"))
            variants["sequence"] = dict(clip_bias=ClipBias("clip_bias_norm", 0.05, "token", "sequence"))
            variants["triggered"] = dict(clip_bias=ClipBias("clip_triggered", 0.5))
        for var, changes in variants.items():
            key = f"loss/{name}/{var}"
            if not key.startswith(only):
                continue
            try:
                spec = base.replace(**changes)
            except ValueError:
                out[key] = "invalid"
                continue
            out[key] = _one_loss(spec, batch, var == "grad")
    return out


# --- the composed configs ----------------------------------------------------------------------
def config_cases() -> dict[str, list[str]]:
    cases: dict[str, list[str]] = {"default": []}
    for exp in ("quick", "testbed", "collapse_stress", "frontier", "paper_search", "size_probe",
                "smollm2_probe"):
        for algo in ("st_ppo", "ppo", "grpo", "dapo", "sapo", "sspo"):
            cases[f"{exp}/{algo}"] = [f"+experiment={exp}", f"algo={algo}"]
    for level in ("l1", "l1f", "l2", "l3", "l4", "l5"):
        cases[f"frontier/{level}"] = ["+experiment=frontier", f"+level={level}", "algo=ppo"]
    cases["testbed/reuse"] = ["+experiment=testbed", "+regime=reuse", "algo=ppo"]
    cases["reuse"] = ["+regime=reuse", "algo=grpo", "algo.rollout_correction=decoupled_token_is"]
    for task in ("synthetic_multihop", "nq_hotpotqa", "testbed"):
        for model in ("tiny", "small", "base", "smollm2_135m", "qwen2_5_0_5b_init"):
            cases[f"{task}/{model}"] = [f"task={task}", f"model={model}"]
    cases["verl"] = ["backend=verl", "algo=st_ppo"]
    cases["verl/paper_search"] = ["backend=verl", "+experiment=paper_search", "algo=grpo"]
    cases["bypass_pg"] = ["algo=grpo", "algo.rollout_correction=bypass_pg_is"]
    cases["sweep"] = ["+sweep=clip_range", "algo=st_ppo"]
    return cases


def record_configs(only: str) -> dict:
    from dataclasses import asdict

    from stppo.config import compose, to_config

    out = {}
    for case, overrides in config_cases().items():
        key = f"config/{case}"
        if key.startswith(only):
            try:
                out[key] = json.loads(json.dumps(asdict(to_config(compose(overrides))), default=repr))
            except ValueError as e:
                out[key] = f"invalid: {e}"
    return out


# --- the first training steps ------------------------------------------------------------------
class _Probe:
    """Wraps what the trainer calls to record a run while it trains (`Trainer.train`; not the warm
    start before it, which the first case of a set computes and the others load): the tracker's
    log, every 0-d backward and the gradients before clipping."""

    def __init__(self):
        import torch

        import stppo.tracker
        import stppo.train.loop

        self.events: list = []
        self._saved = []
        self.on = False

        def patch(owner, name, wrapper):
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrapper(getattr(owner, name)))

        def train(orig):
            def f(trainer, *a, **k):
                self.on = True
                try:
                    return orig(trainer, *a, **k)
                finally:
                    self.on = False
            return f

        def log(orig):
            def f(tracker, step, metrics):
                if self.on:
                    self.events.append(["log", step, {k: _num(v) for k, v in sorted(metrics.items())
                                                  if not k.startswith("perf/")}])
                return orig(tracker, step, metrics)
            return f

        def backward(orig):
            def f(tensor, *a, **k):
                if self.on and tensor.dim() == 0:
                    self.events.append(["backward", _num(tensor)])
                return orig(tensor, *a, **k)
            return f

        def clip(orig):
            def f(params, *a, **k):
                ps = [params] if isinstance(params, torch.Tensor) else list(params)
                if not self.on:
                    return orig(ps, *a, **k)
                grads = [p.grad for p in ps]
                sq = sum(float(g.double().square().sum()) for g in grads if g is not None)
                h = hashlib.sha256()
                for g in grads:
                    h.update(b"none" if g is None else g.detach().cpu().contiguous().numpy().tobytes())
                self.events.append(["grads", len(ps), h.hexdigest()[:32], _num(sq)])
                return orig(ps, *a, **k)
            return f

        patch(stppo.train.loop.Trainer, "train", train)
        patch(stppo.tracker.Tracker, "log", log)
        patch(torch.Tensor, "backward", backward)
        patch(torch.nn.utils, "clip_grad_norm_", clip)

    def close(self):
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)


def train_cases() -> dict[str, list[str]]:
    from stppo.algos import ROLLOUT_CORRECTIONS
    from stppo.algos.presets import BUILT_IN

    cases = {name: [f"algo={name}"] for name in BUILT_IN}
    cases.update({f"grpo+{c}": ["algo=grpo", f"algo.rollout_correction={c}"]
                  for c in ROLLOUT_CORRECTIONS if c != "none"})
    cases.update(EXTRA_TRAIN)
    return cases


def record_train(only: str, out_dir: Path) -> dict:
    from stppo.config import compose, to_config
    from stppo.train.job import run

    out = {}
    for case, overrides in train_cases().items():
        key = f"train/{case}"
        if not key.startswith(only):
            continue
        t0 = time.perf_counter()
        cfg = to_config(compose(TRAIN_BASE + overrides + [f"trainer.out_dir={out_dir}/{case}"]))
        probe = _Probe()
        try:
            objective = run(cfg)
        finally:
            probe.close()
        out[key] = {"objective": _num(objective), "events": probe.events}
        print(f"  {key}: {len(probe.events)} events, {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def record(only: str = "") -> dict:
    import stppo

    _no_plugins()
    print(f"recording with stppo from {Path(stppo.__file__).parent}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="stppo_bit_identity_"))
    os.environ["STPPO_CACHE_DIR"] = str(tmp / "cache")  # both sides build every cache alike
    out = {}
    try:
        for part, fn in (("loss", record_losses), ("config", record_configs),
                         ("train", lambda o: record_train(o, tmp / "runs"))):
            if part.startswith(only) or only.startswith(part):
                out.update(fn(only))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --- comparing ---------------------------------------------------------------------------------
def _diffs(a, b, path="", limit=5) -> list[str]:
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'new' if k not in a else 'reference'}")
            else:
                out += _diffs(a[k], b[k], f"{path}/{k}", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(a, list):
        out = [] if len(a) == len(b) else [f"{path}: length {len(a)} != {len(b)}"]
        for i, (x, y) in enumerate(zip(a, b)):
            out += _diffs(x, y, f"{path}[{i}]", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    return [] if a == b else [f"{path}: reference {a!r}, now {b!r}"]


# Differences that are intended, each with why; a case that differs only in these passes. The
# path is the entry's within a case's record (config cases: the resolved config's fields).
INTENDED = {
    "/task/options/works_for_frac: only in new":
        "a synthetic task's config records its whole world: the world's defaults moved from "
        "conf/task/*.yaml to stppo.envs.SyntheticConfig (the ConfigStore's world/synthetic), whose "
        "every field the composed config now holds, works_for_frac (2/3, never set in conf/) too; "
        "no number of a run changes, the run folder's and the warm start's cache hashes do",
}


def compare(ref: dict, now: dict, only: str) -> int:
    keys = sorted(k for k in set(ref) | set(now) if k.startswith(only))
    bad, intended = 0, {}
    for k in keys:
        if k not in now or k not in ref:
            print(f"DIFFERS {k}: only in {'reference' if k not in now else 'this tree'}")
            bad += 1
            continue
        d = _diffs(ref[k], now[k], limit=50)
        for line in d:
            if line in INTENDED:
                intended[line] = intended.get(line, 0) + 1
        d = [line for line in d if line not in INTENDED]
        if d:
            bad += 1
            print(f"DIFFERS {k}")
            for line in d[:5]:
                print(f"    {line}")
    for line, n in intended.items():
        print(f"intended in {n} case(s): {line} — {INTENDED[line]}")
    print(f"{len(keys) - bad} of {len(keys)} cases bit-identical (but for the intended differences)"
          + ("" if not bad else f"; {bad} differ"))
    return 1 if bad else 0


def _reference(rev: str, refresh: bool, only: str) -> dict:
    """The recorded reference of `rev` (the cases starting with `only`), recorded in a worktree
    unless a recording of them on this machine's CPU kernels is kept already."""
    import torch

    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / (f"stppo_bit_identity_{sha[:12]}_"
                                          f"{torch.backends.cpu.get_cpu_capability()}.json")
    kept = json.loads(path.read_text()) if path.exists() else {"recorded": [], "cases": {}}
    if not refresh and any(only.startswith(p) for p in kept["recorded"]):
        print(f"reference of {sha[:12]}: {path}")
        return kept["cases"]
    tree = Path(tempfile.mkdtemp(prefix="stppo_ref_"))
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        part = tree / "record.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "record", "--out", str(part),
                        "--only", only], cwd=tree, env=env, check=True)
        cases = {k: v for k, v in kept["cases"].items() if not k.startswith(only)}
        cases.update(json.loads(part.read_text()))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    recorded = sorted({p for p in kept["recorded"] if not p.startswith(only)} | {only})
    path.write_text(json.dumps({"recorded": recorded, "cases": cases}))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", nargs="?", choices=("record", "check"), default="check")
    ap.add_argument("--out", type=Path, help="record: the file to write")
    ap.add_argument("--ref", type=Path, help="check: a recorded reference")
    ap.add_argument("--against", help="check: a git revision, recorded in a worktree first")
    ap.add_argument("--refresh", action="store_true", help="record the --against reference again")
    ap.add_argument("--only", default="", help="case names starting with this (loss, train, train/ppo)")
    args = ap.parse_args()
    if args.command == "record":
        data = record(args.only)
        (args.out or Path("bit_identity.json")).write_text(json.dumps(data))
        return
    if (args.ref is None) == (args.against is None):
        ap.error("check needs one of --ref FILE or --against REV")
    if args.ref:
        ref = json.loads(args.ref.read_text())
        ref = ref.get("cases", ref)  # a kept reference of --against, or a `record` file
    else:
        ref = _reference(args.against, args.refresh, args.only)
    sys.exit(compare(ref, record(args.only), args.only))


if __name__ == "__main__":
    main()
