"""stppo's Hydra plugins: the pruning Optuna sweeper (`hydra/sweeper=stppo_optuna`, used by
`+sweep=clip_range`) and the schemas that the launcher presets in `conf/hydra/launcher/` extend.

`register()` makes Hydra see them; run.py calls it at import, tests call it before `compose`.

The sweeper is Hydra's Optuna sweeper (hydra-optuna-sweeper 1.4.0rc3: same search-space syntax,
samplers and storage) with three changes (see `sweeps.study`):
- a collapsed trial is PRUNED (read from its MLflow run), with its validation curve as
  intermediate values; failed trials are FAIL and the study goes on while the failure rate stays
  within `max_failure_rate`;
- `n_trials` is the study's total, so rerunning a killed study finishes it (trials continue);
- every trial logs to the study's MLflow experiment, tagged `study`, `trial` (and `sweep`), and
  the preset's clip-bias τ joins the search space through `clip_bias_params`.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import optuna
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from stppo import metric_names as K
from sweeps import study as S

log = logging.getLogger(__name__)


@dataclass
class StppoOptunaSweeperConf(OptunaSweeperConf):
    _target_: str = "sweeps.hydra_sweeper.StppoOptunaSweeper"
    direction: Any = "maximize"  # the trainer's objective: late validation success
    storage: Any = "sqlite:///optuna.db"
    n_trials: int = 20  # the study's total (a rerun finishes a killed study)
    n_jobs: int = 1  # trials per batch (run in parallel by a parallel launcher)
    max_failure_rate: float = 0.5  # stop when more than this fraction of launched trials failed
    # extra search space by the preset's clip-bias kind, e.g. {clip_bias_norm: {algo.clip_bias.tau: ...}}
    clip_bias_params: dict[str, dict[str, str]] = field(default_factory=dict)


class StudyFailed(RuntimeError):
    """Too many trials failed (more than `max_failure_rate`); the message says which error."""


class PruningOptunaSweeperImpl(OptunaSweeperImpl):
    clip_bias_params: dict[str, dict[str, str]] = {}

    def sweep(self, arguments: list[str]) -> None:
        self._process_searchspace_config()
        params_conf = self._parse_sweeper_params_config() + self._clip_bias_overrides() + list(arguments)
        dists, fixed, fixed_overrides = create_params_from_overrides(params_conf)
        for name in fixed:
            dists.pop(name, None)
        if isinstance(self.sampler, functools.partial) and self.sampler.func is optuna.samplers.GridSampler:
            grid = {name: self._to_grid_sampler_choices(d) for name, d in dists.items()}
            self.sampler = self.sampler(grid)  # hydra/sweeper/sampler=grid: at most one trial per point
            self.n_trials = min(self.n_trials, math.prod(len(v) for v in grid.values()))
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                    directions=self._get_directions(), load_if_exists=True)
        todo = S.resume(study, self.n_trials)
        log.info("Optuna study %r in %s: %d of n_trials=%d trial(s) to run; search space: %s",
                 study.study_name, self.storage, todo, self.n_trials, ", ".join(dists) or "none")
        launched = failed = 0
        while todo > 0:
            trials = [study.ask() for _ in range(min(self.n_jobs, todo))]
            for t in trials:
                S.claim(t)
            overrides = [tuple(o) + self._trial_overrides(study.study_name, t.number) for o, t in
                         zip(self._configure_trials(trials, dists, fixed, fixed_overrides), trials)]
            try:
                returns = self.launcher.launch(overrides, initial_job_idx=self.job_idx)
            except BaseException:  # Ctrl-C, SIGTERM, a launcher error: the trials will run again
                for t in trials:
                    S.interrupt(study, t)
                raise
            self.job_idx += len(returns)
            for t, ret in zip(trials, returns):
                out = S.outcome(*_job_result(ret), _tracking_of(ret), study.study_name, t.number)
                S.tell(study, t, out)
                log.info("trial %d: %s %s", t.number, out.state.name,
                         out.error or (f"value {out.value:.4f}" if out.value is not None else ""))
                failed += out.state == TrialState.FAIL
            launched += len(trials)
            todo -= len(trials)
            if failed / launched > self.max_failure_rate:
                raise StudyFailed(f"{failed} of {launched} trials failed (more than hydra.sweeper."
                                   f"max_failure_rate={self.max_failure_rate}); last error: {out.error}")
        self._save_results(study)

    def _clip_bias_overrides(self) -> list[str]:
        """The search space of the run's clip-bias kind: the override's, else the preset's."""
        kind = OmegaConf.select(self.config, "algo.clip_bias.kind", default=None)
        if kind is None:
            from stppo.algos import PRESETS

            name = OmegaConf.select(self.config, "algo.name", default=None)
            kind = PRESETS[name].clip_bias if name in PRESETS else "none"
        return [f"{k}={v}" for k, v in (self.clip_bias_params.get(kind) or {}).items()]

    def _trial_overrides(self, study_name: str, number: int) -> tuple[str, ...]:
        return (f"tracking.experiment={study_name}", f"tracking.run_name={study_name}-trial{number}",
                f"+tracking.tags.{K.TAG_STUDY}={study_name}", f"+tracking.tags.{K.TAG_TRIAL}={number}")

    def _save_results(self, study: optuna.Study) -> None:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        results: dict[str, Any] = {"name": "optuna", "study": study.study_name, "storage": str(self.storage)}
        if done:
            best = study.best_trial
            results.update(best_params=best.params, best_value=best.value, best_trial=best.number)
            log.info("Best trial %d: value %.4f, params %s", best.number, best.value, best.params)
        OmegaConf.save(OmegaConf.create(results), f"{self.config.hydra.sweep.dir}/optimization_results.yaml")


