"""The rollout corrections (docs/design.md §2, "Rollout correction"; stppo.algos.rollout_corr) by
hand: IS weights (token / sequence, truncation, IcePop, batch normalisation), rejection (k1/k2/k3
at token level and as sequence sums, means, maxima; several options), their metrics, the bypass
REINFORCE loss; limiting cases, mask invariance, gradcheck; the names, their options and the
one-line errors. The same functions against verl: tests/verl/test_rollout_correction_vs_verl.py."""

from __future__ import annotations

import math

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import LossInputs, LossSpec, RolloutCorrection, is_weights, policy_loss, rejection_mask, reinforce_loss
from stppo.algos.rollout_corr import ROLLOUT_CORRECTIONS, rollout_correction
from stppo.config import compose, to_config

LOG = math.log
NAN, INF = float("nan"), float("inf")


def rows(*values: list[float], width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ratios (N, width) float64, mask): row i holds values[i] from position 1 on; garbage
    (nan / inf) on every other position."""
    r = torch.full((len(values), width), NAN, dtype=torch.float64)
    r[:, 0] = INF
    mask = torch.zeros(len(values), width, dtype=torch.bool)
    for i, v in enumerate(values):
        r[i, 1:1 + len(v)] = torch.tensor(v, dtype=torch.float64)
        mask[i, 1:1 + len(v)] = True
    return r, mask


def f(x) -> float:
    return float(x)


# --- IS weights ------------------------------------------------------------------------------------
def test_token_truncated_is_by_hand():
    r, m = rows([LOG(3.0), LOG(0.25)], [0.0])  # raw ω: 3, 0.25 | 1
    w, mt = is_weights(r, m, "token", 2.0)
    assert w[m].tolist() == pytest.approx([2.0, 0.25, 1.0]) and (w[~m] == 0).all()
    assert f(mt[K.ROLLOUT_IS_MEAN]) == pytest.approx(3.25 / 3)
    assert (f(mt[K.ROLLOUT_IS_MAX]), f(mt[K.ROLLOUT_IS_MIN])) == pytest.approx((2.0, 0.25))
    assert f(mt[K.ROLLOUT_IS_FRACTION_HIGH]) == pytest.approx(1 / 3)  # raw 3 > C
    assert f(mt[K.ROLLOUT_IS_FRACTION_LOW]) == pytest.approx(1 / 3)  # raw 0.25 < 1/C
    mean = 3.25 / 3
    assert f(mt[K.ROLLOUT_IS_ESS]) == pytest.approx(1 / (((2 / mean) ** 2 + (0.25 / mean) ** 2 + (1 / mean) ** 2) / 3))
    var = (4 + 0.0625 + 1) / 3 - mean ** 2
    assert f(mt[K.ROLLOUT_IS_STD]) == pytest.approx(math.sqrt(var))
    seq = [(2 + 0.25) / 2, 1.0]  # per-row mean weights
    assert f(mt[K.ROLLOUT_IS_SEQ_MEAN]) == pytest.approx(sum(seq) / 2)
    assert f(mt[K.ROLLOUT_IS_SEQ_MAX_DEVIATION]) == pytest.approx(0.125)
    assert f(mt[K.ROLLOUT_IS_SEQ_FRACTION_HIGH]) == 0.0  # raw row means 1.625 and 1


def test_sequence_is_weights_are_the_truncated_product_on_every_token():
    r, m = rows([LOG(2.0), LOG(0.9)], [LOG(0.5), LOG(0.5)], [LOG(3.0)])  # products 1.8, 0.25, 3
    w, mt = is_weights(r, m, "sequence", 2.0)
    assert w[0, 1:3].tolist() == pytest.approx([1.8, 1.8]) and w[1, 1:3].tolist() == pytest.approx([0.25] * 2)
    assert w[2, 1].item() == pytest.approx(2.0) and (w[~m] == 0).all()
    assert f(mt[K.ROLLOUT_IS_MAX]) == pytest.approx(3.0)  # sequence level: the raw product's max
    assert f(mt[K.ROLLOUT_IS_MIN]) == pytest.approx(0.25)
    assert f(mt[K.ROLLOUT_IS_FRACTION_HIGH]) == pytest.approx(1 / 3)  # of trajectories
    assert f(mt[K.ROLLOUT_IS_FRACTION_LOW]) == pytest.approx(1 / 3)


def test_icepop_zeroes_weights_outside_its_band_and_keeps_the_mask():
    r, m = rows([LOG(3.0), LOG(1.2), LOG(0.4)])
    w, mt = is_weights(r, m, "token", "0.5_2.0")
    assert w[m].tolist() == pytest.approx([0.0, 1.2, 0.0])
    assert f(mt[K.ROLLOUT_IS_OOB_RATIO]) == pytest.approx(2 / 3)
    assert f(mt[K.ROLLOUT_IS_FRACTION_LOW]) == pytest.approx(1 / 3)  # the lower bound, not 1/C


def test_batch_normalisation_divides_by_the_batch_mean():
    r, m = rows([LOG(2.0), 0.0], [LOG(0.5)])
    w, mt = is_weights(r, m, "token", 4.0, batch_normalize=True)
    mean = 3.5 / 3  # verl's masked mean: the count 3 + 1e-8 is formed in float32, where it is 3
    assert w[m].tolist() == pytest.approx([2.0 / mean, 1.0 / mean, 0.5 / mean], rel=1e-12)
    assert f(mt[K.ROLLOUT_IS_BATCH_NORM_FACTOR]) == pytest.approx(mean, rel=1e-12)
    assert f(mt[K.ROLLOUT_IS_MEAN]) == pytest.approx(mean, rel=1e-12)  # metrics: before normalising
    w, _ = is_weights(r, m, "sequence", 4.0, batch_normalize=True)  # trajectories' mean: (2 + 0.5) / 2
    assert w[m].tolist() == pytest.approx([2 / 1.25, 2 / 1.25, 0.5 / 1.25])
    # under data parallelism: Σ over ranks (here one, `reduce` the identity), no 1e-8
    w, mt = is_weights(r, m, "token", 4.0, batch_normalize=True, reduce=lambda x: x)
    assert f(mt[K.ROLLOUT_IS_BATCH_NORM_FACTOR]) == 3.5 / 3


def test_weights_without_mismatch_are_one_and_garbage_reaches_nothing():
    r, m = rows([0.0, 0.0], [0.0])
    for level in ("token", "sequence"):
        w, mt = is_weights(r, m, level, 2.0, batch_normalize=True)
        assert w[m].tolist() == pytest.approx([1.0] * 3, rel=1e-7)  # (÷ 3 / (3 + 1e-8))
        assert f(mt[K.ROLLOUT_IS_ESS]) == pytest.approx(1.0)
        assert f(mt[K.ROLLOUT_IS_STD]) == pytest.approx(0.0, abs=1e-4)  # √(1e-8/3): verl's guard
    r2 = torch.where(m, r, torch.tensor(-INF, dtype=torch.float64))
    assert torch.equal(is_weights(r, m, "token", 2.0)[0], is_weights(r2, m, "token", 2.0)[0])


# --- rejection -------------------------------------------------------------------------------------
def test_token_and_sequence_rejection_by_hand():
    # rows: log ratios of the trainer to the sampler; k1 = −r, k2 = r²/2, k3 = e^r − 1 − r
    r, m = rows([0.05, -0.3], [0.01, 0.02], [0.5])
    kept, mt = rejection_mask(r, m, "token_k1", "0.9_1.1")  # keep −r ∈ [log 0.9, log 1.1]
    assert kept[m].tolist() == [True, False, True, True, False]
    assert f(mt[K.rollout_rs_key("token_k1", "masked_fraction")]) == pytest.approx(2 / 5)
    assert f(mt[K.ROLLOUT_RS_SEQ_MASKED_FRACTION]) == pytest.approx(2 / 3)
    kept, _ = rejection_mask(r, m, "seq_mean_k1", "0.99_1.01")  # geometric mean: row means −0.125, 0.015, 0.5
    assert kept.any(dim=1).tolist() == [False, False, False]
    kept, mt = rejection_mask(r, m, "seq_mean_k1", "0.8_1.2")  # |log| bounds ≈ 0.22, 0.18
    assert kept.any(dim=1).tolist() == [True, True, False] and torch.equal(kept[0], m[0])
    assert f(mt[K.rollout_rs_key("seq_mean_k1", "max")]) == pytest.approx(0.125)  # −r̄ of the rows
    assert f(mt[K.rollout_rs_key("seq_mean_k1", "min")]) == pytest.approx(-0.5)
    assert f(mt[K.rollout_rs_key("seq_mean_k1", "fraction_low")]) == pytest.approx(1 / 3)  # < log 0.8
    kept, _ = rejection_mask(r, m, "seq_sum_k2", 0.03)  # Σ r²/2: 0.04625, 0.00025, 0.125
    assert kept.any(dim=1).tolist() == [False, True, False]
    kept, _ = rejection_mask(r, m, "seq_max_k3", 0.01)  # max k3: 0.0413, 0.0002, 0.1487
    assert kept.any(dim=1).tolist() == [False, True, False]
    kept, _ = rejection_mask(r, m, "token_k2", 0.02)
    assert kept[m].tolist() == [True, False, True, True, False]
    # several options: all must pass; a single number u for a k1 option means [1/u, u]
    kept, mt = rejection_mask(r, m, "seq_mean_k1,token_k3", "1.2,0.001")
    assert kept[m].tolist() == [False, False, True, True, False]
    assert set(mt) >= {K.rollout_rs_key(o, s) for o in ("seq_mean_k1", "token_k3")
                       for s in ("mean", "max", "min", "std", "masked_fraction", "seq_mean")}


def test_rejection_keeps_everything_without_mismatch_and_ignores_garbage():
    r, m = rows([0.0, 0.0], [0.0])
    for opt, thr in (("seq_sum_k1", "0.999_1.001"), ("seq_mean_k3", 1e-12), ("token_k2", 1e-12)):
        kept, mt = rejection_mask(r, m, opt, thr)
        assert torch.equal(kept, m) and f(mt[K.ROLLOUT_RS_MASKED_FRACTION]) == 0.0
    r, m = rows([0.05, -0.3], [0.01])
    clean = torch.where(m, r, 0.0)
    a, ma = rejection_mask(r, m, "seq_mean_k3", 0.01)
    b, mb = rejection_mask(clean, m, "seq_mean_k3", 0.01)
    assert torch.equal(a, b) and all(torch.equal(ma[k], mb[k]) for k in ma)


# --- the correction, and REINFORCE ------------------------------------------------------------------
def test_rollout_correction_applies_weights_and_rejection_of_its_fields():
    r, m = rows([0.05, -0.3], [0.01, 0.02], [0.5])
    old = torch.where(m, r, 0.0).float()  # the sampler at 0: r = log π_old − log π_rollout
    c = rollout_correction(old, torch.zeros_like(old), m, RolloutCorrection("decoupled_geo_rs_token_tis",
                                                                           {"rs_threshold": "0.8_1.2"}))
    assert c.weights.dtype == torch.float32 and c.loss_mask.any(dim=1).tolist() == [True, True, False]
    assert c.weights[0, 1:3].tolist() == pytest.approx([math.exp(0.05), math.exp(-0.3)])
    c = rollout_correction(old, torch.zeros_like(old), m, RolloutCorrection("none"))
    assert c.weights is None and torch.equal(c.loss_mask, m) and c.metrics == {}


def reinforce(lp, rollout_lp, adv, mask, loss_agg, weights):
    """verl's REINFORCE loss through the loss contract: (inputs, spec) with clip 0.2/0.2."""
    x = LossInputs(lp, rollout_lp, adv, mask, torch.where(mask, 0, -1), rollout_is_weights=weights)
    return reinforce_loss(x, LossSpec(name="test", loss_agg=loss_agg, advantage="grpo", use_critic=False))


