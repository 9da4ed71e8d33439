"""stppo's losses as verl calls them: through verl's own `workers/utils/losses.py::ppo_loss` on
CPU micro-batches made by verl's own `left_right_2_no_padding` / `prepare_micro_batches`, with
the actor config built by verl's `omega_conf_to_dataclass` (docs/design.md, "verl backend:
losses"). Batches: multi-turn rows with observation runs, padding, a row truncated mid-turn and an
empty row. Float64 throughout; the reference is `stppo.algos.policy_loss` with the turn ids
derived from `response_mask`."""

from __future__ import annotations

import pytest
import torch

from stppo.algos import LOSS_MODES, PRESETS, ClipBias, policy_loss
from stppo.algos.segments import turn_ids_from_mask
from stppo.metric_names import (CLIP_BIAS_SCALE, PG_CLIPFRAC, PG_CLIPFRAC_LOWER, PG_LOSS, PPO_KL)
from verl_batch import floats, make_batch, run_ppo_loss

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# SSPO reads subsentences from the token ids, which verl does not pass to a policy loss
VERL_PRESETS = [name for name, p in PRESETS.items() if not LOSS_MODES[p.loss_mode].segments]
TAU = {"none": None, "clip_bias_norm": 0.3, "clip_triggered": 0.5}  # bind on the test batch
N = 8
ATOL = 1e-10


def knobs(name: str, granularity: str = "batch") -> dict:
    tau = TAU[PRESETS[name].clip_bias]
    return {} if tau is None else {"tau": tau, "granularity": granularity}


def reference(b, name, loss_agg, global_denoms, tau=None, granularity="batch", clip=0.2, c=3.0):
    """stppo.algos.policy_loss on `b` with turn ids from the mask: (loss, ∂loss/∂log π, metrics)."""
    preset = PRESETS[name]
    lp = b.log_prob.clone().requires_grad_(True)
    mask = b.mask
    correction = (None if preset.clip_bias == "none" else
                  ClipBias(preset.clip_bias, preset.tau if tau is None else tau, "token",
                             granularity))
    spec = preset.spec(loss_agg=loss_agg, clip_low=clip, clip_high=clip,
                       dual_clip=c if LOSS_MODES[preset.loss_mode].dual_clip else None,
                       clip_bias=correction)
    loss, m = policy_loss(lp, b.old_log_probs, b.advantages, mask, turn_ids_from_mask(mask), spec,
                          global_denoms=global_denoms)
    loss.backward()
    return loss.detach(), lp.grad, {k: float(v) for k, v in m.items()}


def assert_metrics_equal(got: dict, want: dict) -> None:
    missing = sorted(set(want) - set(got))
    assert not missing, f"metrics missing from the verl call: {missing}"
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=0, abs=ATOL), k


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", VERL_PRESETS)
def test_loss_through_verl_ppo_loss_equals_policy_loss(actor_config, name, agg):
    cfg = actor_config(f"stppo_{name}", agg, **knobs(name))
    b = make_batch(seed=1)
    torch.manual_seed(7)  # clip_cov draws its tokens from torch's global generator (as verl)
    losses, metrics, grad = run_ppo_loss(cfg, b, micro=N)
    d_tok = int(b.response_mask.sum())  # verl's batch_num_tokens; global_batch_size = N rows
    tau = TAU[PRESETS[name].clip_bias]
    torch.manual_seed(7)
    want_loss, want_grad, want_m = reference(b, name, agg, (d_tok, N), tau)
    assert losses[0].dtype == torch.float64
    assert float(losses[0]) == pytest.approx(float(want_loss), rel=0, abs=ATOL)
    assert torch.allclose(grad, want_grad, rtol=0, atol=ATOL)
    assert (grad[~b.mask] == 0).all()  # observation tokens, padding, the empty row: no gradient
    got = floats(metrics[0])
    assert_metrics_equal(got, want_m)
    assert PG_CLIPFRAC_LOWER in got and got[PG_LOSS] == float(losses[0])


NO_BATCH_SCALE = [("ppo", "batch"), ("turn_ppo", "batch"), ("grpo", "batch"), ("gspo", "batch"),
                  ("s_ppo", "sequence"), ("st_ppo", "sequence")]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name,granularity", NO_BATCH_SCALE)
