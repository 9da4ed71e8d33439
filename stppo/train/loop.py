"""The training loop, top to bottom (docs/design.md; cleanrl's shape):

    for step in 1..S:
        rollout with π_old (or, with trainer.offpolicy.lag > 0, an older policy: offpolicy.py)
        → old/ref log-probs, values → rewards → advantages (prepare.py)
        → ppo_epochs × minibatches of the policy loss, then the critic (update.py)
        → metrics of docs/design.md §4 → alarms (on_alarm: stop / rollback)
        → the live check every `collapse.every` steps: greedy success of the live policy on a
          fixed held-out subset, which the collapse rule reads (stppo.diagnostics)
        → MLflow (one batch per step; sampled trajectories as tables, samples.py)
        → validation every `val_every` steps and at the last → checkpoint every `save_every`

Sampling RNGs derive from (seed, step): a run resumed from a checkpoint (with the stale
rollouts' snapshots of past policies, when on) replays exactly. Steps
are logged in order and never twice: a rollback reloads the weights and optimizer states of the
last checkpoint and the run goes on at the next step number.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from stppo import metric_names as K
from stppo.algos import group_signal_fractions
from stppo.alarms import AlarmSet
from stppo.batch import Batch
from stppo.config import Config, run_identity
from stppo.diagnostics import collapse_detector
from stppo.envs import Question
from stppo.rollout import RolloutConfig, rollout
from stppo.tracker import Tracker
from stppo.train import checkpoint, dapo
from stppo.train.distributed import Dist
from stppo.algos.kl import sampled_k3
from stppo.train.prepare import FORWARD_CHUNK, eval_log_probs, prepare_batch
from stppo.train.samples import SampleRecorder, sample_rows
from stppo.train.offpolicy import sampler_class
from stppo.train.sampler import step_seed
from stppo.train.setup import Components
from stppo.train.update import (UpdateContext, actor_update, critic_update,
                                old_log_probs_from_update)

log = logging.getLogger(__name__)
VAL_CHUNK = 256


def sample_questions(pool: list[Question], n: int, seed: int, step: int) -> list[Question]:
    """Step `step` (1-based) of an epoch-wise shuffled pass over the pool (no repeats in an epoch)."""
    per_epoch = max(1, len(pool) // n)
    epoch, k = divmod(step - 1, per_epoch)
    order = list(range(len(pool)))
    random.Random(step_seed(seed, epoch, "questions")).shuffle(order)
    return [pool[i] for i in order[k * n:(k + 1) * n]]


@torch.no_grad()
def step_kl(policy, batch: Batch, before: torch.Tensor | None, precision) -> float:
    """`actor/step_kl`: the mean over the agent tokens of the first row of each group of k3 =
    e^r − 1 − r, r = log π_after − log π_before — KL(π_before ‖ π_after) of the step's update
    (π_before: the live policy's log-probs `before`; the sampler's when the update took π_old
    from its own forward, which on-policy are π_old's up to the engine's rounding). One no-grad
    forward of those rows."""
    rows = torch.tensor(sample_rows(batch, len(batch)), dtype=torch.long, device=batch.input_ids.device)
    mb = batch.select(rows)
    ref = (before if before is not None else batch.rollout_log_probs)[rows]
    with precision.autocast():
        after = eval_log_probs(policy, mb, len(mb))
    return float(sampled_k3(after, ref)[mb.loss_mask].mean()) if mb.loss_mask.any() else 0.0


def rollout_config(cfg: Config, *, greedy: bool = False) -> RolloutConfig:
    return RolloutConfig.from_settings(cfg.trainer.rollout, greedy=greedy)


def env_metrics(batch: Batch) -> dict[str, float]:
    actions = (batch.num_valid + batch.num_invalid).sum().clamp(min=1)
    return {
        K.SUCCESS_RATE: float(batch.scores.float().mean()),
        K.VALID_ACTION_RATIO: float(batch.num_valid.sum() / actions),
        K.NUM_TURNS_MEAN: float(batch.num_turns.float().mean()),
        K.NUM_SEARCHES_MEAN: float(batch.num_searches.float().mean()),
        K.FINISH_RATIO: float(batch.finished.float().mean()),
        K.RESPONSE_LENGTH_MEAN: float(batch.response_length.float().mean()),
        K.RESPONSE_LENGTH_CLIP_RATIO: float(batch.truncated.float().mean()),
    }


@torch.no_grad()
def validate(cfg: Config, comps: Components, d: Dist = Dist(), questions: int | None = None) -> float:
    """Greedy success rate on the first `questions` (default `val_questions`) held-out questions
    (each rank rolls out its share; the scores are summed over ranks)."""
    qs = comps.task.split("val")[: cfg.trainer.val_questions if questions is None else questions]
    mine = d.shard(qs)
    rc = rollout_config(cfg, greedy=True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(0, len(mine), VAL_CHUNK):
        with comps.precision.autocast():
            b = rollout(comps.policy, comps.tokenizer, comps.env, mine[i:i + VAL_CHUNK], rc)
        total += b.scores.double().sum()
    return float(d.all_sum(total)) / max(1, len(qs))


def run_dir_for(cfg: Config) -> Path:
    """The run's checkpoint folder: same settings ⇒ same folder (`stppo.config.run_identity`)."""
    return Path(cfg.trainer.out_dir) / cfg.tracking.experiment / run_identity(cfg)


