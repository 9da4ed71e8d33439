"""MLflow tracking for stppo runs, and the metric keys / run tags of DESIGN.md §4.

The constants below are the one place these strings are spelled (CONVENTIONS.md 5): the trainer,
sweeps, analysis and the dashboard import them. This module is torch-free and imports mlflow
lazily, so `analysis/` and `dashboard/` can use the constants cheaply.
Every metric is reduced the same way over minibatches: mean, except `*_max` keys (max).
"""

from __future__ import annotations

# --- actor -------------------------------------------------------------------------------------
PG_LOSS = "actor/pg_loss"
PG_LOSS_NORM = "actor/pg_loss_norm"
PG_CLIPFRAC = "actor/pg_clipfrac"
PG_CLIPFRAC_HIGH = "actor/pg_clipfrac_high"
PG_CLIPFRAC_LOW = "actor/pg_clipfrac_low"
# verl's name (its losses and stppo's verl plugin): share of agent tokens where the dual clip
# binds (A < 0, ρ > c) — not the lower trust-region clip, which is PG_CLIPFRAC_LOW.
PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
PPO_KL = "actor/ppo_kl"
KL_REF = "actor/kl_ref"
ENTROPY = "actor/entropy"
GRAD_NORM = "actor/grad_norm"
GRAD_NORM_MAX = "actor/grad_norm_max"
LR = "actor/lr"
RATIO_MEAN = "actor/ratio_mean"
RATIO_MAX = "actor/ratio_max"
SKIPPED_STEPS = "actor/skipped_steps"

# --- clipping bias (the paper's diagnostic and its corrections) -------------------------------
CLIP_BIAS_NORM = "clip_bias/norm"
CLIP_BIAS_NORM_MAX = "clip_bias/norm_max"
CLIP_BIAS_GRAD_NORM = "clip_bias/grad_norm"
CLIP_BIAS_SCALE = "clip_bias/scale"
CLIP_BIAS_TRIGGERED = "clip_bias/triggered"

# --- baselines' own diagnostics (stppo.algos.baselines; DESIGN.md §2) ---------------------------
COV_SELECTED_FRAC = "actor/cov_selected_frac"  # clip_cov: tokens detached; kl_cov: tokens penalised
BAPO_CLIP_LOW = "actor/bapo_clip_low"  # the adaptive ratio bounds c_low, c_high BAPO chose
BAPO_CLIP_HIGH = "actor/bapo_clip_high"
BAPO_POS_SHARE = "actor/bapo_pos_share"  # ρ: positive-advantage tokens' share of the loss

# --- DAPO's dynamic sampling and overlong reward shaping (stppo.train.dapo) --------------------
DS_ROLLOUTS = "dynamic_sampling/rollouts"  # rollout calls this step (1 = no refill needed)
DS_GROUPS_ROLLED = "dynamic_sampling/groups_rolled_out"
DS_GROUPS_DROPPED = "dynamic_sampling/groups_dropped"  # groups whose rewards all agree
DS_GROUPS_FILLED = "dynamic_sampling/filler_groups"  # dropped groups put back: refills ran out
OVERLONG_PENALTY_MEAN = "overlong/penalty_mean"
OVERLONG_FRAC = "overlong/penalised_frac"

# --- critic / advantages -----------------------------------------------------------------------
VF_LOSS = "critic/vf_loss"
VF_CLIPFRAC = "critic/vf_clipfrac"
CRITIC_GRAD_NORM = "critic/grad_norm"
VF_EXPLAINED_VAR = "critic/vf_explained_var"
ADV_MEAN = "critic/advantages_mean"
ADV_STD = "critic/advantages_std"
ADV_MAX = "critic/advantages_max"
ADV_MIN = "critic/advantages_min"
RETURNS_MEAN = "critic/returns_mean"
VALUES_MEAN = "critic/values_mean"
# critic warm start (trainer.critic_warmstart), logged once at step 0: held-out explained variance
# of the critic before and after its fit to the warm-started policy's Monte-Carlo returns
CRITIC_WS_EV_BEFORE = "critic_warmstart/explained_var_before"
CRITIC_WS_EV_AFTER = "critic_warmstart/explained_var_after"
CRITIC_WS_LOSS = "critic_warmstart/value_loss"

