"""TEST-ONLY: what a `run.py backend=verl` job needs to run verl's real trainer loop without vLLM —
on this CPU, or on one CUDA GPU (`STPPO_TEST_DEVICE=cuda`) — and the local Ray cluster it joins.

stppo's launcher is used unchanged: `python run.py backend=verl …` (stppo's environment) starts
`.venv-verl/bin/python -m verl.trainer.main_ppo OVERRIDES…`, which joins the cluster through
RAY_ADDRESS. The harness adds only
  - `process_env(device)`: the variables that run `loop.plugin.load()` (through `loop.autoload`)
    in every verl process — the HF rollout; on the CPU also the CPU platform, verl's FSDP engines
    for it and the gloo start-up; the cluster is started with them, so every Ray worker has
    them too;
  - `verl_overrides(device, …)`, passed as `backend.overrides` (stppo's own hook for extra verl
    settings): the HF rollout, one agent-loop and one reward worker, no dataloader workers,
    FSDP2 with sdpa attention, and on the CPU float32 throughout without torch.compile (as the
    actor-update tests) and `trainer.device=cpu`.
`device_settings(device)` is the one place that differs between the two devices (tested on CPU).
"""

from __future__ import annotations

import contextlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

VERL_TESTS = Path(__file__).resolve().parents[1]  # tests/verl: cpu_platform, loop.*
DEVICES = ("cpu", "cuda")
CPU_PLATFORM = "stppo_cpu"
FP32 = "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}"
ACTOR, CRITIC, ROLLOUT = "actor_rollout_ref.actor", "critic", "actor_rollout_ref.rollout"
# verl's resource pools take bundles of {CPU: 3, GPU: 1} per GPU; its TaskRunner, agent-loop,
# reward, load-balancer and rollout-server actors want one CPU each to be scheduled (logical
# CPUs: Ray does not pin them; the machine's 2 cores serve them all).
LOGICAL_CPUS = 24


@dataclass(frozen=True)
class DeviceSettings:
    env: dict[str, str]  # beside process_env's common part
    overrides: tuple[str, ...]  # verl overrides beside the common part
    ray_gpus: int | None  # logical GPUs of the cluster (None: Ray counts the real ones)


def device_settings(device: str) -> DeviceSettings:
    """The CPU: verl's platform is the test's CPU platform, one logical GPU per rank for verl's
    resource pools, float32 FSDP and rollout (as the actor-update tests: bf16 is slow on this CPU
    and would blur the rollout-vs-trainer log-prob check). CUDA: verl's own platform and defaults
    (bf16 mixed precision), the GPUs Ray finds."""
    if device not in DEVICES:
        raise ValueError(f"STPPO_TEST_DEVICE={device!r}: one of {', '.join(DEVICES)}")
    if device == "cuda":
        return DeviceSettings(env={}, overrides=("trainer.device=cuda",), ray_gpus=None)
    return DeviceSettings(
        env={"VERL_PLATFORM": CPU_PLATFORM, "GLOO_SOCKET_IFNAME": "lo"},
        overrides=("trainer.device=cpu", f"{ROLLOUT}.dtype=float32",
                   f"+{ACTOR}.fsdp_config.mixed_precision={FP32}", f"{ACTOR}.fsdp_config.use_torch_compile=false",
                   f"+{CRITIC}.fsdp.mixed_precision={FP32}", f"{CRITIC}.fsdp.use_torch_compile=false"),
        ray_gpus=2)  # one rank trains; a stale run's rollout gets the other


def process_env(device: str) -> dict[str, str]:
    """Environment of every verl process (the driver, and the Ray cluster it joins)."""
    return {"VERL_USE_EXTERNAL_MODULES": "loop.autoload", "PYTHONPATH": str(VERL_TESTS),
            "TOKENIZERS_PARALLELISM": "false", **device_settings(device).env}


def verl_overrides(device: str, rollout_dir: Path | None, *, stale: bool = False,
                   hydra_dir: Path | None = None) -> list[str]:
    """verl overrides for `backend.overrides`: the trajectories go to `rollout_dir`; `stale`
    (trainer.offpolicy.lag=1: verl's one-step off-policy trainer) syncs the rollout's weights
    through the object-store checkpoint engine (loop/ckpt_engine.py, loaded by verl's own
    `checkpoint_engine.custom_backend_module`) instead of NCCL, and dumps no trajectories: verl
    0.9.1's OneStepOffRayTrainer never creates the dump executor `trainer.rollout_data_dir` needs
    (AttributeError '_dump_executor' at step 1). `hydra_dir`: where verl's own Hydra app
    (main_ppo is one) writes its run folder, else `outputs/` of the current folder."""
    o = [*([f"hydra.run.dir={hydra_dir}"] if hydra_dir else []),
         f"{ROLLOUT}.name=stppo_hf", f"{ROLLOUT}.agent.num_workers=1", "reward.num_workers=1",
         "data.dataloader_num_workers=0", f"{ACTOR}.strategy=fsdp2", f"{CRITIC}.strategy=fsdp2",
         "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
         f"+{CRITIC}.model.override_config.attn_implementation=sdpa", *device_settings(device).overrides]
    if stale:
        return [*o, f"{ROLLOUT}.checkpoint_engine.backend=stppo_object_store",
                f"+{ROLLOUT}.checkpoint_engine.custom_backend_module=loop.ckpt_engine"]
    return [*o, f"trainer.rollout_data_dir={rollout_dir}"]


