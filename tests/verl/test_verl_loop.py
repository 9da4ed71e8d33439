"""verl's own trainer loop from stppo's own command, end to end: `run.py backend=verl` (stppo's
environment) → stppo's launcher → `.venv-verl/bin/python -m verl.trainer.main_ppo` → verl's legacy
`RayPPOTrainer.init_workers / fit` for 2 steps on a local Ray cluster: verl's agent loop
(`ToolAgentLoop` through stppo's `search_r1_agent`, parser and search tool over the synthetic
world's bm25 retriever), stppo's reward, verl's FSDP2 actor (and critic) with stppo's policy
losses, verl's validation, checkpoint and MLflow tracker; stppo's run monitor copies the metrics.

Without vLLM the rollout is transformers' `generate` behind verl's rollout interfaces and, on the
CPU, verl sees a CPU platform (test-only: tests/verl/loop/, loaded by VERL_USE_EXTERNAL_MODULES;
every verl internal it touches is listed in loop/plugin.py and checked by
test_verl_loop_internals.py). The model is a tiny Qwen2 SFT-trained on the world's oracle
demonstrations in verl's chat format (loop/tiny_agent.py), so it really calls the tool.

Three jobs share the module's cluster: `st_ppo` (a critic, GAE), `so_grpo` (groups) and
`so_grpo_stale` (trainer.offpolicy.lag=1: verl's one-step off-policy trainer, its rollout on a
logical GPU of its own). STPPO_TEST_DEVICE=cuda runs the same on CUDA (verl's CUDA platform, HF
generation, no vLLM; the stale job only with 2 GPUs). On this 2-core CPU the module takes 4.5–6
minutes (the model 20–35 s, each job 60–110 s, depending on what else runs).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from loop import harness as H

pytestmark = pytest.mark.timeout(3600)  # the jobs have their own hang guards (JOB_TIMEOUT_S)
DEVICE = os.environ.get("STPPO_TEST_DEVICE", "cpu")
EXPERIMENT = "verl_loop"
JOB_TIMEOUT_S = 900  # ≥ 10x a job's time on this CPU (~60 s)
# The tiny model scores 0 on every question, so each GRPO group's advantages are 0 and so_grpo's
# policy-gradient term is 0: its entropy bonus is what moves the weights (GAE's advantages are
# not 0 with a critic, so st_ppo's policy loss moves them itself).
# so_grpo_stale: trainer.offpolicy.lag=1 — verl's one-step off-policy trainer, its rollout on a
# GPU of its own (here a logical one), each batch sampled by the weights of one step before.
JOBS = {"st_ppo": ("algo=st_ppo",), "so_grpo": ("algo=so_grpo", "algo.entropy_coef=0.01"),
        "so_grpo_stale": ("algo=so_grpo", "algo.entropy_coef=0.01")}
STALE = {"so_grpo_stale"}
if DEVICE == "cuda":  # the stale job's rollout needs a GPU of its own beside the trainer's
    import torch

    if torch.cuda.device_count() < 2:
        JOBS = {k: v for k, v in JOBS.items() if k not in STALE}
        STALE = set()
SYNC = [name for name in JOBS if name not in STALE]
STEPS = (1, 2)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The tiny agent model, one Ray cluster, every job of JOBS in turn: {tmp, uri, model,
    jobs: {name: (job, completed process, seconds)}}."""
    for python in (H.STPPO_PYTHON, H.VERL_PYTHON):
        if not python.exists():
            pytest.fail(f"{python} is missing: run `make setup verl-env`")
    from stppo.config import compose
    from stppo.envs import build_task

    from loop.tiny_agent import make_agent_model

    start = time.monotonic()
    tmp = tmp_path_factory.mktemp("verl_loop")
    spec = compose(["backend=verl", *H.WORLD]).task  # the task the launcher converts
    task = build_task(spec.name, **dict(spec.options))
    model = make_agent_model(tmp / "agent", task, topk=spec.retriever.topk, max_turns=spec.max_turns)
    print(f"\ntiny agent model: {time.monotonic() - start:.0f} s")
    uri = f"sqlite:///{tmp}/mlflow.db"
    done = {}
    start = time.monotonic()
    with H.local_cluster(DEVICE) as address:
        print(f"ray cluster: {time.monotonic() - start:.0f} s")
        for name, extra in JOBS.items():
            j = H.job(name, tmp, model=model, uri=uri, experiment=EXPERIMENT, ray_address=address,
                      device=DEVICE, extra=extra, stale=name in STALE)
            start = time.monotonic()
            done[name] = (j, H.run_job(j, JOB_TIMEOUT_S), time.monotonic() - start)
    return {"tmp": tmp, "uri": uri, "model": model, "jobs": done}


