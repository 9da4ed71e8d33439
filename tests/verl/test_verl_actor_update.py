"""verl's own training step with stppo's losses: `ActorRolloutRefWorker(role="actor")` built from
verl's `ppo_trainer` config and stppo's translated overrides runs `init_model`, `compute_log_prob`
and `update_actor` — verl's FSDP2 engine, its sequence packing, micro-batching and `ppo_loss`
calling the `stppo_<preset>` loss that `import verl` registered — on a multi-turn batch
(`actor_update.py`). Checked: the packed log-probs equal a plain transformers forward over the
padded batch; every weight tensor moves; `stppo_ppo` equals verl's `vanilla` through the same
update; stppo's metrics come out under the names the run monitor maps.

CPU (CI): one gloo rank with the test-only CPU platform (`cpu_platform.py`), float32, presets
CPU_PRESETS. `STPPO_TEST_DEVICE=cuda` (scripts/gpu_check_verl.sh): one GPU, verl's default bf16
mixed precision, every paper preset, looser tolerances (bf16 forward), figures printed (-s).
"""

from __future__ import annotations

import math

import pytest
import torch
from actor_update import (CPU_PRESETS, DEVICE, PAPER_PRESETS, as_logged, build_worker, compute_log_prob,
                          init_process_group, make_batch, reference_log_probs, update_actor, verl_config,
                          weights)
from local_model import make_random_model

from stppo import metric_names as K
from stppo.integrations.verl.metrics import LOSS_COPIES, copy_values, turn_copies
from stppo.integrations.verl.overrides import per_turn_count

