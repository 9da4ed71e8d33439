"""Where the rollout correction acts in the own trainer (docs/design.md §2, "Rollout correction";
stppo.train.rollout_corr), in verl's order: decoupled mode once per step in the batch
preparation — rejected tokens leave the loss mask before the advantages, the IS weights join the
batch and multiply the policy loss —, bypass mode with π_old := π_rollout and the correction in
each minibatch's loss; `none` leaves a run as it was."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from layouts import multi_turn_layout
from stppo import metric_names as K
from stppo.algos import agg_denoms, compute_advantages, policy_loss, rollout_correction
from stppo.batch import Batch
from stppo.config import AlgoConfig, TrainerConfig, compose, to_config
from stppo.models import ValueModel, policy_log_probs
from stppo.train.actor_loss import actor_loss, whole
from stppo.train.distributed import Dist
from stppo.train.prepare import outcome_rewards, prepare_batch
from stppo.train.update import UpdateContext, old_log_probs_from_update

N, T, VOCAB = 8, 26, 40


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    policy = Qwen2ForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(3)
    ids, attn, loss, turns = multi_turn_layout(g, N, T, VOCAB, prompt=3, action=(2, 6), gap=(1, 4), shortest=6)
    with torch.no_grad():
        lp = policy_log_probs(policy, ids, attn, positions=loss)
    # the sampler: off π_old by a per-row drift (rows 0-3 small, 4-7 large) and token noise
    drift = torch.tensor([0.0, 0.002, -0.002, 0.001, 0.3, -0.4, 0.5, -0.3], dtype=torch.float64)
    noise = 0.001 * torch.randn(N, T, generator=g, dtype=torch.float64)
    roll = torch.where(loss, lp - drift[:, None] + noise, 0.0)
    batch = Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, turn_ids=turns,
                  group_ids=torch.arange(N) // 2, scores=torch.tensor([1.0, 0, 1, 0, 1, 0, 0, 1]),
                  rollout_log_probs=roll)
    return policy, batch


def algo(*overrides: str) -> AlgoConfig:
    return to_config(compose(["algo=grpo", *overrides])).algo


def test_decoupled_rejection_leaves_the_mask_before_the_advantages(setup):
    policy, batch = setup
    a = algo("algo.rollout_correction=decoupled_geo_rs_token_tis", "algo.rollout_correction_options.rs_threshold='0.99_1.01'")
    out, m = prepare_batch(batch, policy, None, None, a)
    kept = out.loss_mask.any(dim=1)
    assert kept.tolist() == [True] * 4 + [False] * 4  # |mean log ratio| > 0.01: rows 4-7 rejected
    assert torch.equal(out.loss_mask[:4], batch.loss_mask[:4])
    assert torch.equal(out.turn_ids, batch.turn_ids)  # the agent tokens stay known
    assert m[K.ROLLOUT_RS_SEQ_MASKED_FRACTION] == 0.5 and m[K.rollout_rs_key("seq_mean_k1", "seq_masked_fraction")] == 0.5
    assert {K.ROLLOUT_IS_MEAN, K.ROLLOUT_CORR_KL, K.ROLLOUT_CORR_CHI2_SEQ} <= set(m)
    want = rollout_correction(out.old_log_probs, batch.rollout_log_probs, batch.loss_mask,
                              a.spec.rollout_correction)
    torch.testing.assert_close(out.rollout_is_weights, want.weights)
    adv, _ = compute_advantages("grpo", loss_mask=out.loss_mask, turn_ids=batch.turn_ids,
                                rewards=outcome_rewards(batch), values=None, scores=batch.scores,
                                group_ids=batch.group_ids, gamma=1.0, gae_lambda=1.0, eps=1e-6, whiten=True)
    torch.testing.assert_close(out.advantages, adv)
    assert (out.advantages[4:] == 0).all()
    # GAE with a critic: the recursion and the whitening over the kept tokens only
    a = algo("algo=ppo", "algo.rollout_correction=decoupled_geo_rs", "algo.rollout_correction_options.rs_threshold='0.99_1.01'")
    critic = ValueModel.from_policy(policy).double()
    out, _ = prepare_batch(batch, policy, critic, None, a)
    assert abs(float(out.advantages[out.loss_mask].mean())) < 1e-6 and out.rollout_is_weights is None


def test_rejected_tokens_and_is_weights_reach_the_policy_loss(setup):
    policy, batch = setup
    a = algo("algo.rollout_correction=decoupled_seq_is_rs", "algo.rollout_correction_options.rs_threshold=1.1")
    out, _ = prepare_batch(batch, policy, None, None, a)
    assert not out.loss_mask[4:].any() and out.loss_mask[:4].any()
    ctx = UpdateContext(a, TrainerConfig(minibatch_size=N, questions_per_step=4, group_size=2), torch.Generator())
    with torch.no_grad():
        lp = policy_log_probs(policy, out.input_ids, out.attention_mask, positions=batch.loss_mask)
    ent = torch.zeros_like(lp)
    loss, m, _ = actor_loss(lp, ent, out, ctx, whole(out, Dist()))
    want = policy_loss(lp, out.old_log_probs, out.advantages, out.loss_mask, out.turn_ids, a.spec,
                       rollout_is_weights=out.rollout_is_weights)
    assert float(loss.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-12)
    assert float(want.loss) != pytest.approx(float(policy_loss(lp, out.old_log_probs, out.advantages, out.loss_mask,
                                                               out.turn_ids, a.spec).loss), rel=1e-6)
    garbage = replace(out, advantages=torch.where(out.loss_mask, out.advantages, 1e3))  # rejected rows
    assert float(actor_loss(lp, ent, garbage, ctx, whole(out, Dist()))[0]) == pytest.approx(float(loss), rel=1e-12)
    assert K.ROLLOUT_IS_MEAN not in m  # the step's, logged by the preparation


def test_bypass_takes_the_samplers_log_probs_and_corrects_in_the_loss(setup):
    policy, batch = setup
    a = algo("algo.rollout_correction=bypass_pg_geo_rs", "algo.rollout_correction_options.rs_threshold='0.99_1.01'")
    out, m = prepare_batch(batch, None, None, None, a)  # no forward: π_old := π_rollout
    assert out.old_log_probs is batch.rollout_log_probs and torch.equal(out.loss_mask, batch.loss_mask)
    assert not any(k.startswith("rollout_corr/") for k in m)
    ctx = UpdateContext(a, TrainerConfig(minibatch_size=N, questions_per_step=4, group_size=2), torch.Generator())
    lp = policy_log_probs(policy, out.input_ids, out.attention_mask, positions=batch.loss_mask).requires_grad_(True)
    loss, m, _ = actor_loss(lp, torch.zeros_like(lp), out, ctx, whole(out, Dist()))
    # REINFORCE over the rows π_θ keeps within ±1% of π_rollout (0-3), all agent tokens' count
    kept = batch.loss_mask & (torch.arange(N) < 4)[:, None]
    d_tok, d_seq = agg_denoms(batch.loss_mask)
    row_len = batch.loss_mask.sum(dim=1, keepdim=True).double()
    want = -(out.advantages * lp)[kept] / row_len.expand(N, T)[kept]  # seq-mean-token-mean
    assert float(loss.detach()) == pytest.approx(float(want.detach().sum() / d_seq), rel=1e-12)
    assert m[K.ROLLOUT_RS_SEQ_MASKED_FRACTION] == pytest.approx(0.5)
    assert float(m[K.ROLLOUT_CORR_KL]) == pytest.approx(float(((batch.rollout_log_probs - lp.detach())[batch.loss_mask]).mean()),
                                                        rel=1e-6)


def test_corrections_need_the_old_log_probs_and_the_samplers(tiny_cfg, setup):
    over = ("algo=ppo", "tracking.enabled=false", "trainer.ppo_epochs=1", "trainer.minibatch_size=16")
    assert old_log_probs_from_update(to_config(tiny_cfg(*over)))  # none: the update's own forward
    for name in ("decoupled_token_is", "decoupled_k3_rs", "bypass_ppo_clip"):
        assert not old_log_probs_from_update(to_config(tiny_cfg(*over, f"algo.rollout_correction={name}")))
    assert old_log_probs_from_update(to_config(tiny_cfg(*over, "algo.rollout_correction=none")))
    policy, batch = setup
    with pytest.raises(ValueError, match=r"algo.rollout_correction=decoupled_k3_rs needs the sampler's "
                                         r"log-probs \(Batch.rollout_log_probs\)"):
        prepare_batch(replace(batch, rollout_log_probs=None), policy, None, None,
                      algo("algo.rollout_correction=decoupled_k3_rs"))


def test_run_py_trains_with_every_rollout_correction_on_stale_rollouts(tmp_path):
    """`python run.py +experiment=quick algo=grpo algo.rollout_correction=NAME` for every name,
    one multirun, with lag 1 so that the second step's rollouts are stale and the correction
    has a mismatch to act on: every run finishes and logs the mismatch metrics and its own.

    One epoch of one minibatch per step, so that each step is one optimizer step from θ_{t−1}.
    Step 2's `offpolicy/kl_to_current` (the live θ_1 against the stale θ_0, by the trainer's
    forwards) is then measured a second way by every run: `rollout_corr/k3_kl` compares the same
    θ_1 (π_old recomputed, or π_θ of the one bypass minibatch) with the sampler's log-probs of θ_0.
    (Step 1 is on-policy, where every correction takes the uncorrected step:
    test_algos_rollout_correction.py holds that in float64; here Adam's first step, lr·g/(|g|+ε),
    can turn rounding into a sign flip of a near-zero component, so no bound is asserted across
    runs.)"""
    from mlflow.tracking import MlflowClient

    from conftest import TINY_OVERRIDES
    from stppo.algos.rollout_corr import ROLLOUT_CORRECTIONS, resolve
    from numerics import FORWARD_TOL
    from test_orchestration import run_py

    names = sorted(ROLLOUT_CORRECTIONS)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    res = run_py(["-m", "algo=grpo", f"algo.rollout_correction={','.join(names)}", "+experiment=quick",
                  *TINY_OVERRIDES, "trainer.total_steps=2", "trainer.offpolicy.lag=1", "trainer.val_every=0",
                  "trainer.ppo_epochs=1", "trainer.minibatch_size=16",
                  f"tracking.uri={uri}", f"trainer.out_dir={tmp_path}/runs",
                  f"hydra.sweep.dir={tmp_path}/multirun"], cwd=tmp_path, timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("stppo").experiment_id])
    assert sorted(r.data.params["algo.rollout_correction"] for r in runs) == names
    kls = {}
    for r in runs:
        name = r.data.params["algo.rollout_correction"]
        assert r.info.status == "FINISHED", (name, r.data.tags.get("error"))
        hist = {k: [m.value for m in client.get_metric_history(r.info.run_id, k)]
                for k in (K.ROLLOUT_CORR_KL, K.ROLLOUT_CORR_K3_KL, K.OFFPOLICY_LAG_MAX, K.OFFPOLICY_KL_TO_CURRENT)}
        assert len(hist[K.ROLLOUT_CORR_KL]) == 2 and hist[K.OFFPOLICY_LAG_MAX] == [0.0, 1.0], name
        kl = hist[K.OFFPOLICY_KL_TO_CURRENT][1]
        # the same k3 mean over the same agent tokens; the sides differ only in log π_θ0 (the
        # sampler's cached decoding against the trainer's forward), by δ ≤ FORWARD_TOL a token,
        # which moves k3 = e^r − 1 − r by ≈ |r|·δ: in the mean ≤ δ·√(mean r²) ≈ δ·√(2 kl)
        bound = FORWARD_TOL * math.sqrt(2 * kl) + FORWARD_TOL ** 2
        assert kl == pytest.approx(hist[K.ROLLOUT_CORR_K3_KL][1], rel=0, abs=bound), name
        kls[name] = kl
        fields, _ = resolve(name)
        if fields["rollout_rs"] is not None:
            assert K.ROLLOUT_RS_MASKED_FRACTION in r.data.metrics, name
        if fields["rollout_is"] is not None:
            assert K.ROLLOUT_IS_MEAN in r.data.metrics, name
    # KL(θ_0 ‖ θ_1) of step 2 (k3, ≥ 0): every run measured a policy that moved — a k3 of
    # rounding alone (|r| ≤ FORWARD_TOL) is ≤ FORWARD_TOL² / 2 — bypass runs too, whose π_old is
    # the sampler's, not the live policy
    assert min(kls.values()) > 100 * FORWARD_TOL ** 2, kls
