"""Micro-batched update (`trainer.micro_batch_size`): the loss, gradient and metrics of a minibatch
accumulated over micro-batches equal the whole minibatch's in one forward — every aggregation
mode and ratio level, every correction (batch and sequence granularity, both estimators), every
loss mode, rollout corrections (decoupled IS and rejection, bypass with REINFORCE and with the
preset's loss, the IS batch normaliser), the KL term and the entropy bonus (float64, 1e-10); the
critic too; and a whole
update with micro-batches and gradient checkpointing equals the plain one. The 2-process
data-parallel equality with micro-batches is in tests/test_distributed.py."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from helpers.updates import N, T, tiny_policy, update_batch
from numerics import RecordingSGD, assert_close_to_scale
from stppo.algos import LOSS_MODES, LossSpec
from stppo.batch import Batch
from stppo.config import AlgoConfig, ClipBiasConfig, KLConfig, TrainerConfig
from stppo.models import ValueModel, enable_checkpointing
from stppo.train.microbatch import actor_backward, critic_backward, split
from stppo.train.rollout_corr import correction_for
from stppo.train.update import UpdateContext, actor_update, critic_update

TOL = 1e-10
RS_SEQ = "rollout_corr/rollout_rs_seq_masked_fraction"


def _algo(name="ppo", **kw) -> AlgoConfig:
    for key, cls in (("clip_bias", ClipBiasConfig), ("kl", KLConfig)):
        if key in kw:
            kw[key] = cls(**kw[key])
    return AlgoConfig(name=name, **kw)


def _corrected(mb: Batch, algo: AlgoConfig) -> Batch:
    """The batch as the preparation leaves it under the run's rollout correction: decoupled, its
    kept tokens and IS weights (once, from π_old); bypass, π_old = the sampler's."""
    corr = correction_for(algo.spec.rollout_correction)
    old = corr.old_log_probs(mb)
    if old is not None:
        return replace(mb, old_log_probs=old)
    return corr.prepare(mb, mb.old_log_probs)[0]


def _ctx(algo: AlgoConfig, micro: int) -> UpdateContext:
    # micro rows need not divide the minibatch here (a last, shorter minibatch splits the same)
    trainer = SimpleNamespace(minibatch_size=N, micro_batch_size=micro, exact_clip_bias_every=1)
    return UpdateContext(algo, trainer, torch.Generator(), max_turns=4)


def _grads(model, mb: Batch, ctx: UpdateContext, exact_bias=True):
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # Clip-Cov's draw comes from the global generator (as verl's)
    loss, m = actor_backward(model, mb, ctx, params, exact_bias)
    return loss.detach(), m, [p.grad.clone() for p in params]


def _assert_same(whole, micro, what: str) -> None:
    (l1, m1, g1), (l2, m2, g2) = whole, micro
    assert abs(float(l2) - float(l1)) <= TOL * (1 + abs(float(l1))), what
    scale = max(float(g.abs().max()) for g in g1)
    assert scale > 0, what
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=0, atol=TOL * scale, msg=what)
    assert set(m1) == set(m2), what
    for k in m1:
        a, b = float(m1[k]), float(m2[k])
        assert abs(a - b) <= TOL * (1 + abs(a)) or (a != a and b != b), f"{what}: {k} {a} {b}"


