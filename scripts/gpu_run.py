"""The GPU run (`scripts/gpu_run.sh`, `make gpu-check`): every GPU figure of the project from one
entry under one deadline, its logs and `summary.json` in OUT (docs/scaling.md, "The GPU run").

    OUT=DIR DEADLINE_S=480 bash scripts/gpu_run.sh [PART ...]      (default: every part)

Parts, in this order, with the seconds each may take on one H100 (its budget: a part whose budget
does not fit in what is left of the deadline is not started, and the summary says so):
  static-tests   the static rollout on the GPU: static = eager and CUDA graphs = no graphs, bit for
                 bit (tests/test_rollout_static.py)
  bench-rollout  benchmarks/bench_rollout.py: graphed_over_eager, rollout_over_static_generate,
                 the decoding steps' bandwidth against the device's copy bandwidth
  smollm2-steps  SmolLM2-135M-Instruct in the recipe `+experiment=smollm2_learn`, the static path
                 (graphs) and the eager one: step time, rollout static ÷ eager, peak memory
  smollm2-learn  the recipe itself, ppo then st_ppo, as many steps as the time left allows (from
                 the measured step time), live greedy validation every 10 steps
  sizes          random-init Qwen2.5-0.5B then -1.5B at the paper's per-GPU shapes (3 steps each)
  trl            benchmarks/bench_vs_trl.py: stppo_over_trl
  verl-loop      verl's own trainer loop (`run.py backend=verl`, RayPPOTrainer.fit) for 2 steps
                 with Hugging Face generation on this GPU (tests/verl/test_verl_loop.py)
  verl-update    verl's FSDP2 actor update with every paper preset's loss (scripts/gpu_check_verl.sh)
Packages: the GPU image has torch and transformers; `make gpu-wheels` brings the rest in three
parts (.gpu/1, .gpu/2, .gpu/3, ≤ 54 MiB each), and `scripts/gpu_install.sh` installs those
that are here. A part whose packages have not arrived is skipped with the name of what it lacks;
the state of every part is kept in .gpu/run/summary.json, so the next call (with the next .gpu
part) runs what is left: the whole run is at most three calls.

Exit status 0 when no part that ran failed. `GPU_RUN_DRY=1`: the device check accepts this CPU and
each part runs a tiny CPU version of itself (tests/test_gpu_run.py runs the whole script so).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = ROOT / ".gpu" / "run"
FIGURE = re.compile(r"^(gpu_figures: .*|gpu_check_verl: .*|verl_loop: .*|[a-z0-9_]+(_over_[a-z0-9_]+|_s|_gib"
                    r"|_tokens_per_s|_bandwidth): .*)$")
DONE = ("ok",)  # parts that a later call does not run again


@dataclass
class Part:
    name: str
    budget_s: int  # at most this long on one H100 (its timeout); not started when it does not fit
    dry_budget_s: int  # the CPU dry run's tiny version: decides whether it starts; 10× it stops a hang
    needs: tuple[str, ...] = ()  # modules it imports; missing → skipped
    site: str = ""  # .gpu/site-<site> ahead of the common site (trl, verl)


@dataclass
class Result:
    status: str  # ok | failed | timeout | skipped | not_started
    seconds: float = 0.0
    reason: str = ""
    figures: list[str] = field(default_factory=list)
    log: str = ""


PARTS = [Part("static-tests", 90, 40, ("bm25s",)),
         Part("bench-rollout", 90, 40, ("bm25s",)),
         Part("smollm2-steps", 120, 60, ("mlflow", "hydra", "gguf", "bm25s")),
         Part("smollm2-learn", 240, 90, ("mlflow", "hydra", "gguf", "bm25s")),
         Part("sizes", 150, 60, ("mlflow", "hydra", "bm25s")),
         Part("trl", 90, 40, ("trl", "datasets"), site="trl"),
         Part("verl-loop", 180, 90, ("verl", "ray", "tensordict"), site="verl"),
         Part("verl-update", 90, 60, ("verl", "ray", "tensordict"), site="verl")]


class Run:
    """What every part's command needs: the device, the Python, the folders, the time left."""

    def __init__(self, out: Path, deadline_s: float, dry: bool) -> None:
        self.out, self.dry, self.t0, self.deadline_s = out, dry, time.monotonic(), deadline_s
        self.py = os.environ.get("PYTHON", sys.executable)
        self.device = "cpu" if dry else "cuda"
        self.store = f"sqlite:///{out / 'mlflow.db'}"
        self.stand_in = os.environ.get("GPU_RUN_STAND_IN", "")  # dry: a tiny SmolLM2-shaped model dir
        self.step_s: float | None = None  # smollm2-steps' measured step, for smollm2-learn

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.t0)

    def env(self, part: Part) -> dict:
        site = [f"{ROOT}/.gpu/site-{part.site}"] if part.site else []
        path = [str(ROOT), *site, f"{ROOT}/.gpu/site", f"{ROOT}/.gpu/models"]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "STPPO_CACHE_DIR": os.environ.get("STPPO_CACHE_DIR", str(ROOT / ".gpu" / "cache-run"))}

    def trainer(self, *extra: str) -> list[str]:
        """run.py with the run's store, device and folders."""
        return [self.py, "run.py", f"trainer.device={self.device}", "trainer.progress=false",
                f"tracking.uri={self.store}", f"trainer.out_dir={self.out / 'runs'}", *extra]

    def smollm2(self, algo: str = "st_ppo") -> list[str]:
        """The recipe, on this device; the dry run swaps in the stand-in and a tiny world."""
        base = ["+experiment=smollm2_learn", f"algo={algo}"]
        if not self.dry:
            return base
        return [*base, f"model.path={self.stand_in}", "trainer.warmstart.steps=2", "trainer.questions_per_step=2",
                "trainer.minibatch_size=4", "trainer.val_questions=4", "trainer.collapse.questions=4",
                "trainer.threads=1", *TINY_WORLD]


