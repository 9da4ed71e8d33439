"""Stand-in for `python -m verl.trainer.main_ppo` in the launcher's tests (no GPU, no vLLM here).

It takes the launcher's real command line (the verl overrides), reads the real converted
parquet for the data source, and logs verl-named metrics through verl's own `Tracking` class
(mlflow backend, attached to MLFLOW_RUN_ID) — the same code path as verl's trainer. The actor
update's metrics are those of stppo's policy loss as verl's trainer logs them: the loss the
overrides name (`policy_loss.loss_mode`, `max_turns`), looked up in verl's registry, on a
multi-turn batch whose log π − log π_old has the step's spread, through verl's `Metric` /
`reduce_metrics` and `rename_dict(…, "actor/")` (so `clip_bias/norm` arrives as
`actor/clip_bias/norm`). It then ends as STANDIN_MODE says:
  ok        log every step, exit 0 (verl's Tracking.finish ends the MLflow run, as verl's does)
  fail      log 2 steps, print a traceback-like tail on stderr, exit 3
  hang      log 2 steps, then wait to be killed (SIGTERM / SIGKILL)
  collapse  success 0.6, then 0.05 from step 4 on; the collapse rule (patience 2) detects it at
            step 6: log up to step 6, then wait for the launcher to stop it
  alarm     the spread grows ×1.5 per step from step 7 (clip_bias/norm grows exponentially: the
            clip_bias_growth alarm fires at step 9): log up to step 9, then wait to be stopped
A run the launcher must stop logs exactly up to the step where the stop is due and no further,
so what a test reads does not depend on how fast the monitor polls or how busy the machine is.
Not stopped within STOP_WAIT_S, it says so on stderr and exits 4 (a hang guard, not a verdict).
STANDIN_STEP_S: seconds between steps (default 0.05); STANDIN_PID_FILE: write the pid there.
"""

from __future__ import annotations

import math
import os
import sys
import time

STOP_DUE = {"collapse": 6, "alarm": 9}  # the step at which the launcher stops a run of the mode
STOP_WAIT_S = 300.0  # > 100× a poll of the monitor (backend.poll_s=0.5) under load


def success(mode: str, step: int) -> float:
    if mode in ("collapse",):
        return 0.6 if step < 4 else 0.05
    if mode == "alarm":
        return 0.6
    return min(0.9, 0.2 + 0.05 * step)


def actor_metrics(ov: dict, mode: str, step: int) -> dict[str, float]:
    """What verl's trainer logs for the actor update of one step with the overrides' loss."""
    import torch
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.metric import AggregationType, Metric, reduce_metrics
    from verl.utils.py_functional import rename_dict

    actor, pl = "actor_rollout_ref.actor", "actor_rollout_ref.actor.policy_loss"
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=float(ov[f"{actor}.clip_ratio_low"]),
                             clip_ratio_high=float(ov[f"{actor}.clip_ratio_high"]),
                             clip_ratio_c=float(ov[f"{actor}.clip_ratio_c"]), global_batch_info={},
                             policy_loss=SimpleNamespace(loss_mode=ov[f"{pl}.loss_mode"],
                                                         max_turns=int(ov[f"{pl}.max_turns"])))
    gen = torch.Generator().manual_seed(0)  # one batch; only the spread changes with the step
    row = [1] * 4 + [0] * 3 + [1] * 4 + [0] * 2 + [1] * 3  # 3 turns between observation tokens
    mask = torch.tensor([row] * 16, dtype=torch.bool)  # (N, T)
    old = -torch.rand(16, 16, generator=gen) * 2
    spread = 0.6 * (1.5 ** max(0, step - 6) if mode == "alarm" else 1.0)
    log_prob = old + spread * torch.randn(16, 16, generator=gen)
    loss, pg = get_policy_loss_fn(config.policy_loss.loss_mode)(
        old_log_prob=old, log_prob=log_prob, advantages=torch.randn(16, 16, generator=gen), response_mask=mask,
        loss_agg_mode=ov[f"{actor}.loss_agg_mode"], config=config, rollout_is_weights=None)
    metrics = Metric.from_dict(pg, aggregation=AggregationType.MEAN)  # verl's ppo_loss
    metrics["actor/pg_loss"] = Metric(value=float(loss), aggregation=AggregationType.SUM)
    out = {k: v.aggregate() for k, v in metrics.items()}
    out.update({"loss": float(loss), "lr": 1e-6, "mfu": 0.1,
                "grad_norm": 1.5})
    out = rename_dict(out, "actor/")  # RayPPOTrainer._update_actor
    out["perf/mfu/actor"] = out.pop("actor/mfu")
    return reduce_metrics({k: [v] for k, v in out.items()})


def main(argv: list[str]) -> int:
    import pyarrow.parquet as pq
    from verl.utils.tracking import Tracking

    ov = {k: v.strip("'") for k, v in (a.lstrip("+").split("=", 1) for a in argv if "=" in a)}
    mode = os.environ.get("STANDIN_MODE", "ok")
    if os.environ.get("STANDIN_PID_FILE"):
        with open(os.environ["STANDIN_PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
    pause = float(os.environ.get("STANDIN_STEP_S", "0.05"))
    steps = int(ov["trainer.total_training_steps"]) if mode in ("ok", "fail", "hang") else STOP_DUE[mode]
    test_freq = int(ov["trainer.test_freq"])
    source = pq.read_table(ov["data.val_files"], columns=["data_source"]).column(0)[0].as_py()
    tracking = Tracking(ov["trainer.project_name"], ov["trainer.experiment_name"],
                        default_backend=["console", "mlflow"],
                        config={"trainer": {"project_name": ov["trainer.project_name"]},
                                "data": {"train_batch_size": int(ov["data.train_batch_size"])}})
    tracking.log({f"val-core/{source}/acc/mean@1": 0.3}, step=0)  # val_before_train
    for step in range(1, steps + 1):
        if mode in ("fail", "hang") and step > 2:
            break
        s = success(mode, step)
        metrics = {"critic/score/mean": s, "critic/rewards/mean": s - 0.01, "num_turns/mean": 4.0 + step % 2,
                   **actor_metrics(ov, mode, step), "response_length/mean": 120.0, "timing_s/step": pause,
                   "timing_s/gen": pause / 2, "critic/advantages/mean": 0.0}
        if step % test_freq == 0 or step == steps:
            metrics[f"val-core/{source}/acc/mean@1"] = s
        tracking.log(metrics, step=step)
        time.sleep(pause)
    if mode == "fail":
        print("Traceback (most recent call last):\n  File \"main_ppo.py\", line 1\n"
              "torch.OutOfMemoryError: CUDA out of memory (stand-in)", file=sys.stderr, flush=True)
        return 3
    if mode == "hang":
        while True:
            time.sleep(1)
    if mode in STOP_DUE:
        time.sleep(STOP_WAIT_S)  # the launcher stops the process group long before
        print(f"verl stand-in ({mode}): not stopped within {STOP_WAIT_S:.0f} s of step {steps}, where "
              "the launcher's monitor should have stopped it", file=sys.stderr, flush=True)
        return 4
    tracking.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