OPTIONS = {"clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0}, "kl_cov": {"kl_cov_ratio": 0.2}}
CASES = {
    # every aggregation mode at every ratio level (plain clip), the KL term and entropy bonus
    **{f"{lvl}/{agg}": dict(ratio_level=lvl, loss_agg=agg)
       for lvl in ("token", "turn", "sequence")
       for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")},
    "kl_entropy/token": dict(kl=dict(coef=0.1, estimator="k3"), entropy_coef=0.01),
    "kl_entropy/turn": dict(name="turn_ppo", ratio_level="turn", kl=dict(coef=0.1, estimator="k1"),
                            entropy_coef=0.02, loss_agg="token-mean"),
    "dual_clip": dict(dual_clip=1.5),
    # S-PPO, ST-PPO, SO-PPO: batch and sequence granularity, token and grad estimators
    "s_ppo/batch": dict(name="s_ppo", clip_bias=dict(kind="clip_bias_norm", tau=0.05)),
    "s_ppo/sequence": dict(name="s_ppo", clip_bias=dict(kind="clip_bias_norm", tau=0.05,
                                                          granularity="sequence")),
    "s_ppo/grad": dict(name="s_ppo", clip_bias=dict(kind="clip_bias_norm", tau=1e-3,
                                                      estimator="grad")),
    "st_ppo/batch": dict(name="st_ppo", ratio_level="turn",
                         clip_bias=dict(kind="clip_bias_norm", tau=0.05),
                         kl=dict(coef=0.05, estimator="k2"), entropy_coef=0.01),
    "st_ppo/sequence": dict(name="st_ppo", ratio_level="turn",
                            clip_bias=dict(kind="clip_bias_norm", tau=0.05,
                                            granularity="sequence")),
    "st_ppo/grad+tis": dict(name="st_ppo", ratio_level="turn", rollout_correction="decoupled_token_is",
                            clip_bias=dict(kind="clip_bias_norm", tau=1e-3, estimator="grad")),
    "so_ppo": dict(name="so_ppo", ratio_level="turn", clip_bias=dict(kind="clip_triggered",
                                                                        tau=0.1)),
    "so_grpo/sequence": dict(name="so_grpo", ratio_level="sequence", advantage="grpo",
                             use_critic=False, clip_low=0.02, clip_high=0.02,
                             clip_bias=dict(kind="clip_triggered", tau=0.1)),
    "grpo": dict(name="grpo", advantage="grpo", use_critic=False, loss_agg="token-mean"),
    "tis": dict(rollout_correction="decoupled_token_is", rollout_correction_options={"threshold": 1.5}),
    # rollout corrections: sequence IS + rejection (rows leave the mask), IcePop, bypass mode with
    # the preset's loss and with REINFORCE, the IS batch normaliser (bypass: a batch statistic)
    "seq_is_rs": dict(rollout_correction="decoupled_seq_is_rs"),
    "icepop/turn": dict(name="turn_ppo", ratio_level="turn", rollout_correction="decoupled_token_icepop",
                        rollout_correction_options={"threshold": 1.5, "threshold_lower": 0.8}),
    "bypass_clip_k3": dict(name="grpo", advantage="grpo", use_critic=False,
                           rollout_correction="bypass_ppo_clip_k3_rs",
                           rollout_correction_options={"rs_threshold": 0.11}),
    "bypass_pg": dict(name="grpo", advantage="grpo", use_critic=False, loss_agg="token-mean",
                      rollout_correction="bypass_pg_geo_rs_token_tis",
                      rollout_correction_options={"rs_threshold": "0.95_1.05", "is_threshold": 1.5}),
    "bypass_pg/normalised": dict(name="grpo", advantage="grpo", use_critic=False,
                                 rollout_correction="bypass_pg_is",
                                 rollout_correction_options={"batch_normalize": True}),
    # every baseline loss mode (the batch-level ones: Clip-Cov, KL-Cov, BAPO), TIS on one
    **{f"mode/{mode}": dict(name="grpo", advantage="grpo", use_critic=False, loss_mode=mode,
                            ratio_level="sequence" if mode == "gmpo" else "token",
                            loss_options=OPTIONS.get(mode, {}))
       for mode in LOSS_MODES if mode != "clip"},
    "mode/bapo+tis": dict(name="bapo", advantage="grpo", use_critic=False, loss_mode="bapo",
                          clip_low=0.4, rollout_correction="decoupled_token_is"),
    "mode/sapo+bypass": dict(name="sapo", advantage="grpo", use_critic=False, loss_mode="sapo",
                             rollout_correction="bypass_ppo_clip_geo_rs",
                             rollout_correction_options={"rs_threshold": "0.95_1.05"}),
}


@pytest.fixture(scope="module")
def setup():
    policy = tiny_policy()
    return policy, update_batch(policy)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("micro", [5, 1])  # parts of 5, 5, 2 rows; single rows
def test_micro_batched_loss_gradient_and_metrics_equal_the_whole_minibatch(setup, case, micro):
    policy, mb = setup
    algo = _algo(**CASES[case])
    mb = _corrected(mb, algo)
    whole = _grads(policy, mb, _ctx(algo, 0))
    _assert_same(whole, _grads(policy, mb, _ctx(algo, micro)), f"{case}, micro {micro}")
    if algo.clip_bias.kind != "none" and micro == 5:  # the corrections act in this check
        assert float(whole[1]["clip_bias/scale"]) < 0.999, case
    rc = algo.spec.rollout_correction
    if rc.rollout_rs is not None and micro == 5:  # some rows are rejected, not all
        kept = (float(whole[1][RS_SEQ]) if rc.bypass_mode else
                float(mb.loss_mask.any(dim=1).sum() / mb.turn_ids.ge(0).any(dim=1).sum()))
        assert 0 < kept < 1, (case, kept)


def test_the_check_can_fail(setup, monkeypatch):
    """Micro-batches with each part's own denominators, or a batch λ from each part alone,
    differ from the whole minibatch: the equality above is not vacuous."""
    import stppo.train.microbatch as mbm

    policy, mb = setup
    algo = _algo(ratio_level="token", loss_agg="seq-mean-token-mean")
    whole = _grads(policy, mb, _ctx(algo, 0))
    monkeypatch.setattr(mbm, "minibatch_denoms", lambda mask, d: None)  # per-part counts
    with pytest.raises(AssertionError):
        _assert_same(whole, _grads(policy, mb, _ctx(algo, 5)), "local denominators")
    monkeypatch.undo()
    algo = _algo(name="st_ppo", ratio_level="turn",
                 clip_bias=dict(kind="clip_bias_norm", tau=0.05))
    whole = _grads(policy, mb, _ctx(algo, 0))
    monkeypatch.setattr(LossSpec, "separable", property(lambda self: True))  # λ of each part alone
    with pytest.raises(AssertionError):
        _assert_same(whole, _grads(policy, mb, _ctx(algo, 5)), "per-part λ")


def test_batch_level_losses_are_exactly_those_not_separable():
    assert {m for m, mode in LOSS_MODES.items() if not mode.separable} == {"clip_cov", "kl_cov", "bapo"}
    # bypass mode's IS weights come from π_θ in the loss: normalised by their batch mean, a batch
    # statistic; decoupled weights are fixed before the update
    assert not _algo("grpo", rollout_correction="bypass_pg_is",
                     rollout_correction_options={"batch_normalize": True}).spec.separable
    assert _algo("grpo", rollout_correction="bypass_pg_is").spec.separable
    assert _algo(rollout_correction="decoupled_seq_is",
                 rollout_correction_options={"batch_normalize": True}).spec.separable
    assert not _algo(clip_bias=dict(kind="clip_bias_norm")).spec.separable
    assert not _algo(clip_bias=dict(kind="clip_triggered")).spec.separable
    assert _algo(clip_bias=dict(kind="clip_bias_norm", granularity="sequence")).spec.separable
    assert _algo().spec.separable and not _algo("bapo").spec.separable


@pytest.mark.parametrize("micro", [5, 1])
def test_micro_batched_critic_equals_the_whole_minibatch(setup, micro):
    policy, mb = setup
    critic = ValueModel.from_policy(policy).train()
    out = []
    for m in (0, micro):
        critic.zero_grad(set_to_none=True)
        loss, metrics = critic_backward(critic, mb, _ctx(_algo(), m))
        out.append((loss.detach(), metrics, [p.grad.clone() for p in critic.parameters()]))
    _assert_same(out[0], out[1], f"critic, micro {micro}")


def test_parts_are_consecutive_rows():
    policy = tiny_policy()
    mb = update_batch(policy)
    parts = split(mb, 5)
    assert [len(p) for p in parts] == [5, 5, 2]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), mb.input_ids)


