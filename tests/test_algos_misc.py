"""Aggregation, KL estimators, value loss, entropy/log-prob helpers, presets, registries."""

import math

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import (KL_ESTIMATORS, LOSS_AGGS, PRESETS, LossSpec, Preset, Registry,
                         UnknownNameError,
                         agg_loss, entropy_from_logits, explained_variance, kl_in_reward, kl_loss,
                         kl_penalty, register_preset, token_log_probs, value_loss)
from helpers.algos import loop_agg, make_layout, with_garbage

NAN = math.nan


# --- aggregation ---------------------------------------------------------------------------------
def test_agg_loss_hand_computed_and_empty_rows_excluded():
    v = torch.tensor([[1.0, 2.0, NAN], [3.0, math.inf, NAN], [NAN, NAN, NAN]])
    m = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert agg_loss(v, m, "token-mean").item() == pytest.approx(2.0)
    assert agg_loss(v, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2)
    assert agg_loss(v, m, "seq-mean-token-sum").item() == pytest.approx((3.0 + 3.0) / 2)
    assert agg_loss(v, torch.zeros_like(m), "token-mean").item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_agg_loss_equals_loop_and_masks_gradients(mode):
    mask, _ = make_layout(5, 10, seed=4, empty_row=True)
    x = torch.randn(5, 10, dtype=torch.float64)
    v = with_garbage(x, mask).requires_grad_(True)
    out = agg_loss(v, mask, mode)
    assert out.item() == pytest.approx(loop_agg(x, mask, mode).item())
    out.backward()
    assert torch.isfinite(v.grad).all() and (v.grad[~mask] == 0).all()


def test_agg_loss_errors_list_valid_modes():
    m = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        agg_loss(torch.ones(2, 2), m, "mean")
    with pytest.raises(ValueError, match="global_denoms must be a pair"):
        agg_loss(torch.ones(2, 2), m, "token-mean", global_denoms=(4,))
    assert tuple(LOSS_AGGS) == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


# --- KL ------------------------------------------------------------------------------------------
def test_kl_estimators_at_known_points():
    lp = torch.tensor([[math.log(0.5), 0.0, -30.0]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25), 0.0, 0.0]], dtype=torch.float64)
    x = math.log(2.0)
    expected = {"k1": [x, 0.0, -30.0], "k2": [x * x / 2, 0.0, 450.0],
                # k3 = exp(-x) + x - 1; at x = -30, -x clamps to 20 and k3 to 10 (verl low_var_kl)
                "k3": [0.5 + x - 1, 0.0, 10.0]}
    for kind, values in expected.items():
        want = torch.tensor([values], dtype=torch.float64)
        assert torch.allclose(kl_penalty(lp, ref, kind), want)
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


def test_kl_loss_and_kl_in_reward_ignore_masked_garbage():
    mask = torch.tensor([[True, True, False]])
    lp = torch.tensor([[-1.0, -2.0, NAN]])
    ref = torch.tensor([[-1.5, -2.0, math.inf]])
    loss, m = kl_loss(lp, ref, mask, kind="k1", loss_agg="token-mean")
    assert loss.item() == pytest.approx(0.25) and m[K.KL_REF].item() == pytest.approx(0.25)
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    out, m = kl_in_reward(rewards, lp, ref, mask, beta=0.1, kind="k1")
    assert torch.allclose(out, torch.tensor([[-0.05, 1.0, 0.0]]))
    assert m[K.KL_REF].item() == pytest.approx(0.25)


# --- value loss ----------------------------------------------------------------------------------
def test_value_loss_clipping_hand_computed():
    values = torch.tensor([[1.0, 1.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.5, 0.9, NAN]])
    returns = torch.tensor([[2.0, 0.0, NAN]])
    mask = torch.tensor([[True, True, False]])
    loss, m = value_loss(values, old, returns, mask, clip_range=0.2, loss_agg="token-mean")
    # token 0: e1 = 1, clipped V = 0.7 → e2 = 1.69 > e1 (clipped, no gradient); token 1: e1 = 1,
    # V stays within 0.9 ± 0.2 → e2 = e1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert m[K.VF_CLIPFRAC].item() == pytest.approx(0.5)
    assert m[K.VF_LOSS].item() == pytest.approx(loss.item())
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, 0.5, 0.0]]))
    unclipped, m = value_loss(values, old, returns, mask, clip_range=None, loss_agg="token-mean")
    assert unclipped.item() == pytest.approx(0.5) and m[K.VF_CLIPFRAC].item() == 0.0


