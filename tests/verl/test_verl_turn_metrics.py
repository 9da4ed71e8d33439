"""The per-turn breakdown of stppo's verl losses and the monitor's copies, through verl's own
`ppo_loss`: what the run ends up with under stppo's names is the own trainer's breakdown
(`stppo.algos.breakdown.turn_breakdown`) of the mini-batch, and every key any preset's loss
returns reaches stppo's name in a verl run."""

from __future__ import annotations

import pytest
import torch
from verl_batch import floats, make_batch, run_ppo_loss

from stppo import metric_names as K
from stppo.algos import LOSS_MODES, PRESETS, turn_breakdown
from stppo.algos.ratios import importance_ratio
from stppo.algos.segments import turn_ids_from_mask
from stppo.algos.surrogate import clipped_surrogate
from stppo.integrations.verl.metrics import LOSS_COPIES, TURN_WEIGHTED, copy_values, namespace_copies, turn_copies

TURNS = 4
MEANS = ("pg_clipfrac", "ratio_mean", "adv_mean", "ppo_kl", "tokens")  # token means (and tokens per row)


def own_breakdown(b, preset: str, dual_clip: float = 3.0) -> dict[str, float]:
    """The own trainer's per-turn metrics of batch `b` (stppo.train.update: κ at the preset's
    ratio level with its clip ranges and the dual clip)."""
    p, mask = PRESETS[preset], b.mask
    turns = turn_ids_from_mask(mask)
    ratio, _ = importance_ratio(b.log_prob, b.old_log_probs, mask, turns, p.ratio_level)
    adv = torch.where(mask, b.advantages, 0.0)
    clipped = clipped_surrogate(ratio, adv, 0.2, 0.2, dual_clip).clipped
    out = turn_breakdown(ratio, b.log_prob, b.old_log_probs, adv, torch.zeros_like(ratio), clipped, mask,
                         turns, TURNS)
    return {k: float(v) for k, v in out.items() if not k.endswith("/entropy")}


def as_run(metrics: list[dict]) -> dict[str, float]:
    """verl's mean over micro-batches, prefixed as its trainer logs actor metrics, then the monitor."""
    from verl.utils.py_functional import rename_dict

    keys = metrics[0].keys()
    assert all(m.keys() == keys for m in metrics)  # every micro-batch returns every key
    mean = {k: sum(floats(m)[k] for m in metrics) / len(metrics) for k in keys}
    return copy_values(turn_copies(TURNS), rename_dict(mean, "actor/"))


@pytest.mark.parametrize("preset", ["ppo", "st_ppo", "gspo"])
def test_one_micro_batch_gives_the_own_breakdown(actor_config, preset):
    b = make_batch(seed=5)
    _, metrics, _ = run_ppo_loss(actor_config(f"stppo_{preset}", max_turns=TURNS), b, micro=len(b.prompts))
    got, want = as_run(metrics), own_breakdown(b, preset)
    assert set(got) == set(want) and K.turn_key(3, "tokens") in want
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-10, abs=1e-12), k


def test_equal_micro_batches_average_to_the_mini_batchs_token_means(actor_config):
    """Two micro-batches, one of which lacks the last turn: each returns every key (verl's
    data-parallel aggregation needs that), and the weighted means divide back to the turn's token
    mean over the mini-batch; `ratio_max` becomes the token-weighted mean of micro-batch maxima."""
    b = make_batch(n=8, seed=0)
    _, metrics, _ = run_ppo_loss(actor_config("stppo_ppo", max_turns=TURNS), b, micro=4)
    halves = [floats(m) for m in metrics]
    assert {h[K.turn_key(3, "tokens")] == 0 for h in halves} == {True, False}  # k3 in one half only
    got, want = as_run(metrics), own_breakdown(b, "ppo")
    for k, v in want.items():
        if K.parse_turn_key(k)[1] in MEANS:
            assert got[k] == pytest.approx(v, rel=1e-10, abs=1e-12), k
    w = [h[K.turn_key(0, "tokens")] for h in halves]
    maxima = [h[K.turn_key(0, "ratio_max")] / wi for h, wi in zip(halves, w)]
    assert got[K.turn_key(0, "ratio_max")] == pytest.approx(sum(m * wi for m, wi in zip(maxima, w)) / sum(w))


@pytest.mark.parametrize("preset", [n for n, p in PRESETS.items() if not LOSS_MODES[p.loss_mode].segments])
def test_every_key_a_loss_returns_reaches_stppos_name_in_a_verl_run(actor_config, preset):
    """As verl's trainer logs them (`rename_dict(metrics, "actor/")`), a loss's keys are either
    `actor/` keys (the same in the run) or reach their own name through the monitor's copies."""
    from verl.utils.py_functional import rename_dict

    b = make_batch(seed=2)
    torch.manual_seed(0)
    _, metrics, _ = run_ppo_loss(actor_config(f"stppo_{preset}", max_turns=TURNS), b, micro=len(b.prompts))
    returned = floats(metrics[0])
    logged = rename_dict(returned, "actor/")
    namespace = LOSS_MODES[PRESETS[preset].loss_mode].namespace  # a plugin mode's own metrics
    run = {**{k: v for k, v in logged.items() if k.startswith("actor/")},
           **copy_values((*LOSS_COPIES, *turn_copies(TURNS), *namespace_copies(namespace, logged)), logged)}
    own = f"{namespace}/"
    for k, v in returned.items():
        turn = K.parse_turn_key(k)
        assert K.known_metric(k) or k.startswith(own), k
        if turn is None or turn[1] == "tokens":
            assert run[k] == v, k
        elif returned[K.turn_key(turn[0], "tokens")] > 0:
            assert turn[1] in TURN_WEIGHTED and run[k] == pytest.approx(v / returned[K.turn_key(turn[0], "tokens")])
        else:
            assert k not in run  # a turn no row reached: no value, as the own trainer
    assert K.CLIP_BIAS_NORM in run and run[K.CLIP_BIAS_NORM] == logged["actor/clip_bias/norm"]
