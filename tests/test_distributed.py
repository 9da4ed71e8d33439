"""Data-parallel training under torchrun (gloo on CPU): a 2-process update equals the 1-process
update of the same global batch, and `torchrun --nproc_per_node=2 run.py` logs one run once."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT as REPO, free_port
from numerics import FORWARD_TOL, assert_close_to_scale

pytestmark = pytest.mark.timeout(1800)  # a hang guard: the module's torchruns take minutes


def torchrun(nproc: int, *args: str, cwd: Path = REPO, env: dict | None = None,
             timeout: int = 480) -> subprocess.CompletedProcess:
    """`torchrun` on a free master port, started again on a new one if another process took it
    first (free_port releases the port before torchrun binds it)."""
    for _ in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", *args]
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        if p.returncode == 0 or "address already in use" not in p.stderr.lower():
            return p
    return p


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    res = {}
    for nproc in (1, 2):
        p = torchrun(nproc, str(REPO / "tests" / "dp_update.py"), str(out / f"{nproc}.pt"))
        assert p.returncode == 0, p.stderr[-3000:]
        res[nproc] = torch.load(out / f"{nproc}.pt", weights_only=False)
    return res


CASES = ("ppo", "st_ppo", "s_ppo_grad", "so_grpo", "turn_ppo_kl", "turn_drift", "seq_is_rs",
         "bypass_pg", "bypass_clip", "sspo", "tir_optimal_token_baseline")
# The rollout correction's statistics of the whole batch (every rank's rows): the decoupled
# correction's once per step, bypass mode's per minibatch.
GLOBAL_CORRECTION_KEYS = ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_batch_norm_factor",
                          "rollout_corr/rollout_is_seq_std", "rollout_corr/rollout_is_eff_sample_size",
                          "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction",
                          "rollout_corr/kl", "rollout_corr/training_ppl", "rollout_corr/chi2_seq",
                          "rollout_corr/log_ppl_diff_max")


# tests/dp_update.py runs in float64 with SGD. A reorganisation (ranks, micro-batches) changes
# only the order of sums over at most 8 × 28 tokens: measured ≤ 3e-15 relative. RTOL leaves
# four orders of magnitude for that rounding to travel through two optimizer steps, and stays
# far below what a real difference makes (a wrong weight or denominator moves a gradient by
# O(1) relative).
RTOL = 1e-9
UPDATE_KEYS = ("actor/pg_loss", "clip_bias/scale", "clip_bias/norm", "clip_bias/grad_norm",
               "actor/grad_norm", "actor/entropy", "critic/vf_loss", "actor/kl_ref",
               *GLOBAL_CORRECTION_KEYS)


def assert_same_update(got: dict, want: dict, init: dict, what: str) -> None:
    """Every optimizer step's gradients (before the step), then the weights' change."""
    for part in ("actor", "critic"):
        steps_got, steps_want = got[f"{part}_grads"], want[f"{part}_grads"]
        if steps_want is None:
            assert steps_got is None, what
            continue
        assert len(steps_got) == len(steps_want), what
        for i, (g1, g0) in enumerate(zip(steps_got, steps_want)):
            for j, (a, b) in enumerate(zip(g1, g0)):
                assert_close_to_scale(a, b, RTOL, f"{what}: {part} step {i + 1} gradient {j}")
    for k in want["policy"]:
        assert_close_to_scale(got["policy"][k] - init[k], want["policy"][k] - init[k], RTOL,
                              f"{what}: {k}")


def assert_same_metrics(got: dict, want: dict, keys: tuple, what: str) -> None:
    for key in keys:
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=RTOL, abs=1e-12), f"{what}: {key}"


@pytest.fixture(scope="module")
def init_policy():
    sys.path.insert(0, str(REPO / "tests"))
    from dp_update import models
    return models()[0].state_dict()


@pytest.mark.parametrize("case", CASES)
def test_two_process_update_equals_one_process(updates, init_policy, case):
    one, two = updates[1][case], updates[2][case]
    moved = max(float((one["policy"][k] - init_policy[k]).abs().max()) for k in init_policy)
    assert moved > 1e-2  # the update did something (two SGD steps)
    assert_same_update(two, one, init_policy, case)
    # whitening over both ranks' agent tokens
    assert_close_to_scale(two["advantages"], one["advantages"], RTOL, f"{case}: advantages")
    # global quantities: the loss, λ, ‖C‖ and the pre-clip gradient norm of the whole batch
    assert_same_metrics(two["metrics"], one["metrics"], UPDATE_KEYS, case)


@pytest.mark.parametrize("case", CASES)
def test_micro_batched_two_process_update_equals_one_process_whole_minibatch(updates, init_policy, case):
    """trainer.micro_batch_size=2 under 2 ranks (2 parts each) and in one process (4 parts):
    the same update as one process over the whole minibatch — λ, ‖C‖ (the grad estimator's and
    the exact diagnostic's) and the loss of the whole minibatch over ranks and parts."""
    one = updates[1][case]
    for procs in (1, 2):
        micro = updates[procs][f"{case}/micro"]
        assert_same_update(micro, one, init_policy, f"{case}, {procs} process(es), micro")
        per_rank = ("actor/pg_clipfrac", "actor/ratio_max") if procs == 1 else ()  # (one rank)
        assert_same_metrics(micro["metrics"], one["metrics"], UPDATE_KEYS + per_rank, case)


def test_corrections_act_in_the_check(updates):
    """The equality above covers λ < 1 (the corrections act), else it would prove little."""
    for case in ("st_ppo", "s_ppo_grad", "so_grpo"):
        assert updates[1][case]["metrics"]["clip_bias/scale"] < 0.9, case


def test_rollout_corrections_act_in_the_check(updates):
    """Rows are rejected and the IS weights normalised in the cases above: the equality of the
    update and of the correction's statistics covers the batch-level parts."""
    one = updates[1]
    for case in ("seq_is_rs", "bypass_clip"):
        assert 0 < one[case]["metrics"]["rollout_corr/rollout_rs_seq_masked_fraction"] < 1, case
    for case in ("seq_is_rs", "bypass_pg"):
        assert one[case]["metrics"]["rollout_corr/rollout_is_batch_norm_factor"] != 1.0, case


def test_stale_rollouts_sample_with_the_same_past_policies_on_every_rank(tmp_path):
    """trainer.offpolicy.lag=2 (uniform) under 2 ranks: the snapshot rings are equal on both
    ranks at every step (taken after the synchronised optimizer step), each rank's rows are
    sampled by the weights of step t − 1 − their lag, and each rank's groups carry the lags of
    the whole step's draw (every rank draws them all, then keeps its shard)."""
    from dp_offpolicy import LAG, STEPS

    from stppo.config import OffPolicyConfig
    from stppo.train.loop import step_seed
    from stppo.train.offpolicy import draw_lags

    p = torchrun(2, str(REPO / "tests" / "dp_offpolicy.py"), str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"out.rank{r}.pt", weights_only=False) for r in (0, 1)]
    seen = set()
    for t in range(1, STEPS + 1):
        r0, r1 = ranks[0][t - 1], ranks[1][t - 1]
        assert r0["ring"] == r1["ring"] and r0["policy"] == r1["policy"], t
        assert sorted(r0["ring"]) == [s for s in range(t - LAG, t) if s >= 0]
        assert set(r0["question_ids"]).isdisjoint(r1["question_ids"])  # each rank its own groups
        drawn = draw_lags(OffPolicyConfig(LAG, "uniform"), 4, step_seed(0, t, "lags"))
        ages = [min(lag, t - 1) for lag in drawn]
        assert r0["group_lags"] == ages[0::2] and r1["group_lags"] == ages[1::2], t
        seen |= set(ages)
        for r in (r0, r1):  # the sampler is the kept θ_{t-1-lag} (up to the engine's rounding)
            torch.testing.assert_close(r["rollout"], r["sampler"], rtol=FORWARD_TOL, atol=FORWARD_TOL)
        assert r0["metrics"] == r1["metrics"]  # reduced over ranks
        assert r0["metrics"]["offpolicy/lag_mean"] == sum(ages) / len(ages)
        assert r0["metrics"]["offpolicy/lag_max"] == max(ages)
    assert seen == set(range(LAG + 1))


