"""Turn segments and the turn-level fast path of policy_loss (stppo.algos.segments, docs/design.md §2):
segment layout, the TurnRatio autograd node, the per-turn statistics of the clipped loss
(stppo.algos.turn_clip: parts by sign of A, saturated log-ratios), per-row aggregation factors,
cached correction specs."""

import math

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import (ClipBias, agg_weights, clip_bias_term, clipped_surrogate,
                         importance_ratio, log_ratio, resolve_clip_bias, turn_ratio)
from stppo.algos.aggregation import agg_denoms, agg_row_weights, mask_float
from stppo.algos.ratios import clamped_log_ratio
from stppo.algos.segments import INTERLEAVE, TurnRatio, TurnSegments
from stppo.algos.turn_clip import TurnStats
from keyword_loss import policy_loss
from test_algos_corrections import linear_policy
from helpers.algos import loop_agg, loop_ratio, loop_surrogate, make_inputs, with_garbage

B = INTERLEAVE
CLIP = dict(clip_low=0.2, clip_high=0.2)


def segments_of(x, dtype=torch.float64):
    return TurnSegments.build(x["loss_mask"], x["turn_ids"], mask_float(x["loss_mask"], dtype))


def test_segments_hand_computed_split_turn_and_ignored_off_mask_ids():
    mask = torch.tensor([[True, True, False, True, True, False], [False] * 6])
    turns = torch.tensor([[1, 1, 9, 0, 1, -1], [5, 5, 5, 5, 5, 5]])  # 9 and 5 are off the mask
    segs = TurnSegments.build(mask, turns)
    assert segs.num == 3  # segments 0 (non-agent), 1 (turn 0), 2 (turn 1)
    ramp = torch.arange(6) % B
    expected_seg = torch.tensor([[2, 2, 0, 1, 2, 0], [0] * 6])
    assert torch.equal(segs.slot, expected_seg * B + ramp)
    assert torch.equal(segs.count, torch.tensor([[0.0, 1.0, 3.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(segs.inv_count, torch.tensor([[0.0, 1.0, 1 / 3], [0.0, 1.0, 1.0]]))
    v = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    assert torch.equal(segs.gather(v), torch.tensor([[30.0, 30, 10, 20, 30, 10], [40.0] * 6]))
    x = torch.arange(12.0).view(2, 6)
    assert torch.equal(segs.scatter(x), torch.tensor([[7.0, 3.0, 5.0], [51.0, 0.0, 0.0]]))


def test_segments_accept_int32_ids_and_reject_negative_agent_ids():
    x = make_inputs(3, 12, seed=1, max_turns=4)
    s64 = TurnSegments.build(x["loss_mask"], x["turn_ids"])
    s32 = TurnSegments.build(x["loss_mask"], x["turn_ids"].int())
    assert torch.equal(s64.slot, s32.slot) and torch.equal(s64.count, s32.count)
    bad = torch.where(x["loss_mask"], -2, -1)
    with pytest.raises(ValueError, match="turn_ids must be >= 0 on agent tokens.*-2"):
        TurnSegments.build(x["loss_mask"], bad)


def test_segment_ratio_discards_garbage_off_agent_tokens():
    x = make_inputs(4, 16, seed=2, empty_row=True)
    segs = segments_of(x, torch.float32)
    clean = log_ratio(x["log_probs"], x["old_log_probs"], x["loss_mask"])
    dirty = clamped_log_ratio(with_garbage(x["log_probs"], x["loss_mask"]), x["old_log_probs"])
    assert not torch.isfinite(dirty).all()
    rho_c, sum_c = segs.ratio(clean)
    rho_d, sum_d = segs.ratio(dirty)
    assert torch.equal(rho_c, rho_d) and torch.equal(sum_c, sum_d)
    assert torch.equal(segs.gather(rho_c), turn_ratio(clean, x["loss_mask"], x["turn_ids"]))


def test_turn_ratio_node_gradcheck_float64():
    x = make_inputs(3, 10, seed=3, dtype=torch.float64, max_turns=3)
    segs = segments_of(x)
    delta = log_ratio(x["log_probs"], x["old_log_probs"], x["loss_mask"])
    assert torch.autograd.gradcheck(lambda d: TurnRatio.apply(d, segs),
                                    (delta.clone().requires_grad_(True),))


def test_turn_stats_hand_computed_parts_by_sign_of_the_advantage():
    mask = torch.tensor([[True, True, True, False, True, True], [False] * 6])
    turns = torch.tensor([[0, 0, 0, 7, 1, 1], [3] * 6])  # 7 and 3 are off the mask
    adv = torch.where(mask, torch.tensor([[2.0, -1.0, 0.0, 9.0, 3.0, 4.0], [5.0] * 6]), 0.0)
    lp = torch.tensor([[0.3, 0.1, 0.2, math.nan, 25.0, 1.0], [math.inf] * 6])
    diff = lp.clamp(-20, 20)
    st = TurnStats.build(diff, adv, mask, turns)
    assert st.n.shape == (2, 3, 3)  # K = max turn id + 2 segments, 3 parts (A < 0, = 0, > 0)
    assert st.n[0].tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 2]] and not st.n[1].any()
    assert st.s[0, 1].tolist() == [-1.0, 0.0, 2.0] and st.s[0, 2].tolist() == [0.0, 0.0, 7.0]
    assert st.q[0, 2].tolist() == [0.0, 0.0, 25.0]
    assert st.count[0].tolist() == [0.0, 3.0, 2.0] and st.inv_count[0, 0] == 0.0
    assert torch.allclose(st.delta_sum[0], torch.tensor([0.0, 0.6, 21.0]))
    assert torch.allclose(st.rho[0], torch.tensor([1.0, math.exp(0.2), math.exp(10.5)]))
    assert st.rho[1].tolist() == [1.0, 1.0, 1.0]  # no agent token: ratio 1, garbage discarded
    v = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    assert st.gather(v).tolist() == [[20.0, 20, 20, 10, 30, 30], [40.0] * 6]


def test_saturated_log_ratios_and_zero_advantages_at_turn_level_match_the_loop_reference():
    x = make_inputs(4, 14, seed=11, spread=0.5, dtype=torch.float64, max_turns=3)
    mask = x["loss_mask"]
    idx = mask.nonzero()
    x["log_probs"][tuple(idx[::5].T)] += 26.0  # δ clamps to 20: no gradient through those tokens
    x["advantages"][tuple(idx[1::4].T)] = 0.0
    lp1, lp2 = (x["log_probs"].clone().requires_grad_(True) for _ in range(2))
    loss, m = run(x, lp=lp1, dual_clip=3.0)
    rho = loop_ratio(lp2, x["old_log_probs"], mask, x["turn_ids"], "turn")
    s, hi, lo = loop_surrogate(rho, x["advantages"], mask, 0.2, 0.2, 3.0)
    ref = loop_agg(s, mask, "seq-mean-token-mean")
    (loss + ref).backward()  # independent graphs: each gets its own gradient
    assert torch.allclose(loss, ref) and torch.allclose(lp1.grad, lp2.grad)
    assert (lp1.grad[tuple(idx[::5].T)] == 0).all() and (lp1.grad[mask] != 0).any()
    assert m[K.PG_CLIPFRAC].item() == pytest.approx((hi | lo).sum().item() / mask.sum().item())


@pytest.mark.parametrize("level", ("token", "turn"))
def test_a_nan_advantage_on_an_agent_token_gives_a_nan_loss_at_every_level(level):
    x = make_inputs(3, 10, seed=12)
    x["advantages"][x["loss_mask"].nonzero()[0].tolist()] = math.nan  # a user bug: not hidden
    loss, _ = run(x, ratio_level=level)
    assert loss.isnan()


def test_agg_row_weights_times_mask_are_agg_weights():
    x = make_inputs(5, 12, seed=6, empty_row=True)
    mask = x["loss_mask"]
    mf = mask_float(mask)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        for denoms in (None, agg_denoms(mask), (100, 9)):
            rows = agg_row_weights(mf, mode, denoms)
            assert rows.shape == (5,)
            assert torch.equal(mf * rows.unsqueeze(1), agg_weights(mask, mode, denoms))
            assert torch.equal(rows, agg_row_weights(mf, mode, denoms, lengths=mf.sum(dim=1)))


def run(x, lp=None, **kw):
    kw = {**CLIP, "ratio_level": "turn", "loss_agg": "seq-mean-token-mean", **kw}
    return policy_loss(x["log_probs"] if lp is None else lp, x["old_log_probs"], x["advantages"],
                       x["loss_mask"], x["turn_ids"], **kw)


def test_turn_level_metrics_from_segments_equal_token_formulas():
    x = make_inputs(5, 16, seed=7, spread=0.6, empty_row=True)
    mask = x["loss_mask"]
    _, m = run(x)
    rho, delta = importance_ratio(x["log_probs"], x["old_log_probs"], mask, x["turn_ids"], "turn")
    assert m[K.PPO_KL].item() == pytest.approx(-delta[mask].mean().item(), rel=1e-5)
    assert m[K.RATIO_MEAN].item() == pytest.approx(rho[mask].mean().item(), rel=1e-6)
    assert m[K.RATIO_MAX].item() == rho[mask].max().item()


def test_agent_tokens_with_turn_id_minus_one_have_ratio_one_and_no_gradient():
    x = make_inputs(3, 12, seed=8, spread=0.5)
    mask = x["loss_mask"]
    lone = mask & (torch.arange(12) % 3 == 0)  # some agent tokens lose their turn id
    assert lone.any()
    x["turn_ids"] = torch.where(lone, -1, x["turn_ids"])
    delta = log_ratio(x["log_probs"], x["old_log_probs"], mask)
    assert (turn_ratio(delta, mask, x["turn_ids"])[lone] == 1.0).all()
    lp = x["log_probs"].clone().requires_grad_(True)
    loss, m = run(x, lp=lp)
    loss.backward()
    assert (lp.grad[lone] == 0).all() and (lp.grad[mask & ~lone] != 0).any()
    assert m[K.RATIO_MAX].item() >= 1.0  # the lone tokens count with ratio 1


def test_turn_level_in_bfloat16_matches_float32():
    x = make_inputs(4, 16, seed=9, spread=0.3)
    ref, m_ref = run(x)
    lp = x["log_probs"].bfloat16().requires_grad_(True)
    loss, m = run(x, lp=lp)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(lp.grad.float()).all()
    x32 = dict(x, log_probs=x["log_probs"].bfloat16().float())
    ref32, _ = run(x32)
    assert torch.allclose(loss, ref32, atol=1e-6)


def test_grad_estimator_at_turn_level_uses_the_turn_ratio():
    net, log_probs, x = linear_policy(seed=2)
    agg = "token-mean"
    rho, _ = importance_ratio(log_probs(), x["old_log_probs"], x["loss_mask"], x["turn_ids"],
                              "turn")
    clipped = clipped_surrogate(rho.detach(), x["advantages"], **CLIP).clipped
    assert clipped.any()
    net.zero_grad()
    clip_bias_term(rho, x["advantages"], clipped, x["loss_mask"], agg).backward()
    g_ref = math.sqrt(sum((p.grad ** 2).sum().item() for p in net.parameters()))
    net.zero_grad()
    base, _ = run(x, lp=log_probs(), loss_agg=agg)
    base.backward()
    base_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    corr = {"kind": "clip_bias_norm", "tau": g_ref / 4, "estimator": "grad"}
    loss, m = run(x, lp=log_probs(), loss_agg=agg, clip_bias=corr, params=net.parameters())
    assert m[K.CLIP_BIAS_GRAD_NORM].item() == pytest.approx(g_ref)
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx(0.25)
    assert loss.item() == pytest.approx(base.item() / 4)
    loss.backward()
    for p, g0 in zip(net.parameters(), base_grads):
        assert torch.allclose(p.grad, g0 / 4)


def test_resolved_corrections_are_cached_but_still_validated():
    a = resolve_clip_bias({"kind": "clip_bias_norm", "tau": 0.3})
    assert a is resolve_clip_bias({"kind": "clip_bias_norm", "tau": 0.3})
    assert a == ClipBias("clip_bias_norm", 0.3)
    assert resolve_clip_bias({"kind": "clip_bias_norm", "tau": 1}).tau == 1
    with pytest.raises(ValueError, match="clip_bias.tau must be a number > 0, got True"):
        resolve_clip_bias({"kind": "clip_bias_norm", "tau": True})
    with pytest.raises(ValueError, match="clip_bias.tau must be a number > 0"):
        resolve_clip_bias({"kind": "clip_bias_norm", "tau": [0.3]})  # unhashable: uncached
    with pytest.raises(ValueError, match="clip_bias.tau"):
        resolve_clip_bias({"kind": "clip_bias_norm", "tau": -1.0})