# --- environment -------------------------------------------------------------------------------
SUCCESS_RATE = "env/success_rate"
VALID_ACTION_RATIO = "env/valid_action_ratio"
NUM_TURNS_MEAN = "env/num_turns_mean"
NUM_SEARCHES_MEAN = "env/num_searches_mean"
FINISH_RATIO = "env/finish_ratio"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
VAL_SUCCESS_RATE = "val/success_rate"

# --- performance -------------------------------------------------------------------------------
STEP_TIME = "perf/step_time_s"
ROLLOUT_TIME = "perf/rollout_time_s"
UPDATE_TIME = "perf/update_time_s"
TOKENS_PER_S = "perf/tokens_per_s"
GPU_PEAK_MEM = "perf/gpu_peak_mem_gb"  # CUDA runs: peak memory allocated by this process so far

# --- collapse ----------------------------------------------------------------------------------
COLLAPSE_DETECTED = "collapse/detected"
COLLAPSE_STEP = "collapse/step"
COLLAPSE_ROLLBACKS = "collapse/rollbacks"  # cumulative count of rollbacks (trainer.on_alarm=rollback)

# --- groups without signal (group presets: every reward of a group equal) -----------------------
ZERO_STD_GROUP_FRAC = "env/zero_std_group_frac"
ALL_ZERO_GROUP_FRAC = "env/all_zero_group_frac"
ALL_ONE_GROUP_FRAC = "env/all_one_group_frac"

# --- sampler vs trainer log-probs (verl's rollout_corr names; abs_diff_* are stppo's) -----------
# Logged every step from the rollout's sampling log-probs and the recomputed old log-probs; the
# token IS weights ω = min(exp(log p_old − log p_rollout), C) (stppo.algos.rollout_is, the TIS
# correction's weights) give the rollout_is_* statistics whether or not TIS is applied.
ROLLOUT_CORR_KL = "rollout_corr/kl"  # mean (log p_rollout - log p_old)
ROLLOUT_CORR_K3_KL = "rollout_corr/k3_kl"
ROLLOUT_CORR_LOG_PPL_DIFF = "rollout_corr/log_ppl_diff"
ROLLOUT_CORR_ABS_DIFF_MAX = "rollout_corr/abs_diff_max"
ROLLOUT_CORR_ABS_DIFF_MEAN = "rollout_corr/abs_diff_mean"
ROLLOUT_IS_MEAN = "rollout_corr/rollout_is_mean"
ROLLOUT_IS_MAX = "rollout_corr/rollout_is_max"
ROLLOUT_IS_ESS = "rollout_corr/rollout_is_eff_sample_size"
ROLLOUT_IS_FRACTION_HIGH = "rollout_corr/rollout_is_ratio_fraction_high"
ROLLOUT_IS_FRACTION_LOW = "rollout_corr/rollout_is_ratio_fraction_low"

# --- per turn: `turn/k{k}/{name}` for k = 0 .. max_turns-1 ------------------------------------
TURN_PREFIX = "turn/k"
TURN_METRICS: tuple[str, ...] = ("pg_clipfrac", "ratio_mean", "ratio_max", "adv_mean", "ppo_kl", "entropy",
                                 "tokens")

# --- online alarms (stppo.alarms): `alarm/<indicator>` = 1.0 at the step the alarm fires ----------
ALARM_PREFIX = "alarm/"

# --- sampled trajectories: MLflow table artifacts `samples/step_{step:06d}.json` ----------------
SAMPLES_DIR = "samples"
TAG_SAMPLES_STEPS = "samples_steps"  # run tag: the steps written, comma-separated
SAMPLE_COLUMNS: tuple[str, ...] = ("step", "sample", "question", "answers", "reward", "segment", "role", "turn",
                                   "text", "action", "ratio_mean", "ratio_max", "advantage_mean", "collapse_step")
SAMPLE_ROLES: tuple[str, ...] = ("prompt", "agent", "observation")
SAMPLE_ACTIONS: tuple[str, ...] = ("search", "answer", "invalid", "")


def turn_key(k: int, name: str) -> str:
    """The key of per-turn metric `name` (one of TURN_METRICS) at turn index k: `turn/k{k}/{name}`."""
    if name not in TURN_METRICS:
        raise ValueError(f"unknown per-turn metric {name!r}; valid: {', '.join(TURN_METRICS)}")
    if int(k) < 0:
        raise ValueError(f"turn index must be >= 0, got {k}")
    return f"{TURN_PREFIX}{int(k)}/{name}"