def test_reinforce_loss_by_hand_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    r_lp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    lp = (r_lp + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.5
    loss, mt = reinforce(lp, r_lp, adv, m, "token-mean", w)
    want = -(w * adv * lp.detach())[m].sum() / m.sum()  # s = −ω A log π, token-mean
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, torch.where(m, -w * adv / m.sum(), 0.0), rtol=1e-12, atol=0)
    assert f(mt[K.PPO_KL]) == pytest.approx(float(-(lp.detach() - r_lp)[m].mean()))
    rho = (lp.detach() - r_lp).exp()
    assert f(mt[K.CLIP_BIAS_NORM]) == pytest.approx(float((((rho - w) * adv)[m] ** 2).mean().sqrt()))
    assert torch.autograd.gradcheck(lambda x: reinforce(x, r_lp, adv, m, "seq-mean-token-mean", w)[0],
                                    (lp.detach().clone().requires_grad_(True),))
    garbage = torch.where(m, lp.detach(), torch.tensor(NAN, dtype=torch.float64))
    a, _ = reinforce(garbage, r_lp, adv, m, "token-mean", w)
    assert float(a) == pytest.approx(float(want), rel=1e-12)


def test_policy_loss_routes_bypass_reinforce():
    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    lp = roll + 0.05
    adv = torch.randn(2, 4, generator=g, dtype=torch.float64)
    m = torch.ones(2, 4, dtype=torch.bool)
    spec = LossSpec("grpo", advantage="grpo", use_critic=False, loss_agg="token-mean",
                    rollout_correction=RolloutCorrection("bypass_pg_geo_rs"))
    out = policy_loss(lp, roll, adv, m, torch.zeros(2, 4, dtype=torch.long), spec)
    assert float(out.loss) == pytest.approx(float(-(adv * lp).mean()), rel=1e-12)  # ω ≡ 1
    plain = policy_loss(lp, roll, adv, m, torch.zeros(2, 4, dtype=torch.long), spec.replace(
        rollout_correction=RolloutCorrection("bypass_ppo_clip")))  # the preset's clip loss
    assert float(plain.loss) == pytest.approx(float(-(adv * (lp - roll).exp()).mean()), rel=1e-12)


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTIONS))
def test_on_policy_every_correction_takes_the_uncorrected_step(name):
    """π_θ = π_old = π_rollout (a stale run's first step): every IS weight is 1, every RS band
    keeps every token, and PPO's clipped ratio and the bypass REINFORCE have one gradient,
    −agg(A ∇log π); so every correction's loss has the gradient of 'none' (float64: to 1e-12).
    tests/test_train_rollout_correction.py's multirun relies on it."""
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    m = torch.rand(4, 6, generator=g) < 0.7
    turns = torch.where(m, 0, -1)

    def grad(rc: RolloutCorrection) -> torch.Tensor:
        c = rollout_correction(lp, lp, m, rc)  # decoupled: once per step; bypass: in the loss, from π_θ
        weights = c.weights if rc.applies_weights else None
        x = lp.clone().requires_grad_(True)
        spec = LossSpec("grpo", advantage="grpo", use_critic=False, loss_agg="token-mean", rollout_correction=rc)
        out = policy_loss(x, lp, adv, c.loss_mask, turns, spec, rollout_is_weights=weights)
        assert torch.equal(c.loss_mask, m), name
        return torch.autograd.grad(out.loss, x)[0]

    torch.testing.assert_close(grad(RolloutCorrection(name)), grad(RolloutCorrection("none")), rtol=1e-12, atol=1e-15)


