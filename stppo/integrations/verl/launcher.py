"""`run(cfg)` for `backend=verl`: one Hydra job = one verl training run in a subprocess.

    open the MLflow run (stppo's tags + backend=verl, the flattened config as params)
    → checks before Ray starts (verl environment, GPUs, model, retrieval server) → convert the data
    → `backend.python -m verl.trainer.main_ppo OVERRIDES…` (for stale rollouts, trainer.offpolicy.lag
      > 0, verl's one-step or fully async off-policy trainer) with MLFLOW_TRACKING_URI and
      MLFLOW_RUN_ID (also in Ray's runtime_env), so verl's own MLflow logger writes into the run
    → every backend.poll_s: the run monitor copies verl's metrics under stppo's names and applies
      the collapse rule and the online alarms; with trainer.stop_on_collapse (a collapse) or
      trainer.on_alarm=stop (an alarm) it stops verl (its process group), tag `stopped` = why
    → close the run: FINISHED (verl exited 0, or was stopped), FAILED with the end of
      verl's stderr, KILLED on SIGTERM/SIGHUP/Ctrl-C (verl is stopped first); returns the
      objective (mean late val/success_rate, as the own trainer).

Runs in stppo's environment and never imports verl: verl is only a subprocess. A failed job
raises, so run.py's multirun machinery records it like a failed own job.
`backend.dry_run=true` prints the command (one override per line) and starts nothing.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from stppo import metric_names as K
from stppo.config import Config, run_identity, to_config
from stppo.integrations.verl import data as D
from stppo.integrations.verl.monitor import RunMonitor
from stppo.integrations.verl.overrides import (JobFiles, check_translatable, entry_module, env_overrides,
                                               format_command, model_source, per_turn_count, rollout_engine,
                                               uses_v1, verl_device, verl_overrides)
from stppo.tracker import Tracker, absolute_uri, flatten, resolve_uri
from stppo.mlflow_store import call

log = logging.getLogger(__name__)
STDERR_TAIL = 20  # lines of verl's stderr kept for the run's error note
# verl's version, this node's CUDA GPUs and which of the modules named in argv are missing
PROBE = ("import importlib.util, json, sys, torch, verl; print(json.dumps({'verl': verl.__version__, "
         "'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0, "
         "'missing': [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]}))")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What verl imports beyond itself, (module, what to pip install): its v1 trainer TransferQueue (in
# verl's `verl-core` extra, which verl[vllm] / verl[sglang] pull; not in a plain `pip install
# verl`), each rollout engine its server (an engine registered by a verl plugin: not known here).
V1_PACKAGE = ("transfer_queue", "TransferQueue>=0.1.10")
ENGINE_PACKAGES = {"vllm": ("vllm", "verl[vllm]"), "sglang": ("sglang", "verl[sglang]")}


class Terminated(BaseException):
    """SIGTERM / SIGHUP: the job was stopped from outside; verl is stopped, the run is KILLED.
    A BaseException (as KeyboardInterrupt): the signal may land inside code that retries or logs
    any Exception (the metrics poll, MLflow's client), which must not swallow it."""


class VerlFailed(RuntimeError):
    """verl exited with an error; the message ends with the last line of its stderr."""


@dataclass(frozen=True)
class Plan:
    argv: list[str]  # python -m ENTRY overrides…
    env: dict[str, str]  # MLFLOW_* for the subprocess (and Ray's workers)
    data: D.ConvertedData


def run(cfg_in: DictConfig | Config | dict) -> float:
    """The Hydra job of `backend=verl` (see the module docstring)."""
    cfg = cfg_in if isinstance(cfg_in, Config) else to_config(cfg_in)
    if cfg.backend.dry_run:
        plan = make_plan(cfg, run_id="NEW_RUN_ID")
        print(format_command(plan.argv, plan.env), flush=True)
        return float("nan")
    return launch(cfg)


def launch(cfg: Config, check: Callable[[Config], str] | None = None) -> float:
    """Open the run, check (`preflight`, or `check` → the interpreter), convert, supervise."""
    from stppo.train.job import run_tags

    tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, buffer_dir=cfg.tracking.buffer_dir,
                      enabled=True)
    run_id = tracker.start(tags={**run_tags(cfg), K.TAG_BACKEND: "verl"}, params=flatten(asdict(cfg)),
                           run_name=cfg.tracking.run_name or job_dir(cfg).name,
                           artifacts={"config.yaml": OmegaConf.to_yaml(OmegaConf.structured(cfg))})
    try:
        check_translatable(cfg)  # settings first: one line before the slow checks
        python = (check or preflight)(cfg)
        D.convert(cfg)
        plan = make_plan(cfg, run_id=run_id, uri=tracker.uri, python=python)
        call(tracker.client.log_text, run_id, format_command(plan.argv, plan.env) + "\n", "verl_command.sh")
    except BaseException as e:
        tracker.finish("FAILED", error=f"{type(e).__name__}: {e}")
        raise
    return supervise(cfg, plan, tracker)