def _update(micro: int, checkpointing: bool, algo: AlgoConfig):
    policy = tiny_policy()
    batch = update_batch(policy)
    critic = ValueModel.from_policy(policy).train()
    if checkpointing:
        enable_checkpointing(policy)
        critic.gradient_checkpointing_enable()
    trainer = TrainerConfig(questions_per_step=N, group_size=1, minibatch_size=6, ppo_epochs=2,
                            micro_batch_size=micro, exact_clip_bias_every=2, max_grad_norm=1e9)
    ctx = UpdateContext(algo, trainer, torch.Generator().manual_seed(0), max_turns=4)
    opt, copt = RecordingSGD(policy.parameters(), lr=1.0), RecordingSGD(critic.parameters(), lr=0.1)
    m = actor_update(policy, opt, batch, ctx)
    m.update(critic_update(critic, copt, batch, ctx))
    return policy, critic, m, opt.grads + copt.grads


@pytest.mark.parametrize("algo", [dict(name="st_ppo", ratio_level="turn",
                                       clip_bias=dict(kind="clip_bias_norm", tau=0.05)),
                                  dict(name="ppo", entropy_coef=0.01)])
def test_update_with_micro_batches_and_checkpointing_equals_the_plain_update(algo):
    """Two epochs of two minibatches (4 optimizer steps of the actor, 4 of the critic): the
    micro-batched, gradient-checkpointed update takes the same gradients at every step, lands on
    the same weights and reports the same metrics. Float64 and SGD (tests/numerics.py): only the
    order of sums differs, so TOL (float64 rounding with room to spare) holds on any kernels."""
    algo = _algo(**algo)
    init = [p.detach().clone() for p in tiny_policy().parameters()]
    p0, c0, m0, g0 = _update(0, False, algo)
    p1, c1, m1, g1 = _update(2, True, algo)
    assert len(g0) == len(g1) == 8
    for i, (step0, step1) in enumerate(zip(g0, g1)):
        for j, (a, b) in enumerate(zip(step0, step1)):
            assert_close_to_scale(b, a, TOL, f"step {i}, gradient {j}")
    for j, (w0, a, b) in enumerate(zip(init, p0.parameters(), p1.parameters())):
        step0, step1 = a.detach() - w0, b.detach() - w0
        assert float(step0.abs().max()) > 0, j  # every policy weight moved
        assert_close_to_scale(step1, step0, TOL, f"policy weight {j}")
    for j, (a, b) in enumerate(zip(c0.parameters(), c1.parameters())):
        assert_close_to_scale(b.detach(), a.detach(), TOL, f"critic weight {j}")
    assert set(m0) == set(m1)
    for k in set(m0) - {"critic/vf_clipfrac"}:  # (†)
        assert m1[k] == pytest.approx(m0[k], rel=TOL, abs=TOL), k
    # (†) vf_clipfrac counts tokens with e2 > e1 (verl's definition); on an unclipped token e2 and
    # e1 are two roundings of one number, so after the first step (weights equal to ~1e-15, not
    # bit for bit) the count is float noise, not a statistic.