def test_torchrun_run_py_logs_one_run(tmp_path):
    db = tmp_path / "mlflow.db"
    p = torchrun(2, str(REPO / "run.py"), "+experiment=quick", "algo=st_ppo",
                 f"tracking.uri=sqlite:///{db}", f"trainer.out_dir={tmp_path / 'out'}",
                 f"hydra.run.dir={tmp_path / 'hydra'}", "trainer.progress=false",
                 "trainer.val_every=2", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    con = sqlite3.connect(db)
    runs = con.execute("select run_uuid, status from runs").fetchall()
    assert len(runs) == 1 and runs[0][1] == "FINISHED", runs
    run = runs[0][0]
    tags = dict(con.execute("select key, value from tags where run_uuid=?", (run,)).fetchall())
    assert tags["world_size"] == "2" and tags["algo"] == "st_ppo"
    steps = [s for (s,) in con.execute(
        "select step from metrics where run_uuid=? and key='perf/step_time_s' order by step", (run,))]
    assert steps == [1, 2, 3]  # each step logged once, by rank 0 only
    val = [s for (s,) in con.execute(
        "select step from metrics where run_uuid=? and key='val/success_rate' order by step", (run,))]
    assert val == [0, 2, 3]


def test_indivisible_batch_is_one_clear_error(tmp_path):
    p = torchrun(2, str(REPO / "run.py"), "+experiment=quick", "trainer.questions_per_step=7",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"hydra.run.dir={tmp_path}",
                 cwd=tmp_path, timeout=180)
    assert p.returncode != 0
    assert "trainer.questions_per_step=7 must be divisible by the number of data-parallel " \
           "processes (2)" in p.stderr


@pytest.mark.parametrize("choice, cuda, count, local, expected", [
    ("cpu", True, 2, "1", "cpu"),
    ("auto", False, 0, "0", "cpu"),
    ("auto", True, 2, "1", "cuda:1"),  # each torchrun process on its own GPU
    ("cuda", True, 2, "1", "cuda:1"),  # an explicit 'cuda' too, not every rank on GPU 0
    ("cuda", True, 1, None, "cuda:0"),
])
def test_device_of_puts_each_process_on_its_gpu(monkeypatch, choice, cuda, count, local, expected):
    from stppo.train.setup import device_of

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    cfg = SimpleNamespace(trainer=SimpleNamespace(device=choice))
    assert str(device_of(cfg)) == expected


@pytest.mark.parametrize("cuda, count, local, message", [
    (False, 0, "0", "trainer.device=cuda but torch"),
    (True, 2, "2", "LOCAL_RANK=2 but this machine has 2 CUDA device(s)"),
])
def test_device_of_missing_gpu_is_one_clear_error(monkeypatch, cuda, count, local, message):
    from stppo.train.setup import device_of

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", local)
    with pytest.raises(ValueError, match=re.escape(message)):
        device_of(SimpleNamespace(trainer=SimpleNamespace(device="cuda")))