# --- names, options, errors ------------------------------------------------------------------------
def test_names_fields_and_options():
    assert len(ROLLOUT_CORRECTIONS) == 19
    rc = RolloutCorrection("decoupled_token_icepop", {"threshold": 4})
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs) == ("token", "0.5_4.0", None)
    assert dict(rc.options) == {"threshold": 4.0, "threshold_lower": 0.5, "batch_normalize": False}
    rc = RolloutCorrection("bypass_pg_geo_rs_seq_tis")
    assert (rc.rollout_is, rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode, rc.loss_type) == (
        "sequence", "seq_mean_k1", "0.999_1.001", True, "reinforce")
    assert rc.reinforce and rc.applies_weights and not rc.decoupled
    rc = RolloutCorrection("bypass_ppo_clip_k3_rs")
    assert not rc.applies_weights and rc.rollout_rs_threshold == 0.01
    assert RolloutCorrection("decoupled_k3_rs", {"rs_threshold": "0.02"}).rollout_rs_threshold == 0.02
    assert RolloutCorrection("decoupled_geo_rs").decoupled and not RolloutCorrection().decoupled


def test_the_command_line_syntax():
    a = to_config(compose(["algo=grpo", "algo.rollout_correction=decoupled_geo_rs"])).algo
    assert a.spec.rollout_correction == RolloutCorrection("decoupled_geo_rs")
    assert a.rollout_correction_options.rs_threshold == "0.999_1.001"  # the values that ran
    assert a.rollout_correction_options.threshold is None
    a = to_config(compose(["algo=ppo", "algo.rollout_correction=decoupled_seq_is_rs",
                           "algo.rollout_correction_options.rs_threshold='0.5_3'",
                           "algo.rollout_correction_options.batch_normalize=true"])).algo
    rc = a.spec.rollout_correction
    assert (rc.rollout_rs_threshold, rc.rollout_is_batch_normalize) == ("0.5_3", True)
    assert LossSpec.from_dict(a.spec.to_dict()) == a.spec