def test_checkpointing_recomputes_the_layers_in_backward():
    """The option works with the lean forward and micro-batches: each decoder layer runs twice
    per part (forward, then recomputed in backward)."""
    policy = tiny_policy()
    batch = update_batch(policy)
    enable_checkpointing(policy)
    calls = []
    policy.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # (‡)
    _grads(policy, batch, _ctx(_algo(), 6), exact_bias=False)  # 2 parts, shares
    assert len(calls) == 4
    # (‡) a pre-hook inside the layer: transformers checkpoints the layer's `forward` (its own
    # hooks stay outside), and the recomputation stops once the last saved tensor is rebuilt,
    # before the MLP returns


def test_micro_batch_size_must_divide_the_minibatch():
    with pytest.raises(ValueError, match=r"trainer\.micro_batch_size=3 must be 0 \(the whole "
                                         r"minibatch\) or divide trainer\.minibatch_size=8"):
        TrainerConfig(questions_per_step=4, group_size=2, minibatch_size=8, micro_batch_size=3)
    from stppo.train.distributed import check_divisible

    with pytest.raises(ValueError, match=r"trainer\.micro_batch_size=4 must divide the rows of "
                                         r"each rank's minibatch \(trainer\.minibatch_size=8 / 4 "
                                         r"processes = 2\)"):
        check_divisible(4, 8, 8, 4)