def hydra_list(items: list[str]) -> str:
    """A list in Hydra's override grammar, each element single-quoted."""
    quoted = ("'" + i.replace("\\", "\\\\").replace("'", "\\'") + "'" for i in items)
    return "[" + ",".join(quoted) + "]"


def shell_line(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


@contextlib.contextmanager
def local_cluster(device: str):
    """A Ray cluster on 127.0.0.1 for the module, with `process_env` in its workers; yields its
    address (RAY_ADDRESS). `ray.shutdown()` stops exactly the processes it started; its session
    folder (short: Unix socket paths are bounded) is removed after."""
    import shutil
    import tempfile

    import ray

    temp_dir = tempfile.mkdtemp(prefix="stppo-ray-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in process_env(device)}
    try:
        os.environ.update(process_env(device))  # the raylet, hence every worker, inherits them
        try:
            ctx = ray.init(num_cpus=LOGICAL_CPUS, num_gpus=device_settings(device).ray_gpus,
                           _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir,
                           configure_logging=False, log_to_driver=False)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# -- one stppo job --------------------------------------------------------------------------------
ROOT = VERL_TESTS.parents[1]
STPPO_PYTHON = ROOT / ".venv" / "bin" / "python"  # stppo's environment: run.py, the dashboard
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"  # verl's environment: backend.python
# A world small enough for seconds-long steps: 4 questions x 2 samples per step, mini-batches of
# 2 prompt groups (2 optimizer steps a step), 2 steps, greedy validation on 4 questions before
# training and after step 2, a checkpoint after step 2. The response budget (512 tokens) holds
# the tool agent loop's 4 turns with 2 documents each.
WORLD = tuple(f"++task.options.{k}={v}" for k, v in (  # ++: set whether or not the task's yaml lists it
    ("n_people", 60), ("n_cities", 20), ("n_countries", 6), ("n_orgs", 15), ("n_distractors", 50), ("n_sft", 64),
    ("n_train", 16), ("n_val", 4), ("n_test", 4)))
TRAINING = ("trainer.questions_per_step=4", "trainer.group_size=2", "trainer.minibatch_size=4",
            "trainer.ppo_epochs=1", "trainer.total_steps=2", "trainer.val_every=2", "trainer.val_questions=4",
            "trainer.save_every=2", "trainer.actor_lr=1e-4", "trainer.rollout.max_total_tokens=1024",
            "backend.micro_batch_size_per_gpu=4", "backend.poll_s=1")


@dataclass(frozen=True)
class Job:
    """One `run.py backend=verl` job of the harness and where its outputs land."""

    name: str  # also the MLflow run name
    argv: tuple[str, ...]
    env: dict[str, str]
    out_dir: Path  # trainer.out_dir: the job's checkpoints
    rollout_dir: Path  # verl's trajectory dumps (<step>.jsonl)


def job(name: str, tmp: Path, *, model: Path, uri: str, experiment: str, ray_address: str, device: str,
        extra: tuple[str, ...] = (), stale: bool = False) -> Job:
    """The job `name` (its stppo overrides in `extra`, e.g. algo=st_ppo) under stppo's launcher;
    `stale`: trainer.offpolicy.lag=1 on 2 GPUs (1 trains, 1 rolls out)."""
    rollout_dir, out_dir = tmp / "rollouts" / name, tmp / "runs" / name
    extra = (*extra, "trainer.offpolicy.lag=1", "backend.n_gpus_per_node=2") if stale else (
        *extra, "backend.n_gpus_per_node=1")
    verl = verl_overrides(device, rollout_dir, stale=stale, hydra_dir=tmp / "hydra" / f"{name}-verl")
    argv = (str(STPPO_PYTHON), str(ROOT / "run.py"), "backend=verl", f"model.path={model}", *WORLD, *TRAINING,
            f"backend.python={VERL_PYTHON}", f"backend.data_dir={tmp / 'data'}", f"trainer.out_dir={out_dir}",
            f"tracking.uri={uri}", f"tracking.experiment={experiment}", f"tracking.run_name={name}",
            f"hydra.run.dir={tmp / 'hydra' / name}", *extra, f"backend.overrides={hydra_list(verl)}")
    env = {**os.environ, **process_env(device), "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1",
           "HYDRA_FULL_ERROR": "1"}
    return Job(name, argv, env, out_dir, rollout_dir)


def run_job(j: Job, timeout_s: float):
    """Run the job in its own process group; past `timeout_s` (a hang guard, ≥ 10x its normal
    time) it gets SIGTERM (the launcher then stops verl and closes the run KILLED), SIGKILL 120 s
    later, and AssertionError names the job and the end of its stderr."""
    import signal
    import subprocess

    proc = subprocess.Popen(list(j.argv), cwd=ROOT, env=j.env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops verl's process group, closes the run
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        raise AssertionError(f"job {j.name} (run.py backend=verl) hung past {timeout_s:.0f} s: "
                             f"{err[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
