"""The trainer end to end on the tiny setup: every preset trains, faults are survived, runs are
reproducible and resumable."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from stppo import metric_names as K
from stppo.config import to_config
from stppo.tracker import Tracker
from stppo.train.loop import Trainer
from stppo.train.job import run
from stppo.train.setup import build_components

PRESETS = ["ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo", "grpo", "gspo", "so_grpo"]
EXCLUDE = ("perf/",)


def _history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    out = {}
    for key in run.data.metrics:
        hist = client.get_metric_history(run_id, key)
        out[key] = sorted((m.step, m.value) for m in hist)
    return out


def _only_run(uri: str, experiment: str = "stppo"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    return runs


@pytest.mark.parametrize("algo", PRESETS)
def test_every_preset_trains_two_steps_and_changes_the_policy(tiny_cfg, algo):
    cfg = to_config(tiny_cfg(f"algo={algo}", "tracking.enabled=false"))
    comps = build_components(cfg, progress=False)
    before = [p.detach().clone() for p in comps.policy.parameters()]
    critic_before = ([p.detach().clone() for p in comps.critic.parameters()]
                     if comps.critic is not None else None)
    trainer = Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=None)
    m1 = trainer.train_step(1)
    m2 = trainer.train_step(2)
    changed = any(not torch.equal(a, b) for a, b in zip(before, comps.policy.parameters()))
    assert changed, f"{algo}: the policy did not change"
    for m in (m1, m2):
        for key in (K.PG_LOSS, K.PG_CLIPFRAC, K.GRAD_NORM, K.SUCCESS_RATE, K.CLIP_BIAS_NORM, K.ENTROPY):
            assert key in m
        assert m[K.SKIPPED_STEPS] == 0
    uses_critic = algo not in ("grpo", "gspo", "so_grpo")
    assert (comps.critic is not None) == uses_critic
    if uses_critic:
        assert K.VF_LOSS in m2 and any(
            not torch.equal(a, b) for a, b in zip(critic_before, comps.critic.parameters()))
    else:
        assert K.VF_LOSS not in m2 and K.VALUES_MEAN not in m2


def test_run_logs_every_step_and_validation(tiny_cfg, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    obj = run(tiny_cfg("algo=grpo", "trainer.total_steps=3", "trainer.val_every=2"))
    assert 0.0 <= obj <= 1.0
    (r,) = _only_run(uri)
    assert r.info.status == "FINISHED"
    assert r.data.tags[K.TAG_ALGO] == "grpo" and r.data.tags[K.TAG_SEED] == "0"
    assert r.data.params["algo.clip_low"] == "0.2"
    h = _history(uri, r.info.run_id)
    assert [s for s, _ in h[K.VAL_SUCCESS_RATE]] == [0, 2, 3]
    assert [s for s, _ in h[K.PG_LOSS]] == [1, 2, 3]
    assert all(K.known_metric(k) for k in h), [k for k in h if not K.known_metric(k)]


def test_fixed_seed_gives_identical_metrics(tiny_cfg, tmp_path):
    a = run(tiny_cfg("algo=st_ppo", "tracking.experiment=a"))
    b = run(tiny_cfg("algo=st_ppo", "tracking.experiment=b"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ha = _history(uri, _only_run(uri, "a")[0].info.run_id)
    hb = _history(uri, _only_run(uri, "b")[0].info.run_id)
    keys = [k for k in ha if not k.startswith(EXCLUDE)]
    assert keys and a == b
    for k in keys:
        assert ha[k] == hb[k], k


def test_injected_nan_is_skipped_and_counted(tiny_cfg, tmp_path):
    run(tiny_cfg("algo=ppo", "trainer.total_steps=3", "trainer.debug_nan_steps=[2]"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    (r,) = _only_run(uri)
    h = _history(uri, r.info.run_id)
    assert dict(h[K.SKIPPED_STEPS]) == {1: 0.0, 2: 1.0, 3: 0.0}
    assert r.info.status == "FINISHED" and dict(h[K.COLLAPSE_DETECTED])[3] == 0.0


def test_repeated_nonfinite_steps_end_the_run_as_collapsed(tiny_cfg, tmp_path):
    run(tiny_cfg("algo=grpo", "trainer.total_steps=6", "trainer.debug_nan_steps=[2,3,4,5,6]",
                 "trainer.collapse.nonfinite_patience=2"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    (r,) = _only_run(uri)
    h = _history(uri, r.info.run_id)
    assert dict(h[K.COLLAPSE_STEP]) == {3: 2.0}
    assert max(s for s, _ in h[K.PG_LOSS]) == 3  # stopped at detection, metrics kept
    assert r.info.status == "FINISHED"


@pytest.mark.parametrize("override, field", [
    ("algo.clip_low=1.5", "algo.clip_low"),
    ("trainer.minibatch_size=999", "trainer.minibatch_size"),
    ("algo.clip_bias.kind=magic", "algo.clip_bias.kind"),
    ("algo.loss_agg=sum", "algo.loss_agg"),
])
def test_invalid_setting_fails_before_any_work_naming_the_field(tiny_cfg, tmp_path, override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        run(tiny_cfg(override))
    assert not (tmp_path / "runs").exists()


def test_warm_start_is_cached_and_shared_across_presets_and_seeds(tiny_cfg, monkeypatch):
    from stppo.train import sft

    a = build_components(to_config(tiny_cfg("algo=ppo", "seed=0")), progress=False)

    def no_training(*args, **kwargs):
        raise AssertionError("the warm start was trained again instead of loaded from the cache")

    monkeypatch.setattr(sft, "train_sft", no_training)
    b = build_components(to_config(tiny_cfg("algo=grpo", "seed=3")), progress=False)
    for pa, pb in zip(a.policy.parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb)
    assert a.warmstart_loss == b.warmstart_loss


@pytest.mark.parametrize("algo", ["grpo", "st_ppo"])
def test_update_moves_likelihood_in_the_direction_of_the_advantage(tiny_cfg, algo):
    """End to end through rollout → prepare → actor update, one small SGD step on the whole batch:
    to first order it changes a function F of the weights by lr·∇F·g (g: minus the loss's clipped
    gradient), whatever batch this CPU's kernels sample. So the actor loss on that batch falls
    (F = −L), and for grpo — token-level ratios, one advantage per trajectory, where ∇L = −∇J —
    the advantage-weighted log-likelihood J = Σ w·A·log π (w: the loss's aggregation weights)
    rises: trajectories become likelier in proportion to their advantage. (Adam's sign-like step
    promises no such order, and which way one trajectory moves depends on the sampled batch.)"""
    from dataclasses import replace

    from stppo.algos.aggregation import agg_weights
    from stppo.models import policy_log_probs
    from stppo.rollout import rollout
    from stppo.train.loop import rollout_config
    from stppo.train.prepare import prepare_batch
    from stppo.train.update import UpdateContext, _actor_loss, actor_update

    cfg = to_config(tiny_cfg(f"algo={algo}", "tracking.enabled=false", "trainer.questions_per_step=8"))
    c = build_components(cfg, progress=False)
    qs = [q for q in c.task.split("train")[:8] for _ in range(4)]
    batch = rollout(c.policy, c.tokenizer, c.env, qs, rollout_config(cfg),
                    generator=torch.Generator().manual_seed(0))
    batch, _ = prepare_batch(batch, c.policy, c.critic, None, cfg.algo)

    def log_probs():
        with torch.no_grad():
            return policy_log_probs(c.policy, batch.input_ids, batch.attention_mask)

    batch = replace(batch, old_log_probs=log_probs())  # π_old fixed: the loss after the step is comparable
    tr = replace(cfg.trainer, minibatch_size=len(batch), ppo_epochs=1)
    ctx = UpdateContext(cfg.algo, tr, torch.Generator().manual_seed(0))
    w = agg_weights(batch.loss_mask, cfg.algo.loss_agg, dtype=torch.float64)

    def surrogate() -> float:
        lp = torch.where(batch.loss_mask, log_probs(), 0.0).double()
        return float((w * batch.advantages.double() * lp).sum())

    def loss() -> float:
        with torch.no_grad():
            return float(_actor_loss(c.policy, batch, ctx)[0])

    # a small SGD step against a non-zero gradient lowers the loss (to first order): the batch
    # must carry a learning signal, which a batch where every group agrees does not
    assert batch.advantages[batch.loss_mask].abs().max() > 0, "every advantage is 0: no gradient to follow"
    j0, l0 = surrogate(), loss()
    actor_update(c.policy, torch.optim.SGD(c.policy.parameters(), lr=1e-2), batch, ctx)
    assert loss() < l0
    if algo == "grpo":
        assert surrogate() > j0