def job_dir(cfg: Config) -> Path:
    """The job's folder (checkpoints): same settings ⇒ same folder (`stppo.config.run_identity`)."""
    return (Path(cfg.trainer.out_dir) / cfg.tracking.experiment / run_identity(cfg)).resolve()


def make_plan(cfg: Config, *, run_id: str, uri: str | None = None, python: str | None = None) -> Plan:
    data = D.planned(cfg)
    files = JobFiles(str(data.train), str(data.val), str(data.tool_config), str(job_dir(cfg) / "checkpoints"))
    env = {"MLFLOW_TRACKING_URI": absolute_uri(resolve_uri(uri or cfg.tracking.uri)), "MLFLOW_RUN_ID": run_id}
    argv = [python or cfg.backend.python, "-m", entry_module(cfg), *verl_overrides(cfg, files), *env_overrides(env)]
    return Plan(argv, env, data)


# -- checks before anything starts ---------------------------------------------------------------
def preflight(cfg: Config) -> str:
    """Check the verl environment's interpreter, the model, the retrieval server, then (one
    `python -c` that imports verl) verl itself, for verl's CUDA device the GPUs of this node, and
    the packages the run's trainer and rollout engine import (`required_packages`);
    returns the interpreter's path. Raises ValueError / ConnectionError (one line) on the first
    problem."""
    b = cfg.backend
    python = shutil.which(b.python) if os.sep not in b.python else b.python
    if not python or not os.access(python, os.X_OK):
        raise ValueError(f"backend.python={b.python}: no such interpreter; build the verl environment with "
                         "`make verl-env` or point backend.python at your verl environment's python")
    check_model(model_source(cfg))
    if cfg.task.retriever.kind == "http":
        check_server(cfg.task.retriever.url, timeout_s=min(10.0, cfg.task.retriever.timeout_s))
    needed = required_packages(cfg)
    env = probe(python, modules=tuple(needed))  # the slow one last: imports verl
    if verl_device(cfg) == "cuda" and b.n_gpus_per_node > env["gpus"]:
        raise ValueError(f"backend asks for {b.nnodes} node(s) x {b.n_gpus_per_node} GPUs but this node has "
                         f"{env['gpus']} visible GPU(s) (torch in {python}); lower backend.n_gpus_per_node or "
                         "run on a GPU node")
    missing = env.get("missing") or []
    if missing:
        raise ValueError(f"the verl environment ({python}) has no module {missing[0]!r}: {needed[missing[0]]}")
    return python


def required_packages(cfg: Config) -> dict[str, str]:
    """{module: why and how to install it} that verl's processes import for this run beyond verl
    itself: transfer_queue for the v1 trainer (`overrides.uses_v1`), the rollout engine's package."""
    out = {}
    if uses_v1(cfg):
        module, pip = V1_PACKAGE
        out[module] = f"verl's v1 trainer (trainer.use_v1=true) imports it: pip install '{pip}'"
    engine = rollout_engine(cfg)
    if engine in ENGINE_PACKAGES:
        module, pip = ENGINE_PACKAGES[engine]
        out[module] = f"the {engine} rollout engine (backend.rollout_engine={engine}): pip install '{pip}'"
    return out