def test_micro_batches_and_ranks_sum_to_the_mini_batch(actor_config, name, granularity, agg):
    """Presets without a batch-level scale: 2 micro-batches with verl's global counts sum to the
    whole mini-batch's loss and gradient; so do 2 data-parallel ranks (dp_size=2, each with its
    own 2 micro-batches) once FSDP averages their gradients."""
    cfg = actor_config(f"stppo_{name}", agg, **knobs(name, granularity))
    b = make_batch(seed=2)
    whole, _, g_whole = run_ppo_loss(cfg, b, micro=N)
    split, _, g_split = run_ppo_loss(cfg, b, micro=N // 2)
    assert len(split) == 2
    assert float(sum(split)) == pytest.approx(float(whole[0]), rel=0, abs=ATOL)
    assert torch.allclose(g_split, g_whole, rtol=0, atol=ATOL)
    d_tok, half = int(b.response_mask.sum()), N // 2
    ranks = [run_ppo_loss(cfg, b.rows(slice(r * half, (r + 1) * half)), micro=half // 2,
                          dp_size=2, batch_num_tokens=d_tok, global_batch_size=N)
             for r in range(2)]
    assert float(sum(sum(ls) for ls, _, _ in ranks)) / 2 == pytest.approx(float(whole[0]),
                                                                        rel=0, abs=ATOL)
    g_dp = torch.cat([g for _, _, g in ranks]) / 2  # FSDP: the mean over ranks
    assert torch.allclose(g_dp, g_whole, rtol=0, atol=ATOL)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", ["ppo", "st_ppo"])
def test_sequence_means_count_every_row_of_the_mini_batch(actor_config, name, agg):
    """verl's global_batch_size counts every row; stppo's own D_seq only rows with an agent
    token. With e empty rows of B, the verl loss is (B − e)/B times stppo's whole-batch loss
    (token-mean: equal)."""
    cfg = actor_config(f"stppo_{name}", agg, **knobs(name))
    b = make_batch(seed=3)
    empty = int((b.response_mask.sum(1) == 0).sum())
    assert empty == 1
    losses, _, grad = run_ppo_loss(cfg, b, micro=N)
    own_loss, own_grad, _ = reference(b, name, agg, None, TAU[PRESETS[name].clip_bias])
    factor = 1.0 if agg == "token-mean" else (N - empty) / N
    assert float(losses[0]) == pytest.approx(factor * float(own_loss), rel=0, abs=ATOL)
    assert torch.allclose(grad, factor * own_grad, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["s_ppo", "st_ppo", "so_ppo"])
def test_correction_scale_is_per_micro_batch(actor_config, name):
    """Under verl, λ of S-/ST-/SO-PPO (batch granularity) is each micro-batch's own: each
    micro-batch loss is policy_loss of its rows alone (global denominators, its own λ), and the
    micro-batch losses do not sum to the mini-batch's (docs/design.md §6)."""
    agg = "seq-mean-token-mean"
    cfg = actor_config(f"stppo_{name}", agg, **knobs(name))
    b = make_batch(seed=4)
    d_tok, half = int(b.response_mask.sum()), N // 2
    whole, m_whole, _ = run_ppo_loss(cfg, b, micro=N)
    split, m_split, _ = run_ppo_loss(cfg, b, micro=half)
    tau = TAU[PRESETS[name].clip_bias]
    lams = []
    for r, loss in enumerate(split):
        want, _, want_m = reference(b.rows(slice(r * half, (r + 1) * half)), name, agg,
                                    (d_tok, N), tau)
        assert float(loss) == pytest.approx(float(want), rel=0, abs=ATOL)
        assert floats(m_split[r])[CLIP_BIAS_SCALE] == pytest.approx(want_m[CLIP_BIAS_SCALE],
                                                                    rel=0, abs=ATOL)
        lams.append(want_m[CLIP_BIAS_SCALE])
    lam = floats(m_whole[0])[CLIP_BIAS_SCALE]
    assert lam < 1.0 and max(abs(x - lam) for x in lams) > 1e-3  # the scale binds and differs
    assert abs(float(sum(split)) - float(whole[0])) > 1e-6


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("micro", [N, N // 2])
def test_stppo_ppo_equals_verl_vanilla(actor_config, agg, micro):
    """stppo_ppo is verl's own `vanilla` loss (clip, dual clip c = clip_ratio_c, aggregation with
    the global counts) and reports verl's three metrics with verl's meaning. Tolerances: verl
    divides by (count + 1e-8) where stppo divides by the count (loss, gradient: 1e-8 relative),
    and it takes the clip fractions of a float32 mask (1e-7 relative)."""
    b = make_batch(seed=5, garbage=5.0)  # vanilla multiplies garbage by 0: it must be finite
    ours, m_ours, g_ours = run_ppo_loss(actor_config("stppo_ppo", agg), b, micro=micro)
    theirs, m_theirs, g_theirs = run_ppo_loss(actor_config("vanilla", agg), b, micro=micro)
    for lo, lt, mo, mt in zip(ours, theirs, m_ours, m_theirs):
        assert float(lo) == pytest.approx(float(lt), rel=1e-8, abs=1e-12)
        fo, ft = floats(mo), floats(mt)
        for k in (PG_CLIPFRAC, PPO_KL, PG_CLIPFRAC_LOWER):
            assert fo[k] == pytest.approx(ft[k], rel=1e-7, abs=1e-12), k
    assert torch.allclose(g_ours, g_theirs, rtol=1e-8, atol=1e-12)
    assert max(floats(m)[PG_CLIPFRAC_LOWER] for m in m_theirs) > 0  # the dual clip binds


def test_unsupported_loss_agg_mode_is_one_clear_error(actor_config):
    cfg = actor_config("stppo_st_ppo", "token-sum")
    with pytest.raises(ValueError, match=r"actor.loss_agg_mode='token-sum' is not supported by "
                                         r"stppo's losses; allowed: token-mean, "):
        run_ppo_loss(cfg, make_batch(seed=6), micro=N)


def test_rollout_is_weights_reach_policy_loss_or_fail_clearly(actor_config):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cfg = actor_config("stppo_ppo", "token-mean")
    b = make_batch(seed=7)
    fn = get_policy_loss_fn("stppo_ppo")
    w = torch.rand_like(b.log_prob)
    args = dict(old_log_prob=b.old_log_probs, log_prob=b.log_prob, advantages=b.advantages,
                response_mask=b.mask, loss_agg_mode="token-mean", config=cfg)
    # policy_loss multiplies the per-token loss by the weights (verl's semantics)
    assert float(fn(**args, rollout_is_weights=w)[0]) != float(fn(**args)[0])


def test_a_loss_that_reads_subsentences_is_one_clear_error_under_verl(actor_config):
    assert VERL_PRESETS != list(PRESETS)  # sspo is registered, and refuses to run
    with pytest.raises(ValueError, match="loss_mode='sspo' reads subsentences from the token ids, "
                                         "which verl does not pass to a policy loss") as e:
        run_ppo_loss(actor_config("stppo_sspo", "token-mean"), make_batch(seed=8), micro=N)
    assert "\n" not in str(e.value)