TINY_WORLD = ["task.options.n_people=60", "task.options.n_cities=20", "task.options.n_countries=6",
              "task.options.n_orgs=15", "task.options.n_distractors=40", "task.options.n_sft=8",
              "task.options.n_train=8", "task.options.n_val=4", "task.options.n_test=4"]


def cmd_static_tests(r: Run) -> list[list[str]]:
    select = ["-k", "truncates"] if r.dry else []
    return [[r.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_rollout_static.py", *select]]


def cmd_bench_rollout(r: Run) -> list[list[str]]:
    size = ["--questions", "4", "--repeats", "1", "--no-compile"] if r.dry else ["--repeats", "3"]
    return [[r.py, "benchmarks/bench_rollout.py", "--device", r.device, *size]]


def cmd_smollm2_steps(r: Run) -> list[list[str]]:
    steps = "2" if r.dry else "4"
    common = [*r.smollm2(), "tracking.experiment=gpu_smollm2", "trainer.val_every=0", "trainer.collapse.every=0"]
    return [r.trainer(*common, "trainer.rollout.engine=static", f"trainer.total_steps={steps}", "tracking.run_name=static"),
            r.trainer(*common, "trainer.rollout.engine=eager", "trainer.total_steps=2", "tracking.run_name=eager"),
            [r.py, "scripts/gpu_figures.py", str(r.out / "mlflow.db"), "gpu_smollm2", "--compare", "static", "eager"]]


def cmd_smollm2_learn(r: Run) -> list[list[str]]:
    """ppo then st_ppo, each with half the part's time: steps from the measured step time (the
    static path's, less its first step), 20% of it for the live checks, between 2 and 60."""
    if r.dry:
        steps = 2
    else:
        each = min(PARTS_BY_NAME["smollm2-learn"].budget_s, r.left()) / 2 - 30  # start-up, warm start cached
        steps = int(max(2, min(60, each / (1.2 * (r.step_s or 10.0)))))
    return [r.trainer(*r.smollm2(algo), f"trainer.total_steps={steps}", "tracking.experiment=gpu_smollm2_learn",
                      f"tracking.run_name={algo}")
            for algo in ("ppo", "st_ppo")] + [
        [r.py, "scripts/gpu_figures.py", str(r.out / "mlflow.db"), "gpu_smollm2_learn", "--steps", "2"]]


def cmd_sizes(r: Run) -> list[list[str]]:
    models = ["tiny"] if r.dry else ["qwen2_5_0_5b_init", "qwen2_5_1_5b_init"]
    probe = ["+experiment=quick", "trainer.total_steps=1", *TINY_WORLD] if r.dry else ["+experiment=size_probe"]
    return [r.trainer(*probe, f"model={m}", "tracking.experiment=gpu_sizes", f"tracking.run_name={m}")
            for m in models] + [[r.py, "scripts/gpu_figures.py", str(r.out / "mlflow.db"), "gpu_sizes",
                                 "--steps", "1" if r.dry else "3"]]


def cmd_trl(r: Run) -> list[list[str]]:
    size = ["--warmup", "1", "--steps", "1"] if r.dry else ["--warmup", "1", "--steps", "3"]
    return [[r.py, "benchmarks/bench_vs_trl.py", "--device", r.device, *size]]


def cmd_verl_loop(r: Run) -> list[list[str]]:
    return [[r.py, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/verl/test_verl_loop.py"]]


def cmd_verl_update(r: Run) -> list[list[str]]:
    return [["bash", "scripts/gpu_check_verl.sh"]]


COMMANDS: dict[str, Callable[[Run], list[list[str]]]] = {
    "static-tests": cmd_static_tests, "bench-rollout": cmd_bench_rollout, "smollm2-steps": cmd_smollm2_steps,
    "smollm2-learn": cmd_smollm2_learn, "sizes": cmd_sizes, "trl": cmd_trl, "verl-loop": cmd_verl_loop,
    "verl-update": cmd_verl_update}
PARTS_BY_NAME = {p.name: p for p in PARTS}


# -- the run ---------------------------------------------------------------------------------------
def device_check(r: Run) -> str:
    """One line naming the device, or SystemExit with one line when there is no CUDA device."""
    code = ("import sys, torch, transformers\n"
            "dry = sys.argv[1] == '1'\n"
            "if not dry and not torch.cuda.is_available():\n"
            "    sys.exit('gpu_run: no CUDA device (torch.cuda.is_available() is False); run it on a GPU "
            "machine, or GPU_RUN_DRY=1 for the CPU dry run')\n"
            "name = 'CPU (dry run)' if dry else torch.cuda.get_device_name(0)\n"
            "print(f'{name}, torch {torch.__version__}, transformers {transformers.__version__}, "
            "Python {sys.version.split()[0]}')")
    out = subprocess.run([r.py, "-c", code, "1" if r.dry else "0"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit((out.stderr.strip().splitlines() or ["gpu_run: the device check failed"])[-1])
    return out.stdout.strip()


def missing(r: Run, part: Part) -> str:
    """The modules of `part.needs` that do not import here ('' when all do)."""
    code = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
            "    except Exception:\n        bad.append(m)\nprint(' '.join(bad))")
    out = subprocess.run([r.py, "-c", code, *part.needs], capture_output=True, text=True, env=r.env(part))
    return out.stdout.strip() or (out.stderr.strip().splitlines() or [""])[-1]


def run_part(r: Run, part: Part, budget: float) -> Result:
    log = r.out / f"{part.name}.log"
    lacks = missing(r, part) if part.needs else ""
    if lacks:
        return Result("skipped", reason=f"cannot import {lacks} (make gpu-wheels; bring the .gpu part with it)")
    start, status, reason = time.monotonic(), "ok", ""
    with open(log, "w") as f:
        for argv in COMMANDS[part.name](r):
            left = budget - (time.monotonic() - start)
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            try:
                code = subprocess.run(argv, cwd=ROOT, env=r.env(part), stdout=f, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, left), start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                status, reason = "timeout", f"stopped at its budget of {budget:.0f} s"
                break
            if code != 0:
                status, reason = "failed", f"{Path(argv[1]).name if len(argv) > 1 else argv[0]} exited with {code}"
                break
    text = log.read_text(errors="replace")
    figures = [line for line in text.splitlines() if FIGURE.match(line)]
    return Result(status, time.monotonic() - start, reason, figures, log.name)


def step_time(figures: list[str]) -> float | None:
    """The static run's median step (s) from smollm2-steps' gpu_figures lines."""
    for line in figures:
        m = re.search(r"gpu_figures: static .*?step ([0-9.]+) s", line)
        if m:
            return float(m.group(1))
    return None


def main(argv: list[str]) -> int:
    out = Path(os.environ.get("OUT") or STATE_DIR)
    out.mkdir(parents=True, exist_ok=True)
    r = Run(out, float(os.environ.get("DEADLINE_S", "480")), os.environ.get("GPU_RUN_DRY") == "1")
    wanted = argv or [p.name for p in PARTS]
    unknown = [w for w in wanted if w not in PARTS_BY_NAME]
    if unknown:
        raise SystemExit(f"gpu_run: unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS_BY_NAME)}")
    state_path = (out if r.dry else STATE_DIR) / "summary.json"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state = json.loads(state_path.read_text()) if state_path.exists() else {"parts": {}}
    state["device"] = device_check(r)
    print(f"gpu_run: {state['device']}; deadline {r.deadline_s:.0f} s", flush=True)
    for name in wanted:
        part = PARTS_BY_NAME[name]
        before = state["parts"].get(name, {})
        if before.get("status") in DONE:
            print(f"gpu_run: {name}: done in an earlier call", flush=True)
            continue
        budget = part.dry_budget_s if r.dry else part.budget_s
        if r.left() < budget:
            res = Result("not_started", reason=f"{r.left():.0f} s left of the deadline, it needs up to {budget} s")
        else:  # the dry run's budgets guard only against a hang: a slow CPU does not fail a part
            res = run_part(r, part, 10 * budget if r.dry else budget)
        if name == "smollm2-steps":
            r.step_s = step_time(res.figures)
        state["parts"][name] = asdict(res)
        state["left_s"] = round(r.left(), 1)
        state_path.write_text(json.dumps(state, indent=1))
        print(f"gpu_run: {name}: {res.status} in {res.seconds:.0f} s {res.reason}".rstrip(), flush=True)
        for line in res.figures:
            print(f"  {line}", flush=True)
    (out / "summary.json").write_text(json.dumps(state, indent=1))
    failed = [n for n, p in state["parts"].items() if p["status"] in ("failed", "timeout")]
    print(f"gpu_run: {'FAILED: ' + ', '.join(failed) if failed else 'no part failed'}; summary {out / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