def parse_turn_key(key: str) -> tuple[int, str] | None:
    """(k, name) of a `turn/k{k}/{name}` key, None for any other key."""
    if not key.startswith(TURN_PREFIX):
        return None
    head, _, name = key[len(TURN_PREFIX):].partition("/")
    if not head.isdigit() or name not in TURN_METRICS:
        return None
    return int(head), name


def alarm_key(indicator: str) -> str:
    """The key logged (1.0) at the step an online alarm of `indicator` fires: `alarm/<indicator>`."""
    return f"{ALARM_PREFIX}{indicator}"


def samples_artifact(step: int) -> str:
    """The run-relative path of the sampled trajectories logged at `step`."""
    return f"{SAMPLES_DIR}/step_{int(step):06d}.json"


ALL_METRICS: tuple[str, ...] = tuple(
    v for k, v in dict(globals()).items()
    if k.isupper() and isinstance(v, str) and "/" in v and not k.endswith("_PREFIX")
)

# Keys reduced by max / min (not mean) over minibatches and ranks.
MAX_REDUCED: frozenset[str] = frozenset(k for k in ALL_METRICS if k.endswith("_max"))
MIN_REDUCED: frozenset[str] = frozenset(k for k in ALL_METRICS if k.endswith("_min"))

# --- run tags ----------------------------------------------------------------------------------
TAG_ALGO = "algo"
TAG_MODEL = "model"
TAG_TASK = "task"
TAG_SEED = "seed"
TAG_SWEEP = "sweep"
TAG_GIT_COMMIT = "git_commit"
TAG_TRIAL = "trial"
TAG_STUDY = "study"
TAG_BACKEND = "backend"  # 'verl' on runs trained by verl (stppo.integrations.verl); absent: own trainer
RUN_TAGS: tuple[str, ...] = (TAG_ALGO, TAG_MODEL, TAG_TASK, TAG_SEED, TAG_SWEEP, TAG_GIT_COMMIT)


def reduce_name(key: str) -> str:
    """'max' for `*_max` keys, 'min' for `*_min` keys, 'mean' otherwise (CONVENTIONS.md 5);
    per-turn keys by their name (`turn/k2/ratio_max` -> 'max')."""
    turn = parse_turn_key(key)
    if turn is not None:
        return "max" if turn[1].endswith("_max") else "mean"
    return "max" if key in MAX_REDUCED else "min" if key in MIN_REDUCED else "mean"


def known_metric(key: str) -> bool:
    """A key of DESIGN.md §4: one of ALL_METRICS, a per-turn key or an alarm key."""
    return key in ALL_METRICS or parse_turn_key(key) is not None or key.startswith(ALARM_PREFIX)


# ================================================================================================
# MLflow logging
# ================================================================================================
import contextlib  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Mapping  # noqa: E402

from stppo.tracking_io import (TAG_PROCESS, append_line, call, close_run, first_line,  # noqa: E402
                               flush_file, flush_pending, is_transient, make_client, process_token,
                               reap_dead_runs, send_rows, write_json)

log = logging.getLogger(__name__)
DEFAULT_URI = "sqlite:///mlflow.db"
PARAM_CHUNK = 100  # MLflow accepts at most 100 params per log_batch
RETRY_AFTER_S = 30.0  # while the store is unreachable, metrics go straight to disk; retry this often


