"""Mixed precision (stppo.models.precision): float32 master weights under bfloat16 autocast,
float32 heads, the same rules for the warm start, checkpoints of the master weights; and the
lean forwards: heads on agent tokens only, the old-log-prob pass skipped when provably on-policy.
bfloat16 autocast runs on CPU too, so all of it is tested here."""

from __future__ import annotations

import logging

import pytest
import torch
from mlflow.tracking import MlflowClient

from numerics import FORWARD_TOL
from stppo import metric_names as K
from stppo.config import to_config
from stppo.models import (ValueModel, build_random_model, policy_log_probs, resolve_precision,
                          train_tokenizer)
from stppo.models.logprobs import linear_fp32
from stppo.models.precision import Precision
from stppo.rollout import rollout
from stppo.tracker import Tracker
from stppo.train import checkpoint
from stppo.train.job import run
from stppo.train.loop import Trainer, rollout_config, run_dir_for
from stppo.train.prepare import prepare_batch
from stppo.train.setup import build_components
from stppo.train.update import UpdateContext, _actor_loss, old_log_probs_from_update

# bfloat16 autocast is emulated on this CPU (~8x slower than float32 for the tiny model), so the
# bf16 tests start from the random-init policy (no warm start): PPO's critic-based advantages are
# nonzero even when every reward is 0, so the update still moves the weights.
BF16 = ("model.dtype=bfloat16", "trainer.actor_lr=1e-6", "trainer.warmstart.enabled=false")


def _trained(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def _changed_fraction(before: list[torch.Tensor], model) -> float:
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    changed = sum(int((a != b).sum()) for a, b in zip(before, after))
    return changed / sum(b.numel() for b in before)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _one_update(cfg):
    comps = build_components(cfg, progress=False)
    trainer = Trainer(cfg, comps, Tracker(None, "x", enabled=False), run_dir=None)
    return comps, trainer


def test_resolve_precision_defaults_and_explicit_low_precision_warns(caplog):
    p = resolve_precision("auto", "auto", "cpu")
    assert p == Precision(torch.float32, torch.float32, "cpu") and not p.mixed
    p = resolve_precision("bfloat16", "auto", "cpu")
    assert (p.param_dtype, p.compute_dtype, p.mixed) == (torch.float32, torch.bfloat16, True)
    with caplog.at_level(logging.WARNING):
        p = resolve_precision("bfloat16", "bfloat16", "cpu")
    assert p.param_dtype == torch.bfloat16 and "round away" in caplog.text
    with pytest.raises(ValueError, match="model.param_dtype='fp8'"):
        resolve_precision("auto", "fp8", "cpu")


def test_bf16_compute_keeps_float32_master_weights_that_move_at_lr_1e6(tiny_cfg):
    """At the paper's lr 1e-6 one update moves >= 90% of the trained weights (float32 master
    weights under bf16 autocast); bfloat16 parameters lose almost every update."""
    one = ("trainer.questions_per_step=2", "trainer.ppo_epochs=1", "trainer.minibatch_size=8")
    cfg = to_config(tiny_cfg("algo=ppo", *BF16, "tracking.enabled=false", *one))
    comps, trainer = _one_update(cfg)
    assert comps.precision.mixed and comps.precision.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in comps.policy.parameters())
    before = _trained(comps.policy)
    m = trainer.train_step(1)
    assert m[K.SKIPPED_STEPS] == 0
    moved = _changed_fraction(before, comps.policy)
    assert moved >= 0.9, f"only {moved:.1%} of the policy's weights moved"
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.actor_opt.state.values())

    low = to_config(tiny_cfg("algo=ppo", *BF16, "model.param_dtype=bfloat16",
                             "tracking.enabled=false", *one))
    comps, trainer = _one_update(low)
    assert all(p.dtype == torch.bfloat16 for p in comps.policy.parameters())
    before = _trained(comps.policy)
    trainer.train_step(1)
    assert _changed_fraction(before, comps.policy) < 0.1  # what the warning says it costs