class Trainer:
    """Holds the run's state; `train()` is the loop above."""

    def __init__(self, cfg: Config, comps: Components, tracker: Tracker, run_dir: Path,
                 dist: Dist = Dist()) -> None:
        self.cfg, self.c, self.tracker, self.run_dir, self.dist = cfg, comps, tracker, run_dir, dist
        tr = cfg.trainer
        self.actor_opt = torch.optim.AdamW(comps.policy.parameters(), lr=tr.actor_lr,
                                           weight_decay=tr.weight_decay)
        self.critic_opt = (torch.optim.AdamW(comps.critic.parameters(), lr=tr.critic_lr,
                                             weight_decay=tr.weight_decay) if comps.critic else None)
        self.detector = collapse_detector(tr.collapse)  # the live checks (and non-finite steps)
        self.ctx = UpdateContext(cfg.algo, tr, torch.Generator(), dist=dist,
                                 precision=comps.precision,
                                 max_turns=cfg.task.max_turns if cfg.diagnostics.per_turn else 0)
        self.skip_old = old_log_probs_from_update(cfg)
        self.device = next(comps.policy.parameters()).device
        # who samples: the live policy, or older ones (trainer.offpolicy; their snapshots are state)
        self.sampler = sampler_class(tr.offpolicy)(cfg, comps, rollout_config(cfg), dist)
        self.step = 0
        self.val_history: list[tuple[int, float]] = []
        # Last step already in MLflow per stream: a resumed run replays steps without re-logging.
        self.logged = {"train": -1, "val": -1}
        self.alarms = AlarmSet(tr.alarm, tr.collapse.sampled)
        self.rollbacks = 0
        self.snapshot: dict | None = None  # on_alarm=rollback: the last checkpoint, in memory
        self.stop_reason: str | None = None
        dg = cfg.diagnostics
        questions = {q.id: q for q in comps.task.split("train")}
        # a collapse is detected (patience − 1) × every steps after its onset: keep those tables
        keep = (tr.collapse.patience - 1) * tr.collapse.every + 1
        self.samples = SampleRecorder(dg.samples_every, dg.samples_count, keep,
                                      comps.tokenizer, questions, comps.precision)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        s = {"step": self.step, "policy": self.c.policy.state_dict(),
             "critic": self.c.critic.state_dict() if self.c.critic else None,
             "actor_opt": self.actor_opt.state_dict(),
             "critic_opt": self.critic_opt.state_dict() if self.critic_opt else None,
             "detector": self.detector.state_dict(), "opt_steps": self.ctx.opt_steps,
             "val_history": self.val_history, "run_id": self.tracker.run_id,
             "alarms": self.alarms.state_dict(), "rollbacks": self.rollbacks}
        return s | self.sampler.state_dict()  # (stale: the past policies a resumed run samples with)

    def load_state_dict(self, s: dict) -> None:
        self.step = s["step"]
        self.detector.load_state_dict(s["detector"])
        self.ctx.opt_steps = s["opt_steps"]
        self.val_history = [tuple(x) for x in s["val_history"]]
        if "alarms" in s:
            self.alarms.load_state_dict(s["alarms"])
            self.rollbacks = s["rollbacks"]
        self.sampler.load_state_dict(s, self.step)
        self._load_weights(s)

    def _load_weights(self, s: dict) -> None:
        """Policy, critic and optimizer states of checkpoint `s` (a rollback keeps the step, the
        detector, the alarms and the history: the logged series stays in step order)."""
        self.c.policy.load_state_dict(s["policy"])
        self.actor_opt.load_state_dict(s["actor_opt"])
        if self.c.critic is not None:
            self.c.critic.load_state_dict(s["critic"])
            self.critic_opt.load_state_dict(s["critic_opt"])
        self._scale_lrs()

    def _scale_lrs(self) -> None:
        """Learning rates = the configured ones × rollback_lr_factor ** rollbacks."""
        tr = self.cfg.trainer
        scale = tr.rollback_lr_factor ** self.rollbacks
        for opt, lr in ((self.actor_opt, tr.actor_lr), (self.critic_opt, tr.critic_lr)):
            for g in opt.param_groups if opt is not None else ():
                g["lr"] = lr * scale

    def _save(self) -> None:
        if self.cfg.trainer.on_alarm == "rollback":  # every rank keeps it: rollbacks stay in step
            self.snapshot = copy.deepcopy({k: v for k, v in self.state_dict().items()
                                           if k in ("policy", "critic", "actor_opt", "critic_opt")})
        every = self.cfg.trainer.save_every
        if every and self.step > 0 and self.step % every == 0 and self.dist.is_main:
            checkpoint.save(self.run_dir, self.state_dict())

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> float:
        cfg, tr = self.cfg, self.cfg.trainer
        if self.step == 0:
            if self.c.critic_warmstart:
                self.tracker.log(0, self.c.critic_warmstart)
            self._validate(0)
            if tr.collapse.every:
                self._log(0, self._live_check(0))
        if tr.on_alarm == "rollback" and self.snapshot is None:
            self._save()  # the start (step 0, or the resumed checkpoint) is the first fallback
        bar = tqdm(total=tr.total_steps, initial=self.step, desc=f"{cfg.algo.name} seed {cfg.seed}",
                   disable=not tr.progress or not self.dist.is_main, dynamic_ncols=True)
        while self.step < tr.total_steps:
            self.step += 1
            metrics = self.train_step(self.step)
            if tr.collapse.every and self.step % tr.collapse.every == 0:
                metrics.update(self._live_check(self.step))
            metrics[K.COLLAPSE_DETECTED] = float(self.detector.detected)
            self._log(self.step, metrics)
            if self._val_due(self.step):
                self._validate(self.step)
            if tr.save_every and self.step % tr.save_every == 0:
                self._save()
            bar.update(1)
            bar.set_postfix(success=f"{metrics[K.SUCCESS_RATE]:.2f}",
                            val=f"{self.val_history[-1][1]:.2f}" if self.val_history else "-")
            if self.detector.detected and (tr.stop_on_collapse or self.detector.reason.startswith("non-finite")):
                log.warning("stppo: run collapsed at step %d (%s); stopping", self.detector.collapse_step,
                            self.detector.reason)
                self.stop_reason = f"collapse at step {self.detector.collapse_step}"
            if self.stop_reason is not None:
                if self.val_history[-1][0] != self.step:
                    self._validate(self.step)
                self.tracker.set_tags({K.TAG_STOPPED: self.stop_reason})
                break
        bar.close()
        return self.objective()

    def train_step(self, step: int) -> dict[str, float]:
        cfg, c, d = self.cfg, self.c, self.dist
        t0 = time.perf_counter()
        qs = sample_questions(c.task.split("train"), cfg.trainer.questions_per_step, cfg.seed, step)
        salt = "rollout" if d.rank == 0 else f"rollout-rank{d.rank}"
        with c.precision.autocast():
            rolled = self.sampler.rollout(step, qs, salt)
            # DAPO's dynamic sampling / overlong shaping, when on (else the rollout itself):
            batch, dapo_metrics = dapo.shape_batch(rolled, cfg, c, step, salt,
                                                   self.sampler.refill(step, salt))
        self.sampler.record(step)
        batch = batch.to(self.device)  # the rollout packs on the CPU; the update runs on the model's
        t_roll = time.perf_counter() - t0
        sampled = batch.loss_mask  # the agent tokens before a rollout correction's rejection
        batch, metrics = prepare_batch(batch, c.policy, c.critic, c.ref, cfg.algo, reduce=d.reduce,
                                       precision=c.precision, skip_old=self.skip_old,
                                       gather=d.gather_rows if d.active else None,
                                       chunk=cfg.trainer.micro_batch_size or FORWARD_CHUNK)
        sampler_metrics, before = self.sampler.metrics(batch, sampled, d.reduce)
        metrics.update(sampler_metrics)
        self.ctx.generator.manual_seed(step_seed(cfg.seed, step, "minibatches"))
        self.ctx.nan_at_first_minibatch = step in tuple(cfg.trainer.debug_nan_steps)
        if c.critic is None or step > cfg.trainer.critic_warmup:
            metrics.update(actor_update(c.policy, self.actor_opt, batch, self.ctx))
            metrics[K.STEP_KL] = step_kl(c.policy, batch, before, c.precision)
        else:
            metrics[K.SKIPPED_STEPS] = 0.0
        if c.critic is not None:
            metrics.update(critic_update(c.critic, self.critic_opt, batch, self.ctx))
        metrics.update(env_metrics(rolled))  # the step's own rollout: before any DAPO filtering
        if cfg.trainer.group_size > 1:
            metrics.update(group_signal_fractions(rolled.scores, rolled.group_ids))
        metrics.update(dapo_metrics)
        t_step = time.perf_counter() - t0
        metrics.update({K.ROLLOUT_TIME: t_roll, K.UPDATE_TIME: t_step - t_roll, K.STEP_TIME: t_step,
                        K.TOKENS_PER_S: float(batch.attention_mask.sum()) / t_step})
        if self.device.type == "cuda":
            metrics[K.GPU_PEAK_MEM] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics = d.reduce_metrics(metrics)  # one value per key on every rank
        metrics[K.TOKENS_PER_S] *= d.world  # the mean over ranks → the group's throughput
        if d.is_main:
            self.samples.capture(step, batch, c.policy)
        metrics.update(self._observe(lambda: self.detector.observe_step(step, metrics[K.SKIPPED_STEPS] > 0,
                                                                        metrics[K.SUCCESS_RATE])))
        self._on_alarms(step, metrics)
        if d.is_main:
            self._write_samples(step, detected_now=False)
        return metrics

    def _observe(self, feed) -> dict[str, float]:
        """Feed the collapse detector; `collapse/step` (and the onset's samples) when it fires."""
        was = self.detector.detected
        feed()
        if not self.detector.detected or was:
            return {}
        if self.dist.is_main:
            self._write_samples(self.step, detected_now=True)
        return {K.COLLAPSE_STEP: float(self.detector.collapse_step)}

    def _write_samples(self, step: int, detected_now: bool) -> None:
        due = self.samples.due(step, self.detector.collapse_step, detected_now)
        for s, table in due:
            self.tracker.log_table(K.samples_artifact(s), table)
        if due:
            self.tracker.set_tags({K.TAG_SAMPLES_STEPS: ",".join(map(str, self.samples.written))})

    def _live_check(self, step: int) -> dict[str, float]:
        """The live policy's greedy success on the first `collapse.questions` held-out questions,
        fed to the collapse detector."""
        t0 = time.perf_counter()
        v = validate(self.cfg, self.c, self.dist, questions=self.cfg.trainer.collapse.questions)
        out = {K.VAL_LIVE_SUCCESS_RATE: v, K.LIVE_CHECK_TIME: time.perf_counter() - t0}
        return out | self._observe(lambda: self.detector.observe_validation(step, v))

    def _on_alarms(self, step: int, metrics: dict[str, float]) -> None:
        """Feed the alarms; log `alarm/<name>` for the ones that fire, then act (trainer.on_alarm)."""
        tr = self.cfg.trainer
        fired = self.alarms.update(step, metrics)
        metrics.update({K.alarm_key(n): 1.0 for n in fired})
        if fired and tr.on_alarm == "stop":
            self.stop_reason = f"alarm {', '.join(fired)} at step {step}"
            log.warning("stppo: %s; stopping (trainer.on_alarm=stop)", self.stop_reason)
        elif fired and tr.on_alarm == "rollback" and self.rollbacks < tr.max_rollbacks:
            self.rollbacks += 1
            self._load_weights(self.snapshot)
            self.sampler.restart(step)  # (stale: the rolled-back weights are the newest policy)
            self.alarms.rearm(fired)
            log.warning("stppo: alarm %s at step %d; rolled back to the last checkpoint, learning "
                        "rates x%g (rollback %d of at most %d)", ", ".join(fired), step,
                        tr.rollback_lr_factor ** self.rollbacks, self.rollbacks, tr.max_rollbacks)
        if tr.on_alarm == "rollback":
            metrics[K.COLLAPSE_ROLLBACKS] = float(self.rollbacks)

    def _val_due(self, step: int) -> bool:
        every = self.cfg.trainer.val_every
        return step == self.cfg.trainer.total_steps or (every > 0 and step % every == 0)

    def _validate(self, step: int) -> None:
        v = validate(self.cfg, self.c, self.dist)
        self.val_history.append((step, v))
        if step > self.logged["val"]:
            self.tracker.log(step, {K.VAL_SUCCESS_RATE: v})

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if step > self.logged["train"]:
            self.tracker.log(step, metrics)

    def objective(self) -> float:
        """Mean greedy validation success over the last 20% of steps (at least the final one)."""
        if not self.val_history:
            return float("nan")
        start = self.step - max(1, round(0.2 * self.cfg.trainer.total_steps))
        tail = [v for s, v in self.val_history if s > start] or [self.val_history[-1][1]]
        return sum(tail) / len(tail)


def resolved_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_run_info(run_dir: Path, run_id: str | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"mlflow_run_id": run_id}))


def read_run_info(run_dir: Path) -> dict:
    p = run_dir / "run.json"
    return json.loads(p.read_text()) if p.exists() else {}
