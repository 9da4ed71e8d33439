"""run.py as users start it: config composition of every preset, experiment, launcher and sweep;
one-line errors; multiruns (basic launcher, joblib) that record every job in MLflow, failed ones
included. (submitit_local runs in tests/test_sweeps.py, under the Optuna sweeper.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import ROOT, TINY_OVERRIDES
from stppo import metric_names as K
from stppo.config import CONF_DIR, compose, to_config
from test_tracking import fresh_sqlite

PRESETS = sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
CRITIC_PRESETS = {"ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo"}
# What every training run logs at every step (docs/design.md §4), besides the critic's keys.
STEP_METRICS = [K.PG_LOSS, K.PG_LOSS_NORM, K.PG_CLIPFRAC, K.PG_CLIPFRAC_HIGH, K.PG_CLIPFRAC_LOW, K.PPO_KL,
                K.ENTROPY, K.GRAD_NORM, K.RATIO_MEAN, K.RATIO_MAX, K.CLIP_BIAS_NORM, K.CLIP_BIAS_SCALE,
                K.SUCCESS_RATE, K.VALID_ACTION_RATIO, K.NUM_TURNS_MEAN, K.RESPONSE_LENGTH_MEAN,
                K.STEP_TIME, K.TOKENS_PER_S, K.COLLAPSE_DETECTED]
TRACEBACK = ("Traceback (most recent call last)", 'File "')


def run_py(args: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python run.py ARGS` in `cwd`, bounded by a hang guard: past `timeout` the whole process
    group is killed and the test fails with the command and the end of its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"run.py {' '.join(args)[:500]} hung past {timeout:.0f} s: {err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def warm_cache():
    """Build the tiny setup's caches (tokenizer, index, warm start) once, before parallel jobs."""
    from stppo.train.setup import build_components

    build_components(to_config(compose(TINY_OVERRIDES + ["tracking.enabled=false"])), progress=False)


