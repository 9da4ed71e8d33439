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

# --- collapse ----------------------------------------------------------------------------------
COLLAPSE_DETECTED = "collapse/detected"
COLLAPSE_STEP = "collapse/step"

ALL_METRICS: tuple[str, ...] = tuple(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and "/" in v
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
RUN_TAGS: tuple[str, ...] = (TAG_ALGO, TAG_MODEL, TAG_TASK, TAG_SEED, TAG_SWEEP, TAG_GIT_COMMIT)


def reduce_name(key: str) -> str:
    """'max' for `*_max` keys, 'min' for `*_min` keys, 'mean' otherwise (CONVENTIONS.md 5)."""
    return "max" if key in MAX_REDUCED else "min" if key in MIN_REDUCED else "mean"


# ================================================================================================
# MLflow logging
# ================================================================================================
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Mapping  # noqa: E402

log = logging.getLogger(__name__)
DEFAULT_URI = "sqlite:///mlflow.db"
PARAM_CHUNK = 100  # MLflow accepts at most 100 params per log_batch


def resolve_uri(uri: str | None = None) -> str:
    """The tracking URI: explicit, else $MLFLOW_TRACKING_URI, else ./mlflow.db (sqlite)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


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

    If the tracking store is unreachable mid-run, metrics go to a local jsonl buffer (with a
    warning) and are flushed, in order, at the next successful call — nothing logged is lost.
    """

    def __init__(self, uri: str | None, experiment: str, *, buffer_dir: str | os.PathLike = ".stppo_buffer",
                 enabled: bool = True) -> None:
        self.uri = resolve_uri(uri)
        self.experiment = experiment
        self.enabled = enabled
        self.run_id: str | None = None
        self._client = None
        self._buffer_dir = Path(buffer_dir)
        self._warned = False

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def start(self, *, tags: Mapping[str, Any], params: Mapping[str, str], run_name: str | None = None,
              run_id: str | None = None, artifacts: Mapping[str, str] | None = None) -> str | None:
        """Open a new run (or re-open `run_id` when resuming). Returns the run id."""
        if not self.enabled:
            return None
        client = self.client
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
        run = client.create_run(exp_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAM_CHUNK):
            client.log_batch(self.run_id, params=items[i:i + PARAM_CHUNK])
        for name, text in (artifacts or {}).items():
            client.log_text(self.run_id, text, name)
        return self.run_id

    def last_logged_step(self, key: str = STEP_TIME) -> int | None:
        """The last step with `key` logged (a step's metrics are written in one batch)."""
        if not self.enabled or self.run_id is None:
            return None
        hist = self.client.get_metric_history(self.run_id, key)
        return max((m.step for m in hist), default=None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled or self.run_id is None or not metrics:
            return
        ts = int(time.time() * 1000)
        rows = [(k, _finite_or_nan(v), ts, step) for k, v in metrics.items()]
        try:
            self._flush_buffer()
            self._send(rows)
        except Exception as e:  # tracking store unreachable: keep training, buffer locally
            self._buffer(rows, e)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled and self.run_id is not None:
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, str(v)[:5000])

    def finish(self, status: str = "FINISHED", error: str | None = None) -> None:
        if not self.enabled or self.run_id is None:
            return
        try:
            self._flush_buffer()
        except Exception as e:
            log.warning("stppo: could not flush buffered metrics to %s (%s); they stay in %s",
                        self.uri, e, self._buffer_path)
        if error:
            self.set_tags({"error": error, "mlflow.note.content": f"Run ended with an error:\n{error}"})
        self.client.set_terminated(self.run_id, status=status)

    # -- buffering --------------------------------------------------------------------------------
    @property
    def _buffer_path(self) -> Path:
        return self._buffer_dir / f"{self.run_id}.jsonl"

    def _send(self, rows) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in rows])

    def _buffer(self, rows, err: Exception) -> None:
        if not self._warned:
            log.warning("stppo: tracking store %s unreachable (%s); buffering metrics in %s",
                        self.uri, str(err).splitlines()[0][:200], self._buffer_path)
            self._warned = True
        self._buffer_dir.mkdir(parents=True, exist_ok=True)
        with open(self._buffer_path, "a") as f:
            f.write(json.dumps(rows) + "\n")

    def _flush_buffer(self) -> None:
        path = self._buffer_path
        if not path.exists():
            return
        for line in path.read_text().splitlines():
            if line.strip():
                self._send([tuple(r) for r in json.loads(line)])
        path.unlink()
        if self._warned:
            log.warning("stppo: tracking store %s is back; buffered metrics flushed", self.uri)
            self._warned = False


def _finite_or_nan(v: float) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")