class StppoOptunaSweeper(Sweeper):
    """Hydra entry of `PruningOptunaSweeperImpl` (constructor = `StppoOptunaSweeperConf`)."""

    def __init__(self, sampler: Any, direction: Any, storage: Any, study_name: str | None, n_trials: int,
                 n_jobs: int, max_failure_rate: float, custom_search_space: str | None,
                 params: DictConfig | None, clip_bias_params: Any = None) -> None:
        sampler = instantiate(sampler, _execution_whitelist_=("hydra_plugins.hydra_optuna_sweeper.*",
                                                              "optuna.samplers.*"))
        self.sweeper = PruningOptunaSweeperImpl(sampler, direction, storage, study_name, n_trials, n_jobs,
                                                max_failure_rate, custom_search_space, params)
        if OmegaConf.is_config(clip_bias_params):
            clip_bias_params = OmegaConf.to_container(clip_bias_params)
        self.sweeper.clip_bias_params = clip_bias_params or {}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        return self.sweeper.sweep(arguments)


def _job_result(ret) -> tuple[Any, BaseException | None]:
    try:
        return ret.return_value, None
    except Exception as e:  # the job raised: JobReturn re-raises its exception
        return None, e


def _tracking_of(ret):
    return ret.cfg.tracking if ret.cfg is not None and "tracking" in ret.cfg else None


def _store_configs() -> None:
    cs = ConfigStore.instance()
    for group, name, node in (("hydra/sweeper", "stppo_optuna", StppoOptunaSweeperConf),
                              ("hydra/launcher", "joblib_schema", JobLibLauncherConf),
                              ("hydra/launcher", "submitit_local_schema", LocalQueueConf()),
                              ("hydra/launcher", "submitit_slurm_schema", SlurmQueueConf())):
        cs.store(group=group, name=name, node=node, provider="stppo", replace=True)


_store_configs()  # at import, as Hydra plugins do (also when loaded through an entry point)


def register() -> None:
    """Make Hydra see the sweeper and the launcher schemas (idempotent)."""
    _store_configs()
    plugins = Plugins.instance()
    if StppoOptunaSweeper not in plugins.discover(Sweeper):
        plugins.register(StppoOptunaSweeper)