def probe(python: str, modules: tuple[str, ...] = ()) -> dict[str, Any]:
    """{'verl': version, 'gpus': n, 'missing': [those of `modules` not importable]} from one
    `python -c` in the verl environment."""
    try:
        out = subprocess.run([python, "-c", PROBE, *modules], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"backend.python={python} cannot be run ({e})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"backend.python={python} cannot import verl ({last}); build the environment with "
                         "`make verl-env` or point backend.python at a python with verl installed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_model(path: str) -> None:
    """A local model folder must hold a readable config.json; a hub id ('org/name') must be in
    the local Hugging Face cache when HF_HUB_OFFLINE=1 (otherwise verl downloads it)."""
    local = Path(path).expanduser()
    if path.startswith(("/", ".", "~")) or local.exists():
        cfg = local / "config.json"
        if not (local.is_dir() and os.access(cfg, os.R_OK)):
            raise ValueError(f"model path {path}: no readable config.json there; set model.path to a Hugging "
                             "Face model folder or a hub id such as Qwen/Qwen2.5-1.5B-Instruct")
        return
    if not HUB_ID.match(path):
        raise ValueError(f"model path {path!r} is neither a folder nor a hub id 'org/name'")
    if os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "True"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ValueError(f"model {path} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; "
                             "download it first or set model.path to a local folder")


def check_server(url: str, timeout_s: float) -> None:
    import requests

    base = url.rstrip("/").removesuffix("/retrieve")
    try:
        requests.get(base + "/health", timeout=timeout_s)
    except requests.RequestException as e:
        raise ConnectionError(f"retrieval server {base} is not answering ({type(e).__name__}); start it "
                              "(python -m stppo.envs.retrieval_server …) or set task.retriever.url") from None


# -- the subprocess --------------------------------------------------------------------------------
def supervise(cfg: Config, plan: Plan, tracker: Tracker) -> float:
    """Run verl, follow the run, close it (see the module docstring); returns the objective."""
    from stppo.algos import LOSS_MODES

    t = cfg.trainer
    monitor = RunMonitor(tracker, data_source=plan.data.data_source, total_steps=t.total_steps,
                         collapse=t.collapse, stop_on_collapse=t.stop_on_collapse, alarm=t.alarm,
                         on_alarm=t.on_alarm, max_turns=per_turn_count(cfg),
                         namespace=LOSS_MODES[cfg.algo.spec.loss_mode].namespace)
    env = {**os.environ, **plan.env, "PYTHONPATH": _pythonpath()}
    old = _install_handlers()
    proc, tail = None, collections.deque(maxlen=STDERR_TAIL)
    try:
        proc = subprocess.Popen(plan.argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)  # its own process group: stopped as a whole
        reader = threading.Thread(target=_tee, args=(proc.stderr, tail), daemon=True)
        reader.start()
        stopped = _follow(proc, monitor, cfg.backend)
        reader.join(timeout=10)
        _poll(monitor)  # what verl logged last
        status, error = outcome(proc.returncode, stopped, list(tail))
    except BaseException as e:
        if proc is not None:
            stop(proc, cfg.backend.stop_grace_s)
        killed = isinstance(e, (Terminated, KeyboardInterrupt))
        tracker.finish("KILLED" if killed else "FAILED", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        _restore_handlers(old)
    tracker.finish(status, error=error)
    if status == "FINISHED":
        return monitor.objective()
    raise VerlFailed(error.splitlines()[0])  # the whole note is on the run


def _follow(proc: subprocess.Popen, monitor: RunMonitor, b) -> bool:
    """Poll the run until verl exits; True when it was stopped (a collapse or an alarm)."""
    while True:
        try:
            proc.wait(timeout=b.poll_s)
            return False
        except subprocess.TimeoutExpired:
            pass
        _poll(monitor)
        reason = monitor.stop_reason
        if reason is not None:
            log.warning("stppo: stopping verl: %s", reason)
            monitor.tracker.set_tags({K.TAG_STOPPED: reason})
            stop(proc, b.stop_grace_s)
            return True


def _poll(monitor: RunMonitor) -> None:
    try:
        monitor.poll()
    except Exception as e:  # noqa: BLE001 - a tracking hiccup must not kill the training
        log.warning("stppo: could not read the run's metrics (%s); trying again", e)


def outcome(returncode: int, stopped: bool, tail: list[str]) -> tuple[str, str | None]:
    """(MLflow status, error note) of verl's exit."""
    if stopped or returncode == 0:
        return "FINISHED", None
    lines = [ln.rstrip() for ln in tail if ln.strip()]
    end = "\n".join(lines) or "(no stderr)"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return "KILLED", f"verl was terminated by {name}\n{end}"
    return "FAILED", f"verl exited with status {returncode}: {lines[-1] if lines else '(no stderr)'}\n{end}"


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to verl's process group, SIGKILL after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _tee(stream, tail: collections.deque) -> None:
    for line in stream:
        sys.stderr.write(line)
        tail.append(line)


def _pythonpath() -> str:
    """This stppo's source first, so verl's side runs the same code as the launcher."""
    root = str(Path(__file__).resolve().parents[3])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def _raise(signum, frame):
    raise Terminated(f"received {signal.Signals(signum).name}")


def _install_handlers() -> dict | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}


def _restore_handlers(old: dict | None) -> None:
    for s, h in (old or {}).items():
        signal.signal(s, h)