def test_first_on_policy_minibatch_clips_no_token_under_bf16(tiny_cfg, capsys):
    """Old log-probs from the separate no-grad pass vs the update's forward, both under bf16
    autocast with float32 heads: the first minibatch's ratios stay far inside the clip range."""
    cfg = to_config(tiny_cfg("algo=ppo", *BF16, "tracking.enabled=false", "trainer.ppo_epochs=2"))
    c = build_components(cfg, progress=False)
    assert not old_log_probs_from_update(cfg)
    qs = [q for q in c.task.split("train")[:4] for _ in range(4)]
    with c.precision.autocast():
        batch = rollout(c.policy, c.tokenizer, c.env, qs, rollout_config(cfg),
                        generator=torch.Generator().manual_seed(0))
    batch = batch.to(_device(c.policy))  # the rollout packs on the CPU, as in the trainer
    batch, _ = prepare_batch(batch, c.policy, c.critic, None, cfg.algo, precision=c.precision)
    mb = batch.select(torch.randperm(len(batch), generator=torch.Generator().manual_seed(1))[:8])
    c.policy.train()
    with torch.no_grad(), c.precision.autocast():
        lp = policy_log_probs(c.policy, mb.input_ids, mb.attention_mask, positions=mb.loss_mask)
    dev = (lp - mb.old_log_probs).exp().sub(1.0).abs()[mb.loss_mask].max().item()
    with capsys.disabled():
        print(f"\nlargest |ratio - 1| on the first on-policy minibatch (bf16 autocast): {dev:.2e}")
    # what the clip fraction below needs: every ratio inside the clip range (bf16's 2^-8 rounding
    # through the 4 layers moves a log-prob by ~1e-2 at worst, 20× inside 0.2)
    assert dev < min(cfg.algo.clip_low, cfg.algo.clip_high)
    ctx = UpdateContext(cfg.algo, cfg.trainer, torch.Generator().manual_seed(0),
                        precision=c.precision)
    with c.precision.autocast():
        _, m = _actor_loss(c.policy, mb, ctx)  # the update's loss on that minibatch
    assert float(m[K.PG_CLIPFRAC]) == 0.0
    assert abs(float(m[K.RATIO_MAX]) - 1.0) <= dev + 1e-6


def test_float32_head_under_autocast():
    lin = torch.nn.Linear(16, 32)
    x = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16  # what autocast would do to a plain head
        y = linear_fp32(x.bfloat16(), lin)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.nn.functional.linear(x.bfloat16().float(), lin.weight, lin.bias))


def _tiny_model():
    texts = [f"entity {i} lives in city {i % 7} of country {i % 3}." for i in range(200)]
    tok = train_tokenizer(texts, vocab_size=400)
    arch = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 2}
    return build_random_model(arch, tok, seed=0), tok