def _runs(uri: str, experiment: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def _assert_complete(client: MlflowClient, run, steps: int) -> None:
    """FINISHED, every run tag, the params and config artifact, every metric at every step once."""
    assert run.info.status == "FINISHED", run.data.tags.get("error")
    for tag in K.RUN_TAGS:
        assert run.data.tags.get(tag), f"tag {tag} missing"
    assert run.data.tags[K.TAG_HOST] == f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    assert run.data.params["algo.name"] == run.data.tags[K.TAG_ALGO]
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    critic = run.data.tags[K.TAG_ALGO] in CRITIC_PRESETS
    keys = STEP_METRICS + ([K.VF_LOSS, K.VF_EXPLAINED_VAR] if critic else [])
    for key in keys:
        hist = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert hist == list(range(1, steps + 1)), f"{key}: steps {hist}"
    val = sorted(m.step for m in client.get_metric_history(run.info.run_id, K.VAL_SUCCESS_RATE))
    assert val == [0, steps]


# -- composition ---------------------------------------------------------------------------------
def _compose_many(override_lists: list[list[str]]) -> list:
    """compose + to_config for each list, within one Hydra initialisation."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stppo.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        return [to_config(hydra_compose("config", overrides=o)) for o in override_lists]


def test_every_preset_composes_with_every_experiment():
    assert {"quick", "collapse_stress", "paper_search"} <= set(EXPERIMENTS)
    cases = [[f"algo={a}"] + ([f"+experiment={e}"] if e else [])
             for a in PRESETS for e in [None, *EXPERIMENTS]]
    for overrides, cfg in zip(cases, _compose_many(cases)):
        assert cfg.algo.name == overrides[0].split("=")[1], overrides  # an experiment never pins the preset
    quick, stress, paper, paper7 = _compose_many([
        ["+experiment=quick"], ["algo=ppo", "+experiment=collapse_stress"], ["+experiment=paper_search"],
        ["+experiment=paper_search", "model=qwen2_5_7b"]])
    assert quick.trainer.total_steps <= 5 and quick.trainer.warmstart.steps <= 100
    t = stress.trainer
    assert (t.actor_lr, t.ppo_epochs, stress.tracking.experiment) == (1e-3, 4, "collapse_stress")
    assert t.questions_per_step * t.group_size // t.minibatch_size * t.ppo_epochs >= 8  # off-policy
    assert stress.model.name in ("tiny", "small") and t.total_steps >= 20
    assert paper.model.name.startswith("qwen2_5") and paper.task.name == "search_r1"
    assert paper.task.retriever.kind == "http" and not paper.trainer.warmstart.enabled
    assert (paper.algo.clip_low, paper.algo.clip_high, paper.algo.advantage) == (0.2, 0.2, "gae")
    assert paper.task.prompt_style in ("search_r1", "chat") and paper.trainer.questions_per_step >= 256
    assert paper7.model.name == "qwen2_5_7b"


def test_compose_warns_nothing():
    """Hydra 1.4 (stppo's pin) warns when `version_base` is passed (deprecated), Hydra 1.3
    (verl's environment: tests/verl) when it is not; `compose` gives it only to Hydra < 1.4."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compose(["algo=ppo"]).algo.name == "ppo"


def _hydra_cfg(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stppo.config import register_configs
    from sweeps import register_hydra_plugins

    register_configs()
    register_hydra_plugins()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)


def test_launcher_presets_and_the_sweep_compose():
    joblib = _hydra_cfg(["hydra/launcher=joblib"]).hydra.launcher
    assert joblib._target_.endswith("JoblibLauncher") and joblib.n_jobs == 2
    local = _hydra_cfg(["hydra/launcher=submitit_local"]).hydra.launcher
    assert local._target_.endswith("LocalLauncher") and local.timeout_min > 0
    slurm = _hydra_cfg(["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu"]).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.partition == "gpu"
    assert slurm.gpus_per_node >= 1 and slurm.mem_gb > 0 and slurm.cpus_per_task > 0
    with pytest.raises(Exception, match="njobs"):  # a typo is caught by the plugin's schema
        _hydra_cfg(["hydra/launcher=joblib", "hydra.launcher.njobs=3"])
    cfg = _hydra_cfg(["+sweep=clip_range", "algo=so_ppo"])
    sw = cfg.hydra.sweeper
    assert sw._target_ == "sweeps.hydra_sweeper.StppoOptunaSweeper" and sw.direction == "maximize"
    assert sw.study_name == "clip_range-so_ppo" and sw.storage.startswith("sqlite:///")
    assert set(sw.params) == {"algo.clip_low", "algo.clip_high"}
    assert set(sw.clip_bias_params) == {"clip_bias_norm", "clip_triggered"}
    (job,) = _compose_many([["+sweep=clip_range", "algo=so_ppo"]])
    assert job.trainer.stop_on_collapse and job.tracking.sweep == "clip_range"


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, expected", [
    ("algo.clip_low=2", "algo.clip_low must be in [0, 1), got 2.0"),
    ("algo=nope", "Could not find 'algo/nope'; Available options in 'algo': "),
    pytest.param("trainer.device=cuda", "trainer.device=cuda but torch",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_invalid_override_ends_with_one_clear_line(tmp_path, override, expected):
    res = run_py([override], tmp_path, timeout=120)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and expected in last, res.stderr[-2000:]
    assert not any(t in res.stderr for t in TRACEBACK), res.stderr[-2000:]
    if override == "algo=nope":  # every built-in preset, and those of installed plugins (tests/plugin_example)
        assert set(PRESETS) <= set(last.split(expected)[1].split(", ")), last


def test_missing_data_file_ends_with_one_line_and_a_failed_run(tmp_path):
    uri = fresh_sqlite(tmp_path)
    res = run_py(["task=nq_hotpotqa", f"task.options.data_dir={tmp_path}/nowhere", "trainer.progress=false",
                  "trainer.warmstart.enabled=false",
                  f"tracking.uri={uri}", "tracking.experiment=missing", f"hydra.run.dir={tmp_path}/h"],
                 tmp_path, timeout=180)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and f"{tmp_path}/nowhere" in last, res.stderr[-2000:]
    assert "no such file" in last
    assert not any(t in res.stderr for t in TRACEBACK), res.stderr[-2000:]
    _, (run,) = _runs(uri, "missing")
    assert run.info.status == "FAILED" and "no such file" in run.data.tags["error"]


@pytest.mark.parametrize("overrides, expected", [
    (["model=qwen2_5_0_5b"], "could not load model 'Qwen/Qwen2.5-0.5B-Instruct' (hub unreachable"),
    (["model.path=/nowhere/model"], "model directory /nowhere/model does not exist"),
])
def test_unloadable_model_ends_with_one_line_and_a_failed_run(tmp_path, overrides, expected):
    """A hub model without a hub (HF_HUB_OFFLINE, as on a machine without network) or a bad
    path: the one-line message, exit 1, no traceback and no retry storm; the run is FAILED."""
    uri = fresh_sqlite(tmp_path)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        res = run_py([*overrides, "+experiment=quick", "trainer.progress=false", f"tracking.uri={uri}",
                      "tracking.experiment=unloadable", f"hydra.run.dir={tmp_path}/h"], tmp_path,
                     timeout=180)
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith("run.py: error: ") and expected in last, res.stderr[-2000:]
    assert not any(t in res.stderr for t in TRACEBACK), res.stderr[-2000:]
    assert "Retrying" not in res.stderr
    _, (run,) = _runs(uri, "unloadable")
    assert run.info.status == "FAILED" and expected in run.data.tags["error"]


def test_hub_probe_is_fast_and_false_without_a_server():
    from conftest import free_port

    from stppo.models.loading import hub_reachable

    assert not hub_reachable(f"http://127.0.0.1:{free_port()}", timeout=1.0)


# -- multiruns -----------------------------------------------------------------------------------
def test_multirun_presets_by_seeds_records_every_job(tmp_path, warm_cache):
    uri = fresh_sqlite(tmp_path)
    res = run_py(["-m", "algo=ppo,s_ppo,st_ppo", "seed=0,1", "+experiment=quick", *TINY_OVERRIDES,
                  f"tracking.uri={uri}", f"trainer.out_dir={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/m"],
                 tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    client, runs = _runs(uri, "stppo")
    assert sorted((r.data.tags[K.TAG_ALGO], r.data.tags[K.TAG_SEED]) for r in runs) == [
        (a, s) for a in ("ppo", "s_ppo", "st_ppo") for s in ("0", "1")]
    for r in runs:
        _assert_complete(client, r, steps=2)
        assert r.data.tags[K.TAG_SWEEP] == f"{tmp_path}/m"  # the multirun's runs are tagged together


def test_parallel_jobs_lose_nothing_and_a_failing_job_is_recorded(tmp_path, warm_cache):
    uri = fresh_sqlite(tmp_path)
    res = run_py(["-m", "hydra/launcher=joblib", "seed=0,1", "model.path=null,/nonexistent/model",
                  *TINY_OVERRIDES, f"tracking.uri={uri}",
                  f"trainer.out_dir={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/m"], tmp_path)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "2 jobs failed" in last and "/nonexistent/model does not exist" in last, \
        res.stderr[-3000:]
    client, runs = _runs(uri, "stppo")
    by_status = {s: [r for r in runs if r.info.status == s] for s in ("FINISHED", "FAILED")}
    assert len(runs) == 4 and len(by_status["FINISHED"]) == 2 and len(by_status["FAILED"]) == 2
    for r in by_status["FINISHED"]:
        _assert_complete(client, r, steps=2)
    for r in by_status["FAILED"]:
        assert "/nonexistent/model does not exist" in r.data.tags["error"]
    assert sorted(r.data.tags[K.TAG_SEED] for r in by_status["FINISHED"]) == ["0", "1"]