def test_explained_variance():
    mask = torch.tensor([[True, True, True, False]])
    returns = torch.tensor([[1.0, 2.0, 3.0, NAN]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    const = torch.full_like(returns, 2.0)
    assert explained_variance(const, returns, mask).item() == pytest.approx(0.0)


# --- entropy and log-probs -----------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 5])
def test_entropy_and_log_probs_equal_log_softmax_reference(chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 11, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    ids = torch.randint(0, 11, (3, 7), generator=g)
    logp_ref = torch.log_softmax(logits, -1)
    lp = token_log_probs(logits, ids, chunk_size=chunk)
    ent = entropy_from_logits(logits, chunk_size=chunk)
    assert torch.allclose(lp, logp_ref.gather(-1, ids.unsqueeze(-1)).squeeze(-1))
    ent_ref = -(logp_ref.exp() * logp_ref).sum(-1)
    assert torch.allclose(ent, ent_ref)
    g1 = torch.autograd.grad((lp.sum() + ent.sum()), logits)[0]
    ref_total = logp_ref.gather(-1, ids.unsqueeze(-1)).sum() + ent_ref.sum()
    g2 = torch.autograd.grad(ref_total, logits)[0]
    assert torch.allclose(g1, g2)
    with pytest.raises(ValueError, match="ids has shape"):
        token_log_probs(logits, ids[:, :3])


# --- presets and registries ----------------------------------------------------------------------
def test_presets_match_the_design_table():
    table = {  # preset: (ratio, correction, advantage, critic) — docs/design.md §2
        "ppo": ("token", "none", "gae", True), "turn_ppo": ("turn", "none", "gae", True),
        "s_ppo": ("token", "clip_bias_norm", "gae", True),
        "st_ppo": ("turn", "clip_bias_norm", "gae", True),
        "so_ppo": ("turn", "clip_triggered", "gae", True), "grpo": ("token", "none", "grpo", False),
        "gspo": ("sequence", "none", "grpo", False),
        "so_grpo": ("turn", "clip_triggered", "grpo", False),
    }
    assert list(PRESETS)[:len(table)] == list(table)  # then the baselines (test_algos_baselines)
    for name, row in table.items():
        p = PRESETS[name]
        assert (p.ratio_level, p.clip_bias, p.advantage, p.use_critic) == row
        assert p.loss_agg == "seq-mean-token-mean"
        assert (p.tau is None) == (p.clip_bias == "none")
        assert (p.spec().clip_bias is None) == (p.clip_bias == "none")
    assert PRESETS["st_ppo"].tau == 0.5 and PRESETS["so_grpo"].tau == 2.0
    with pytest.raises(AttributeError, match="immutable"):
        PRESETS["ppo"].ratio_level = "turn"
    # a preset is a partial LossSpec: the fields it fixes, nothing it does not
    assert dict(PRESETS["ppo"].fixes) == {} and PRESETS["ppo"].spec() == LossSpec("ppo")
    assert dict(PRESETS["st_ppo"].fixes) == {"ratio_level": "turn", "clip_bias": "clip_bias_norm"}


def test_presets_registry_errors():
    with pytest.raises(ValueError, match="'ppo' is already registered"):
        register_preset(Preset("ppo"))
    with pytest.raises(ValueError, match="valid: ppo, turn_ppo, s_ppo, st_ppo, so_ppo, grpo"):
        PRESETS["nope"]
    with pytest.raises(ValueError, match="ratio_level='word' is not valid; allowed: token"):
        Preset("x", ratio_level="word")
    with pytest.raises(ValueError, match="preset 'x': ratio is not a LossSpec field; valid: "):
        Preset("x", ratio="turn")
    with pytest.raises(TypeError):
        Preset("x", "turn")  # fields by name only


def test_registry_behaves_like_a_read_only_dict():
    reg = Registry("thing")

    @reg.register("a")
    def a():
        return 1

    assert reg["a"] is a and "a" in reg and "b" not in reg and len(reg) == 1
    assert reg.get("b") is None
    with pytest.raises(UnknownNameError) as e:
        reg["b"]
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    assert str(e.value) == "unknown thing 'b'; valid: a"
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_every_preset_is_defined_once():
    """conf/algo/<name>.yaml names its preset and nothing else: the fields live in PRESETS only,
    so a preset cannot be defined twice (a field in a conf file fails here)."""
    from omegaconf import OmegaConf

    from stppo.config import CONF_DIR

    from stppo.algos.presets import BUILT_IN

    files = sorted((CONF_DIR / "algo").glob("*.yaml"))
    assert sorted(f.stem for f in files) == sorted(BUILT_IN) and set(BUILT_IN) <= set(PRESETS)
    for f in files:
        assert OmegaConf.to_container(OmegaConf.load(f)) == {"name": f.stem}, f.name