def test_agent_only_heads_equal_the_full_sequence_heads():
    model, tok = _tiny_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (3, 20), generator=g)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[2, 15:] = False  # padding
    agent = torch.rand(3, 20, generator=g) < 0.4
    agent &= mask
    full_lp, full_ent = policy_log_probs(model, ids, mask, return_entropy=True)
    lp, ent = policy_log_probs(model, ids, mask, return_entropy=True, positions=agent)
    keep = agent.clone()
    keep[:, 0] = False
    torch.testing.assert_close(lp[keep], full_lp[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent[keep], full_ent[keep], rtol=1e-6, atol=1e-6)
    assert (lp[~keep] == 0).all() and (ent[~keep] == 0).all()
    critic = ValueModel.from_policy(model)
    v_full = critic.values(ids, mask)
    v = critic.values(ids, mask, positions=agent)
    torch.testing.assert_close(v[keep], v_full[keep], rtol=1e-6, atol=1e-6)
    assert (v[~keep] == 0).all()
    lp.sum().backward()  # gradients flow through the gathered head
    assert model.get_output_embeddings().weight.grad is not None


def test_on_policy_update_skips_the_old_pass_with_the_same_update(tiny_cfg, tmp_path):
    """One epoch, one minibatch: the update's own detached log-probs are the old log-probs. The
    gradient equals the one with a separate no-grad pass (to float tolerance: the pass runs in
    chunks, the update on the whole batch), the batch reaches the update without old log-probs,
    and the run records the skip in its params."""
    over = ("algo=ppo", "tracking.enabled=false", "trainer.ppo_epochs=1", "trainer.minibatch_size=16")
    cfg = to_config(tiny_cfg(*over))
    assert old_log_probs_from_update(cfg)
    assert not old_log_probs_from_update(to_config(tiny_cfg(*over, "trainer.minibatch_size=8")))
    assert not old_log_probs_from_update(to_config(tiny_cfg(*over, "trainer.ppo_epochs=2")))
    assert not old_log_probs_from_update(to_config(tiny_cfg(*over, "algo.kl.coef=0.01",
                                                            "algo.kl.in_reward=true")))
    c = build_components(cfg, progress=False)
    qs = [q for q in c.task.split("train")[:4] for _ in range(4)]
    batch = rollout(c.policy, c.tokenizer, c.env, qs, rollout_config(cfg),
                    generator=torch.Generator().manual_seed(0)).to(_device(c.policy))
    skipped, _ = prepare_batch(batch, c.policy, c.critic, None, cfg.algo, skip_old=True)
    passed, _ = prepare_batch(batch, c.policy, c.critic, None, cfg.algo)
    assert skipped.old_log_probs is None and passed.old_log_probs is not None
    torch.testing.assert_close(skipped.advantages, passed.advantages)
    ctx = UpdateContext(cfg.algo, cfg.trainer, torch.Generator().manual_seed(0))
    grads, metrics = [], []
    for b in (skipped, passed):
        c.policy.zero_grad(set_to_none=True)
        loss, m = _actor_loss(c.policy, b, ctx)
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in c.policy.parameters()]))
        metrics.append(m)
    assert float(metrics[0][K.PPO_KL]) == 0.0 and float(metrics[0][K.RATIO_MAX]) == 1.0
    assert abs(float(metrics[1][K.PPO_KL])) < FORWARD_TOL  # a mean of log-prob differences, each ≤ FORWARD_TOL
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4 * float(grads[1].abs().max()))

    comps, trainer = _one_update(cfg)
    assert trainer.skip_old and trainer.train_step(1)[K.SKIPPED_STEPS] == 0
    run(tiny_cfg(*over[:-2], "tracking.enabled=true", "trainer.ppo_epochs=1",
                 "trainer.minibatch_size=16", "trainer.total_steps=1"))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("stppo").experiment_id])
    assert r.data.params["derived.old_log_prob_pass"] == "skipped"


def test_checkpoint_saves_and_resumes_float32_master_weights(tiny_cfg):
    """A bf16-compute run checkpoints float32 weights and optimizer state of policy and critic;
    resuming loads exactly those and continues. (One update per step on 8 rows: bf16 matmuls
    are emulated on most CPUs, so every extra backward costs seconds.)"""
    over = ("algo=ppo", *BF16, "trainer.save_every=1", "tracking.enabled=false",
            "trainer.questions_per_step=2", "trainer.ppo_epochs=1", "trainer.minibatch_size=8")
    run(tiny_cfg(*over, "trainer.total_steps=1"))
    cfg2 = to_config(tiny_cfg(*over, "trainer.total_steps=2", "trainer.resume=true"))
    state = checkpoint.load(run_dir_for(to_config(tiny_cfg(*over, "trainer.total_steps=1"))))
    assert state is not None and state["step"] == 1
    assert all(t.dtype == torch.float32 for t in state["policy"].values() if t.is_floating_point())
    assert all(t.dtype == torch.float32 for t in state["critic"].values() if t.is_floating_point())
    for opt in ("actor_opt", "critic_opt"):
        assert state[opt]["state"] and all(s["exp_avg"].dtype == torch.float32
                                           for s in state[opt]["state"].values()), opt
    comps = build_components(cfg2, progress=False)
    trainer = Trainer(cfg2, comps, Tracker(None, "x", enabled=False), run_dir=None)
    trainer.load_state_dict(state)
    for model, saved in ((comps.policy, state["policy"]), (comps.critic, state["critic"])):
        for k, v in model.state_dict().items():
            assert v.dtype == saved[k].dtype and torch.equal(v, saved[k].to(v.device)), k
    before = _trained(comps.policy)
    trainer.train_step(2)
    assert _changed_fraction(before, comps.policy) >= 0.9


def test_warm_start_follows_the_precision_rules(tiny_cfg):
    cfg = to_config(tiny_cfg("algo=grpo", "model.dtype=bfloat16", "tracking.enabled=false",
                             "trainer.warmstart.steps=10"))
    comps = build_components(cfg, progress=False)
    assert all(p.dtype == torch.float32 for p in comps.policy.parameters())
    assert comps.warmstart_loss is not None and comps.warmstart_loss == comps.warmstart_loss