@pytest.mark.parametrize("overrides,message", [
    (["algo.rollout_correction=tis"], "algo.rollout_correction='tis' is not valid; allowed: none, decoupled_token_is"),
    (["algo.rollout_correction=decoupled_geo_rs", "algo.rollout_correction_options.threshold=3"],
     "algo.rollout_correction_options.threshold is not an option of decoupled_geo_rs; valid: rs_threshold"),
    (["algo.rollout_correction=decoupled_token_is", "algo.rollout_correction_options.threshold=-1"],
     "algo.rollout_correction_options.threshold must be a number > 0, got -1"),
    (["algo.rollout_correction=decoupled_geo_rs", "algo.rollout_correction_options.rs_threshold=0.5_2"],
     r"algo.rollout_correction_options.rs_threshold: option seq_mean_k1: needs lower <= upper"),
    (["algo.rollout_correction=decoupled_k3_rs", "algo.rollout_correction_options.rs_threshold='0.1_1.0'"],
     "option seq_mean_k3 takes one upper bound"),
    (["algo.rollout_correction=decoupled_token_icepop", "algo.rollout_correction_options.threshold_lower=9"],
     r"algo.rollout_correction_options.threshold_lower: lower bound must be in \(0, upper=5.0\]"),
    (["algo.rollout_correction=decoupled_geo_rs", "algo.rollout_correction_options.batch_normalize=true"],
     "batch_normalize is not an option of decoupled_geo_rs"),
    (["algo=st_ppo", "algo.rollout_correction=bypass_pg_is"],
     "algo.rollout_correction=bypass_pg_is replaces the policy loss with verl's bypass REINFORCE loss"),
    (["algo=cispo", "algo.rollout_correction=bypass_pg_geo_rs"], "got loss_mode cispo"),
])
def test_invalid_settings_are_one_line_errors_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        to_config(compose(["algo=grpo", *overrides]))
    assert "\n" not in str(e.value)
