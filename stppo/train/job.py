"""`run(cfg)`: one job, start to end — validate the config, open the MLflow run, build the
components (warm start included), train, close the run with its final status."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig

from stppo import metric_names as K
from stppo.config import Config, to_config
from stppo.tracker import Tracker, flatten
from stppo.train import checkpoint, distributed
from stppo.train.loop import Trainer, read_run_info, resolved_yaml, run_dir_for, write_run_info
from stppo.train.rollout_corr import correction_for
from stppo.train.setup import build_components, device_of
from stppo.train.update import old_log_probs_from_update

log = logging.getLogger(__name__)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def host_tag(device: torch.device) -> str:
    """What the run trained on, as far as it can change the numbers: the GPU's name, or the CPU
    kernels torch dispatches to (runs of one seed on AVX-512 and on AVX2 differ in the last bits,
    and a long RL run can turn that into a different trajectory)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{torch.backends.cpu.get_cpu_capability()}"


def run_tags(cfg: Config) -> dict[str, str]:
    return {K.TAG_ALGO: cfg.algo.name, K.TAG_MODEL: cfg.model.name, K.TAG_TASK: cfg.task.name,
            K.TAG_SEED: str(cfg.seed), K.TAG_SWEEP: cfg.tracking.sweep, K.TAG_GIT_COMMIT: git_commit(),
            **cfg.tracking.tags}


def run_params(cfg: Config) -> dict[str, str]:
    """The flattened config, plus what the trainer derives from it that a reader must know:
    `derived.old_log_prob_pass` — `skipped` when the update is provably on-policy and takes its
    old log-probs from its own forward, `sampler` when a bypass-mode rollout correction takes the
    sampler's (no forward), else `computed` (a separate no-grad forward)."""
    skipped = old_log_probs_from_update(cfg)
    sampler = correction_for(cfg.algo.spec.rollout_correction).old_from_sampler
    how = "skipped" if skipped else "sampler" if sampler else "computed"
    return {**flatten(asdict(cfg)), "derived.old_log_prob_pass": how}


class Terminated(BaseException):
    """SIGTERM: the job was stopped from outside (scheduler, launcher, user). A BaseException (as
    KeyboardInterrupt), so no `except Exception` that the signal lands in (a retried MLflow call, a
    diagnostics guard) swallows it."""


def _on_sigterm(signum, frame):
    raise Terminated("received SIGTERM")


def run(cfg_in: DictConfig | Config | dict) -> float:
    """Train one run; returns the objective (mean late validation success). Under torchrun the
    processes train it data-parallel (`stppo.train.distributed`); rank 0 logs and checkpoints."""
    cfg = cfg_in if isinstance(cfg_in, Config) else to_config(cfg_in)  # ValueError on bad settings
    d = distributed.from_env()
    if d.active:
        distributed.check_divisible(d.world, cfg.trainer.questions_per_step,
                                    cfg.trainer.minibatch_size, cfg.trainer.micro_batch_size)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    device = device_of(cfg)
    distributed.init(device)
    run_dir = run_dir_for(cfg)
    state = checkpoint.load(run_dir) if cfg.trainer.resume else None
    prev_id = read_run_info(run_dir).get("mlflow_run_id") if cfg.trainer.resume else None
    tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, buffer_dir=cfg.tracking.buffer_dir,
                      enabled=cfg.tracking.enabled and d.is_main)
    run_id = tracker.start(tags={**run_tags(cfg), K.TAG_HOST: host_tag(device), **_dist_tags(d)}, params=run_params(cfg),
                           run_name=cfg.tracking.run_name or run_dir.name, run_id=prev_id,
                           artifacts={"config.yaml": resolved_yaml(cfg)})
    if d.is_main:
        write_run_info(run_dir, run_id)
    old_handler = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        comps = build_components(cfg, progress=cfg.trainer.progress and d.is_main)
        for m in (comps.policy, comps.critic):
            if m is not None:
                d.broadcast_module(m)  # replicas start equal (the warm start is shared anyway)
        trainer = Trainer(cfg, comps, tracker, run_dir, d)
        if state is not None:
            trainer.load_state_dict(state)
        if prev_id is not None:
            trainer.logged = {"train": _last(tracker, K.STEP_TIME), "val": _last(tracker, K.VAL_SUCCESS_RATE)}
        objective = trainer.train()
        tracker.finish("FINISHED")
        return objective
    except (KeyboardInterrupt, Terminated) as e:
        tracker.finish("KILLED", error=f"{type(e).__name__}: {e}")
        raise
    except BaseException as e:
        tracker.finish("FAILED", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        distributed.shutdown()


def _dist_tags(d: distributed.Dist) -> dict[str, str]:
    return {"world_size": str(d.world)} if d.active else {}


def _last(tracker: Tracker, key: str) -> int:
    s = tracker.last_logged_step(key)
    return -1 if s is None else s


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread() and os.name == "posix"
