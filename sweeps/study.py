"""Optuna studies over stppo runs: resuming a killed study, and turning a finished job into a
trial state (COMPLETE / PRUNED / FAIL) through its MLflow run.

Objective (maximised): the trainer's objective — the mean greedy validation success rate
(`val/success_rate`) over the last 20% of the run's steps (`stppo.train.loop.Trainer.objective`).

Pruning: a sweep runs with `trainer.stop_on_collapse=true`, so the trainer's online collapse
detector (`stppo.diagnostics`, the one definition of collapse) ends a collapsing run early. Such a
trial is told PRUNED: its validation curve is reported as intermediate values (step → success), so
Optuna stores the last one as its value, as the dashboard expects. Hydra's job API has no pruning
hook, so the verdict is read from the run's `collapse/detected` metric once the job returns.

Resume: `n_trials` is the study's total. A rerun of the same command loads the study
(`load_if_exists`), marks the trials a dead sweep process left RUNNING as FAIL, enqueues their
parameters again, and runs only the trials still missing, so trial numbers continue.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from stppo import metric_names as K
from stppo.tracker import resolve_uri
from stppo.mlflow_store import first_line, process_alive, process_token

OWNER_ATTR = "sweeper_process"  # 'host:pid:start' of the sweep process that asked the trial
RETRY_ATTR = "retry_of"  # set on a re-enqueued trial: the number of the interrupted one
RUN_ID_ATTR = "mlflow_run_id"  # read by analysis/sweeps.py and the dashboard


@dataclass
class Outcome:
    """What a finished job means for its trial."""

    state: TrialState
    value: float | None = None
    run_id: str = ""
    intermediate: list[tuple[int, float]] = field(default_factory=list)  # (step, val success)
    error: str = ""
    collapse_step: int | None = None


def default_study_name(sweep: str, algo: str) -> str:
    """One study (and one MLflow experiment) per sweep and preset, e.g. 'clip_range-st_ppo'."""
    return f"{sweep}-{algo}"


def claim(trial: optuna.trial.Trial) -> None:
    """Record which process runs `trial`, so a later sweep can tell if it was orphaned."""
    trial.set_user_attr(OWNER_ATTR, process_token())


def interrupt(study: optuna.Study, trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> None:
    """A trial whose job was killed: FAIL it and enqueue its parameters to run again."""
    study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    study.enqueue_trial(dict(trial.params), user_attrs={RETRY_ATTR: trial.number})


def resume(study: optuna.Study, n_trials: int) -> int:
    """Prepare a loaded study; returns how many trials are still to run to reach `n_trials`.

    Trials left RUNNING by a sweep process of this host that no longer exists are interrupted
    (FAIL, parameters re-enqueued); the sampler is reseeded so that it does not repeat the first
    invocation's draws. Counted as done: COMPLETE, PRUNED, and FAIL trials that were
    not interrupted (a trial that fails by itself is not retried forever)."""
    host = socket.gethostname() + ":"
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = str(t.user_attrs.get(OWNER_ATTR, ""))
        if owner.startswith(host) and not process_alive(owner):
            interrupt(study, t)
    trials = study.get_trials(deepcopy=False)
    if trials:  # a seeded sampler would otherwise replay the first invocation's samples
        study.sampler.reseed_rng()
    retried = {t.user_attrs[RETRY_ATTR] for t in trials if RETRY_ATTR in t.user_attrs}
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and t.number not in retried)]
    return max(0, n_trials - len(done))


def find_run(uri: str, experiment: str, study_name: str, number: int):
    """The MLflow run of trial `number` (tags study/trial), or None."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                              filter_string=f"tags.{K.TAG_STUDY} = '{study_name}' and "
                                            f"tags.{K.TAG_TRIAL} = '{number}'")
    return runs[0] if runs else None


def outcome(job_value: Any, job_error: BaseException | None, tracking: Any, study_name: str,
            number: int) -> Outcome:
    """The trial's outcome from the job's return value or error and its MLflow run.

    `tracking` is the job's `tracking` config section (uri, experiment, enabled)."""
    out = Outcome(TrialState.FAIL, error=first_line(job_error) if job_error is not None else "")
    if job_error is None:
        try:
            out.value = float(job_value)
        except (TypeError, ValueError):
            out.error = f"the job returned {job_value!r}, not a number"
    run = None
    if tracking is not None and tracking.enabled:
        uri = resolve_uri(tracking.uri)
        try:
            run = find_run(uri, tracking.experiment, study_name, number)
        except Exception as e:  # noqa: BLE001 - no run: the job's own result decides
            out.error = out.error or f"MLflow run not readable: {first_line(e)}"
    if run is not None:
        out.run_id = run.info.run_id
        out.intermediate = _history(uri, out.run_id, K.VAL_SUCCESS_RATE)
        if run.data.metrics.get(K.COLLAPSE_DETECTED, 0.0) >= 1.0:
            step = _history(uri, out.run_id, K.COLLAPSE_STEP)
            out.collapse_step = int(step[-1][1]) if step else None
            out.state = TrialState.PRUNED
            return out
    if out.value is not None and math.isfinite(out.value) and not out.error:
        out.state = TrialState.COMPLETE
    elif not out.error:
        out.error = f"non-finite objective {out.value}"
    return out


def tell(study: optuna.Study, trial: optuna.trial.Trial, out: Outcome) -> None:
    """Report the validation curve, record the run id / error, and finish the trial."""
    for step, value in dict(out.intermediate).items():  # one value per step
        if math.isfinite(value):
            trial.report(value, step)
    if out.run_id:
        trial.set_user_attr(RUN_ID_ATTR, out.run_id)
    if out.error:
        trial.set_user_attr("error", out.error[:1000])
    if out.collapse_step is not None:
        trial.set_user_attr("collapse_step", out.collapse_step)
    try:
        if out.state == TrialState.COMPLETE:
            study.tell(trial, out.value)
        else:
            study.tell(trial, state=out.state)
    except RuntimeError as e:  # GridSampler stops the study once its grid is done (trial is told)
        if "Study.stop" not in str(e):
            raise


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))
