"""Hydra entry point: compose the config, train one run, return its objective.

    python run.py                                   # the default run (st_ppo, tiny, the testbed)
    python run.py algo=ppo seed=1                   # any preset / seed
    python run.py +experiment=collapse_stress       # a named study setting (conf/experiment/)
    python run.py -m algo=ppo,s_ppo,st_ppo seed=0,1,2   # a study (multirun): 9 jobs
    python run.py -m hydra/launcher=joblib ...          # parallel jobs (also submitit_local/_slurm)
    python run.py -m +sweep=clip_range algo=st_ppo      # Optuna clip-range study (sweeps/)

Errors a user can cause (a bad override, a missing file, an unreachable server) end with one line
on stderr and exit status 1 (HYDRA_FULL_ERROR=1 shows the traceback). In a multirun, a job that
raises leaves a FAILED MLflow run with its error, the other jobs go on, and the command ends with
one line naming the failed jobs. SIGTERM/SIGHUP close the current run KILLED and stop the command.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from stppo.config import register_configs
from sweeps import register_hydra_plugins

register_configs()
register_hydra_plugins()
log = logging.getLogger("run")
FAILED_JOBS = "failed_jobs.txt"  # in the sweep dir: one line per failed job of a multirun
SHOW_TRACEBACK = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user asked for tracebacks


class JobFailed(RuntimeError):
    """A multirun job that raised: JobFailed(line naming the job and its error, sweep dir)."""

    def __str__(self) -> str:
        return str(self.args[0])


@hydra.main(config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from stppo.config import to_config

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and not cfg.tracking.sweep:  # tag the study's runs with the multirun's folder
        cfg.tracking.sweep = str(hc.sweep.dir)
    validated = False
    try:
        to_config(cfg)  # a bad setting fails here, in one line, before a run or verl starts
        validated = True
        if cfg.backend.name == "verl":  # verl trains in a subprocess (stppo.integrations.verl)
            from stppo.integrations.verl.launcher import Terminated, run
        else:
            from stppo.train.job import Terminated, run

        if _main_thread():
            signal.signal(signal.SIGHUP, _raise_terminated)
        try:
            return run(cfg)
        except Terminated as e:  # stop the whole command, not just this job (run is closed KILLED)
            log.error("stopped: %s", e)
            raise SystemExit(128 + signal.SIGTERM) from None
    except Exception as e:
        if not multirun:
            if SHOW_TRACEBACK or not is_user_error(e):
                raise
            print(f"run.py: error: {one_line(e)}", file=sys.stderr)  # the one line, no traceback
            raise SystemExit(1) from None
        line = f"job #{hc.job.num} failed: {one_line(e)} [{' '.join(hc.overrides.task)}]"
        log.error(line)
        if not validated:  # the trainer never opened a run: leave the FAILED run here
            _record_invalid_job(cfg, one_line(e))
        with open(Path(hc.sweep.dir) / FAILED_JOBS, "a") as f:
            f.write(line + "\n")
        raise JobFailed(line, str(hc.sweep.dir)) from e


def _record_invalid_job(cfg: DictConfig, error: str) -> None:
    """A FAILED MLflow run for a multirun job whose settings are invalid (best effort)."""
    from omegaconf import OmegaConf

    from stppo import metric_names as K
    from stppo.tracker import Tracker, flatten

    def sel(key: str) -> str:
        return str(OmegaConf.select(cfg, key, default="") or "")

    if OmegaConf.select(cfg, "tracking.enabled", default=True) is False:
        return
    try:
        tracker = Tracker(sel("tracking.uri") or None, sel("tracking.experiment") or "stppo",
                          buffer_dir=sel("tracking.buffer_dir") or ".stppo_buffer")
        tags = {K.TAG_ALGO: sel("algo.name"), K.TAG_MODEL: sel("model.name"), K.TAG_TASK: sel("task.name"),
                K.TAG_SEED: sel("seed"), K.TAG_SWEEP: sel("tracking.sweep"),
                **(OmegaConf.to_container(cfg.tracking.tags) if "tags" in cfg.tracking else {})}
        tracker.start(tags=tags, params=flatten(OmegaConf.to_container(cfg, resolve=False)),
                      run_name=sel("tracking.run_name") or None)
        tracker.finish("FAILED", error=error)
    except Exception as e:  # noqa: BLE001 - the job's failure is reported anyway
        log.warning("could not record the failed job in MLflow: %s", e)


def _raise_terminated(signum, frame):
    from stppo.train.job import Terminated

    raise Terminated(f"received {signal.Signals(signum).name}")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# -- error reporting ---------------------------------------------------------------------------
def is_user_error(e: BaseException) -> bool:
    """Errors whose message is the whole story: bad settings, missing files, unreachable servers."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from stppo.integrations.verl.launcher import VerlFailed
    from sweeps.hydra_sweeper import StudyFailed

    return isinstance(e, (ValueError, FileNotFoundError, ConnectionError, JobFailed, StudyFailed,
                          VerlFailed, HydraException, OmegaConfBaseException))


def one_line(e: BaseException) -> str:
    """An exception as one line: Hydra's multi-line composition errors folded ('Available options
    in 'algo': grpo, gspo, …'), OmegaConf's key details ('full_key: …') dropped."""
    parts: list[str] = []
    for raw in str(e).split("\n"):
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        if not line or line.startswith(("full_key:", "reference_type", "object_type")):
            continue
        if raw.startswith("\t") and parts and parts[-1].endswith(":"):  # first listed option
            parts[-1] += " " + line
        elif raw.startswith("\t") and parts:
            parts[-1] += ", " + line
        else:
            parts.append(line)
    cause = e.__cause__
    if cause is not None and not isinstance(e, JobFailed) and str(cause).strip():
        parts.append(one_line(cause))
    text = "; ".join(parts) or type(e).__name__
    return text if is_user_error(e) else f"{type(e).__name__}: {text}"


def _multirun_summary(e: JobFailed) -> str:
    """For a failed multirun: every failed job, from the sweep dir's record."""
    path = Path(e.args[1]) / FAILED_JOBS if len(e.args) > 1 else None
    lines = path.read_text().splitlines() if path is not None and path.exists() else []
    if len(lines) <= 1:
        return one_line(e)
    return f"{len(lines)} jobs failed (their MLflow runs are FAILED with the error): " + " | ".join(lines)


def cli() -> int:
    """Run `main` and turn user errors into one line on stderr (exit 1)."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's printer
    try:
        main()
    except KeyboardInterrupt:
        print("run.py: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if SHOW_TRACEBACK or not is_user_error(e):
            raise
        msg = _multirun_summary(e) if isinstance(e, JobFailed) else one_line(e)
        print(f"run.py: error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