def _client(jobs):
    from mlflow import MlflowClient

    return MlflowClient(jobs["uri"])


def _run(jobs, name: str):
    client = _client(jobs)
    exp = client.get_experiment_by_name(EXPERIMENT)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'")
    return run


def _history(jobs, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in _client(jobs).get_metric_history(run_id, key)}


@pytest.mark.parametrize("name", JOBS)
def test_the_job_runs_verls_trainer_loop_to_its_end(jobs, name, tmp_path):
    j, proc, seconds = jobs["jobs"][name]
    assert proc.returncode == 0, f"{H.shell_line(list(j.argv))[:300]}…\n{proc.stderr[-4000:]}"
    assert "Training Progress" in proc.stderr and "Final validation metrics" in proc.stdout + proc.stderr
    run = _run(jobs, name)
    assert run.info.status == "FINISHED" and run.data.tags["backend"] == "verl"
    command = Path(_client(jobs).download_artifacts(run.info.run_id, "verl_command.sh", str(tmp_path))).read_text()
    entry = "verl.experimental.one_step_off_policy.main_ppo" if name in STALE else "verl.trainer.main_ppo"
    assert f" -m {entry} " in command
    if name not in STALE:
        assert run.data.params["trainer/use_v1"] == "False"  # verl's own Tracking: the legacy RayPPOTrainer
    print(f"{name}: {seconds:.0f} s")


@pytest.mark.parametrize("name", JOBS)
def test_the_run_has_stppos_keys_for_both_steps(jobs, name):
    from stppo import metric_names as K

    run = _run(jobs, name)
    rid = run.info.run_id
    keys = [K.SUCCESS_RATE, K.NUM_TURNS_MEAN, K.STEP_TIME, K.COLLAPSE_DETECTED, K.SKIPPED_STEPS, K.CLIP_BIAS_NORM,
            "critic/advantages_mean", K.PG_LOSS, K.GRAD_NORM]
    keys += [K.turn_key(0, n) for n in ("tokens", "pg_clipfrac", "ratio_mean", "ratio_max", "adv_mean", "ppo_kl")]
    keys += [K.turn_key(1, "tokens")]
    if name == "st_ppo":
        keys += ["critic/values_mean", "critic/vf_loss"]
    for key in keys:
        got = _history(jobs, rid, key)
        assert set(STEPS) <= set(got) and all(math.isfinite(got[s]) for s in STEPS), (key, got)
    assert set(_history(jobs, rid, K.VAL_SUCCESS_RATE)) == {0, 2}  # before training and after step 2
    for step in STEPS:  # the per-turn copies are the loss's token-weighted sums / their turn's weight
        weight = _history(jobs, rid, "actor/turn/k0/tokens")[step]
        raw = _history(jobs, rid, "actor/turn/k0/ratio_mean")[step]
        assert weight > 0 and _history(jobs, rid, K.turn_key(0, "ratio_mean"))[step] == pytest.approx(raw / weight)
    turns = _history(jobs, rid, "num_turns/mean")
    assert _history(jobs, rid, K.NUM_TURNS_MEAN) == pytest.approx({s: v / 2 for s, v in turns.items()})
    assert set(_history(jobs, rid, K.COLLAPSE_DETECTED).values()) == {0.0}