def resolve_uri(uri: str | None = None) -> str:
    """The tracking URI: explicit, else $MLFLOW_TRACKING_URI, else ./mlflow.db (sqlite)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def absolute_uri(uri: str) -> str:
    """A sqlite URI with its path made absolute (for commands run from another directory, and for
    Ray's workers, which do not share the job's working directory); other URIs unchanged."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/") and uri != prefix + ":memory:":
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping → {'a.b.c': 'value'} (the run's params)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


class Tracker:
    """One MLflow run per job, logged in one batch per step.

    Robustness: sqlite lock contention between parallel jobs is retried; if the store becomes
    unreachable mid-run, training goes on and each step's metrics are appended to
    `<buffer_dir>/<run_id>.jsonl` (one warning), then flushed in order when the store answers again
    (tried at most every `retry_after_s`, and always at `finish`). A batch is removed from the buffer
    only after the store accepted it, and a re-sent batch is idempotent (same key, step, timestamp,
    value), so a failed or interrupted flush neither loses nor duplicates a line. If the run cannot
    be closed either, its final status waits in `<run_id>.status.json` and is sent by the next job
    on the same store, or by `python -m stppo.tracking flush`. Runs left RUNNING by a process that
    died without closing them (SIGKILL, OOM) are marked KILLED when the next job on this host starts.
    """

    def __init__(self, uri: str | None, experiment: str, *, buffer_dir: str | os.PathLike = ".stppo_buffer",
                 enabled: bool = True, retry_after_s: float | None = None) -> None:
        self.uri = resolve_uri(uri)
        self.experiment = experiment
        self.enabled = enabled
        self.run_id: str | None = None
        self.retry_after_s = RETRY_AFTER_S if retry_after_s is None else retry_after_s
        self._client = None
        self._buffer_dir = Path(buffer_dir)
        self._retry_at = 0.0  # monotonic time before which the store is not tried again
        self._warned = False

    @property
    def client(self):
        if self._client is None:
            self._client = call(make_client, self.uri)
        return self._client

    def start(self, *, tags: Mapping[str, Any], params: Mapping[str, str], run_name: str | None = None,
              run_id: str | None = None, artifacts: Mapping[str, str] | None = None) -> str | None:
        """Open a new run (or re-open `run_id` when resuming). Returns the run id.

        Raises ConnectionError (one line) when the store cannot be reached at all."""
        if not self.enabled:
            return None
        try:
            return self._start(tags, params, run_name, run_id, artifacts or {})
        except Exception as e:
            if not is_transient(e):
                raise
            raise ConnectionError(f"tracking store {self.uri} is unreachable ({first_line(e)}); start the "
                                  "server or set tracking.uri / MLFLOW_TRACKING_URI") from None

    def _start(self, tags, params, run_name, run_id, artifacts) -> str:
        client = self.client
        exp_id = self._experiment_id()
        proc = {TAG_PROCESS: process_token()}
        if run_id is not None:  # resuming: the same run continues, owned by this process now
            call(client.update_run, run_id, status="RUNNING")
            for k, v in proc.items():
                call(client.set_tag, run_id, k, v)
            with contextlib.suppress(Exception):  # the note a reaper or a failure left
                call(client.delete_tag, run_id, "error")
            self.run_id = run_id
        else:
            run = call(client.create_run, exp_id, run_name=run_name,
                       tags={**{k: str(v) for k, v in tags.items()}, **proc})
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), PARAM_CHUNK):
                call(client.log_batch, self.run_id, params=items[i:i + PARAM_CHUNK])
            for name, text in artifacts.items():
                call(client.log_text, self.run_id, text, name)
        self._housekeeping(exp_id)
        return self.run_id

    def _experiment_id(self) -> str:
        exp = call(self.client.get_experiment_by_name, self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return call(self.client.create_experiment, self.experiment)
        except Exception:  # another job created it between the two calls
            exp = call(self.client.get_experiment_by_name, self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def _housekeeping(self, exp_id: str) -> None:
        """Best effort: flush what dead jobs left in the buffer, close runs whose process died."""
        try:
            flush_pending(self.uri, self._buffer_dir, client=self.client)
            reap_dead_runs(self.client, exp_id, keep=self.run_id)
        except Exception as e:  # never fail a job for someone else's leftovers
            log.warning("stppo: tracking housekeeping skipped (%s)", first_line(e))

    def last_logged_step(self, key: str = STEP_TIME) -> int | None:
        """The last step with `key` logged (a step's metrics are written in one batch)."""
        if not self.enabled or self.run_id is None:
            return None
        self._flush_buffer()
        hist = call(self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in hist), default=None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step's metrics in one batch; never raises for an unreachable store."""
        if not self.enabled or self.run_id is None or not metrics:
            return
        ts = int(time.time() * 1000)
        rows = [[k, _finite_or_nan(v), ts, int(step)] for k, v in metrics.items()]
        if time.monotonic() < self._retry_at:
            self._buffer(rows)
            return
        try:
            self._flush_buffer()
            self._send(rows)
        except Exception as e:
            self._on_error(e, rows)

    def log_table(self, artifact_file: str, frame) -> None:
        """Log a table artifact (MLflow's `log_table` JSON, e.g. `samples_artifact(step)`). Best
        effort: a store that refuses or is away costs a warning, never the run."""
        if not self.enabled or self.run_id is None:
            return
        try:
            call(self.client.log_table, self.run_id, frame, artifact_file)
        except Exception as e:  # noqa: BLE001 - diagnostics must not stop training
            log.warning("stppo: could not log %s (%s)", artifact_file, first_line(e))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled and self.run_id is not None:
            for k, v in tags.items():
                call(self.client.set_tag, self.run_id, k, str(v)[:5000])

    def finish(self, status: str = "FINISHED", error: str | None = None) -> None:
        """Flush, record the error (if any) and close the run. Never raises: if the store is
        unreachable, the status waits on disk with the metrics (see the class docstring)."""
        if not self.enabled or self.run_id is None:
            return
        tags = {"error": error, "mlflow.note.content": f"Run ended with an error:\n{error}"} if error else {}
        try:
            self._flush_buffer()
            close_run(self.client, self.run_id, status, tags)
        except Exception as e:
            self._buffer_dir.mkdir(parents=True, exist_ok=True)
            end = int(time.time() * 1000)
            write_json(self._status_path(self.run_id), {"uri": self.uri, "status": status, "tags": tags,
                                                        "end_time": end})
            log.warning("stppo: could not close run %s on %s (%s); its metrics and final status %s are "
                        "kept in %s and sent by the next run on this store or by "
                        "`python -m stppo.tracking flush --uri %s`", self.run_id, self.uri,
                        first_line(e), status, self._buffer_dir, self.uri)

    # -- buffering --------------------------------------------------------------------------------
    @property
    def _buffer_path(self) -> Path:
        return self._buffer_dir / f"{self.run_id}.jsonl"

    def _status_path(self, run_id: str) -> Path:
        return self._buffer_dir / f"{run_id}.status.json"

    def _send(self, rows) -> None:
        send_rows(self.client, self.run_id, rows)

    def _on_error(self, err: Exception, rows) -> None:
        if not is_transient(err):  # the store rejected the batch itself: keep it aside, go on
            path = self._buffer_dir / f"{self.run_id}.rejected.jsonl"
            log.warning("stppo: %s rejected metrics (%s); kept in %s", self.uri, first_line(err), path)
            append_line(path, {"uri": self.uri, "rows": rows})
            return
        if not self._warned:
            log.warning("stppo: tracking store %s unreachable (%s); training goes on, metrics are buffered "
                        "in %s and sent when it answers again", self.uri, first_line(err), self._buffer_path)
            self._warned = True
        self._retry_at = time.monotonic() + self.retry_after_s
        self._buffer(rows)

    def _buffer(self, rows) -> None:
        append_line(self._buffer_path, {"uri": self.uri, "rows": rows})

    def _flush_buffer(self) -> None:
        if flush_file(self.client, self.run_id, self._buffer_path) and self._warned:
            log.warning("stppo: tracking store %s is back; buffered metrics flushed", self.uri)
            self._warned = False
        self._retry_at = 0.0


def _finite_or_nan(v: float) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")


def main(argv: list[str] | None = None) -> int:
    """`python -m stppo.tracking flush|reap [--uri URI] [--buffer-dir DIR]`.

    flush: send the buffered metrics and final statuses that jobs could not deliver (the store was
    unreachable when they ended). reap: mark KILLED the RUNNING runs, in every experiment, whose
    job process on this machine no longer exists (each job also does this for its own experiment)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m stppo.tracking")
    p.add_argument("command", choices=["flush", "reap"])
    p.add_argument("--uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--buffer-dir", default=".stppo_buffer")
    a = p.parse_args(argv)
    uri = resolve_uri(a.uri)
    if a.command == "flush":
        print(f"flushed {flush_pending(uri, a.buffer_dir)} run(s) from {a.buffer_dir} to {uri}")
    else:
        client = make_client(uri)
        n = sum(len(reap_dead_runs(client, e.experiment_id)) for e in call(client.search_experiments))
        print(f"marked {n} orphaned run(s) KILLED in {uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