PRESETS = CPU_PRESETS if DEVICE == "cpu" else PAPER_PRESETS
# |log π − reference| on response tokens; stppo_ppo vs vanilla, relative (pg_loss, grad norm)
LOG_PROB_ATOL = 1e-4 if DEVICE == "cpu" else 5e-2
AGREE_RTOL = (1e-6, 1e-6) if DEVICE == "cpu" else (1e-4, 1e-2)
ROWS = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One process group, one model folder and one batch for every update of this module."""
    from transformers import AutoConfig

    init_process_group()
    model_dir = make_random_model(tmp_path_factory.mktemp("verl_actor_model"))
    hf = AutoConfig.from_pretrained(model_dir)
    b = make_batch(ROWS, hf.vocab_size, hf.pad_token_id, seed=0)
    ref = reference_log_probs(model_dir, b)  # (N, T)
    gen = torch.Generator().manual_seed(1)
    agent = b.response_mask.float()
    old = ref + 0.3 * torch.randn(ref.shape, generator=gen) * agent  # off-policy, so the clip binds
    adv = torch.randn(ref.shape, generator=gen) * agent
    return {"model": model_dir, "batch": b, "ref": ref, "old": old, "adv": adv}


def run(setup, preset: str, loss_mode: str | None = None, extra: tuple = ()) -> dict:
    """One fresh worker: its log-probs, an update from the shared batch, weights before and after."""
    verl_cfg, cfg = verl_config(preset, setup["model"], loss_mode, extra)
    worker = build_worker(verl_cfg)
    log_prob = compute_log_prob(worker, setup["batch"])
    before = weights(worker)
    rows = verl_cfg.actor_rollout_ref.actor.ppo_mini_batch_size * verl_cfg.actor_rollout_ref.rollout.n
    metrics, seconds = update_actor(worker, setup["batch"], setup["old"], setup["adv"], rows)
    return {"log_prob": log_prob, "before": before, "after": weights(worker), "metrics": metrics,
            "seconds": seconds, "cfg": cfg, "rows": rows}


@pytest.mark.parametrize("preset", PRESETS)
def test_verls_actor_update_trains_with_stppos_loss(setup, preset):
    r = run(setup, preset)
    b, cfg = setup["batch"], r["cfg"]
    assert r["rows"] == cfg.trainer.minibatch_size == ROWS // 2  # two optimizer steps
    real = b.response_attention.bool()  # every response token, observations included
    gap = (r["log_prob"] - setup["ref"])[real].abs()
    print(f"\nverl_actor_update: {preset:8s} {DEVICE}  update_actor {r['seconds']:.3f} s  "
          f"log-prob vs transformers max |d| {gap.max():.2e} mean {gap.mean():.2e}")
    assert gap.max() <= LOG_PROB_ATOL

    still = [n for n, w in r["before"].items() if torch.equal(w, r["after"][n])]
    assert not still, f"weights that did not move: {still}"
    assert all(torch.isfinite(w).all() for w in r["after"].values())

    logged = as_logged(r["metrics"])  # what verl's trainer logs of this update
    assert len(r["metrics"]["actor/pg_loss"]) == 2 and math.isfinite(logged["actor/grad_norm"])
    view = copy_values((*LOSS_COPIES, *turn_copies(per_turn_count(cfg))), logged)  # the run monitor
    assert {K.CLIP_BIAS_NORM, K.CLIP_BIAS_SCALE, K.turn_key(0, "tokens"), K.turn_key(0, "pg_clipfrac")} <= set(view)
    from_loss = {k for k in r["metrics"] if "/" in k and not k.startswith(("actor/", "perf/"))}  # not verl's own
    assert K.CLIP_BIAS_NORM in from_loss and all(K.known_metric(k) for k in from_loss)
    unmapped = {k for k in from_loss if k not in view}  # only turns no row reached
    assert all(logged[f"actor/{K.turn_key(K.parse_turn_key(k)[0], 'tokens')}"] == 0 for k in unmapped)
    assert 0 <= view[K.turn_key(0, "pg_clipfrac")] <= 1 and view[K.turn_key(0, "ratio_max")] > 0


def test_stppo_ppo_equals_verls_vanilla_inside_verls_update(setup):
    """The first mini-batch's loss, gradient norm and clip metrics: what the two losses compute
    from the same weights, before any optimizer step. (The second mini-batch follows one AdamW
    step, whose lr·m/√v turns the losses' rounding on a near-zero gradient into a step of ~lr:
    its numbers differ by the CPU's kernels, not by the losses.)"""
    ours, theirs = run(setup, "ppo"), run(setup, "ppo", loss_mode="vanilla")
    loss_rtol, grad_rtol = AGREE_RTOL
    for key, rtol in (("actor/pg_loss", loss_rtol), ("grad_norm", grad_rtol)):
        a, b = float(ours["metrics"][key][0]), float(theirs["metrics"][key][0])
        rel = abs(a - b) / abs(b)
        print(f"\nverl_actor_update: stppo_ppo vs vanilla {DEVICE}  {key} {a} vs {b}  rel diff {rel:.1e}")
        assert rel <= rtol, key
    for key in ("actor/pg_clipfrac", "actor/ppo_kl"):
        assert ours["metrics"][key][0] == pytest.approx(theirs["metrics"][key][0], rel=loss_rtol, abs=1e-7), key


def test_a_researchers_stabiliser_trains_inside_verls_update(setup):
    """The example plugin package (tests/plugin_example, installed by `make test`): found by its
    entry point with no search path, its loss registered as stppo_turn_drift in the
    worker from the spec stppo's launcher sends, its own metrics copied back by the monitor."""
    from stppo.integrations.verl.metrics import namespace_copies

    r = run(setup, "turn_drift")
    assert r["cfg"].algo.spec.loss_mode == "turn_drift" and r["cfg"].algo.plugin is None
    still = [n for n, w in r["before"].items() if torch.equal(w, r["after"][n])]
    assert not still, f"weights that did not move: {still}"
    logged = as_logged(r["metrics"])
    assert math.isfinite(logged["actor/grad_norm"]) and "actor/turn_drift/penalty" in logged
    view = copy_values(namespace_copies("turn_drift", logged), logged)
    assert set(view) == {"turn_drift/penalty", "turn_drift/turn_shift_max"}
    assert view["turn_drift/penalty"] > 0  # the old log-probs are off-policy: turns drifted
    stppo_view = copy_values(LOSS_COPIES, logged)  # stppo's stability metrics of the stabiliser
    assert K.CLIP_BIAS_NORM in stppo_view and K.PG_CLIPFRAC_HIGH in logged