@pytest.mark.parametrize("name", SYNC)
def test_a_trajectory_called_the_search_tool_and_got_information(jobs, name):
    """verl's dump of each step's trajectories (trainer.rollout_data_dir): the decoded response
    holds the agent's `<search>` and the tool's `<information>Doc …` observation after it."""
    j = jobs["jobs"][name][0]
    for step in STEPS:
        rows = [json.loads(line) for line in (j.rollout_dir / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 8  # 4 questions x 2 samples
        called = [r["output"] for r in rows if "</search>" in r["output"] and "<information>Doc 1" in r["output"]]
        assert called, rows[0]["output"][:500]
        assert called[0].index("</search>") < called[0].index("<information>")


def test_the_rollout_samples_with_the_weights_it_should(jobs):
    """verl compares the rollout's log-probs with the actor's recomputed π_old every step
    (`training/rollout_probs_diff_max`). The synchronous jobs sample each step with the weights
    the actor has (float32 on the CPU: ~1e-6): verl's weight sync after step 1 reached the HF
    server. The stale job's step 2 was sampled by step 0's weights while π_old is step 1's: far
    apart — its step 1 (both step 0's) agrees."""
    if DEVICE != "cpu":
        pytest.skip("bf16 on CUDA: the sampler/trainer mismatch is not a weight-sync signal")
    diffs = {n: _history(jobs, _run(jobs, n).info.run_id, "training/rollout_probs_diff_max") for n in JOBS}
    for name in SYNC:
        assert max(diffs[name][s] for s in STEPS) < 1e-4, (name, diffs[name])
    for name in STALE:
        assert diffs[name][1] < 1e-4 and diffs[name][2] > 100 * diffs[name][1], (name, diffs[name])


@pytest.mark.parametrize("name", JOBS)
def test_the_actor_weights_after_step_2_differ_from_step_0(jobs, name):
    """verl's checkpoint after step 2 (trainer.save_every=2) against the model folder verl loaded
    at step 0: every weight tensor of the actor moved."""
    import torch
    from safetensors.torch import load_file

    j = jobs["jobs"][name][0]
    (path,) = j.out_dir.glob("*/*/checkpoints/global_step_2/actor/model_world_size_1_rank_0.pt")
    trained = torch.load(path, map_location="cpu", weights_only=False)
    start = load_file(str(jobs["model"] / "model.safetensors"))
    assert set(trained) == set(start)
    for key, value in trained.items():
        value = value.to_local() if hasattr(value, "to_local") else value  # one rank: the whole tensor
        assert value.shape == start[key].shape and not torch.equal(value.float(), start[key].float()), key


def test_analysis_report_reads_the_runs(jobs, tmp_path):
    """Each run is in the report's tables with its 2 steps and its gradient norms; the growth fit
    has its row (no points: with 2 small steps nothing clipped, clip_bias/norm is 0)."""
    import pandas as pd

    from analysis.report import main

    out = tmp_path / "report"
    assert main(["--experiment", EXPERIMENT, "--out", str(out), "--tracking-uri", jobs["uri"], "--no-cache",
                 "--bootstrap", "50"]) == 0
    runs = pd.read_csv(out / "runs.csv").set_index("run_name")
    growth = pd.read_csv(out / "growth.csv").set_index("run_id")
    for name in JOBS:
        row = runs.loc[name]
        assert row["status"] == "FINISHED" and row["last_step"] == 2 and row["peak_grad_norm"] > 0
        assert row["run_id"] in growth.index


def test_the_dashboards_collapse_page_reads_the_runs(jobs, tmp_path):
    """In stppo's environment (streamlit): the overview lists both runs, the collapse page offers
    them and the per-turn metrics, without an exception."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": jobs["uri"]}
    out = subprocess.run([str(H.STPPO_PYTHON), str(Path(H.__file__).with_name("dashboard_check.py")), EXPERIMENT,
                          str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=600, cwd=H.ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    page = json.loads(out.stdout.strip().splitlines()[-1])
    ids = sorted(_run(jobs, name).info.run_id for name in JOBS)
    assert page["errors"] == [] and page["overview_run_ids"] == ids
    assert len(page["collapse_runs"]) == len(JOBS) and any(o.startswith("st_ppo") for o in page["collapse_runs"])
    assert {"ratio_mean", "pg_clipfrac"} <= set(page["turn_metrics"]) and page["charts"] >= 1
