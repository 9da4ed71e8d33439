"""A researcher's stabiliser as a package of its own (`stppo.plugins`, docs/extending.md), with
the example package tests/plugin_example (`turn_drift`, installed by `make test`): found by its
entry point with no search path; its loss checked against a loop reference (with and without the
dual clip), for mask invariance and by gradcheck with the project's test helpers; micro-batches
equal to the whole minibatch; quick runs of both its presets (one with the dual clip) that log its
metrics, stppo's stability metrics and the per-turn ones, read by the analysis; an Optuna sweep
over its option (test_sweeps); a plain folder on Hydra's search path; and every contract
violation one line and exit 1 before any work. (torchrun: tests/test_distributed.py; verl:
tests/verl.)"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stppo.algos import LossSpec, policy_loss
from stppo.config import compose, to_config
from helpers.algos import loop_agg, loop_ratio, loop_surrogate, make_inputs, with_garbage

ROOT = Path(__file__).resolve().parents[1]


def spec(*overrides: str, preset: str = "turn_drift") -> LossSpec:
    return to_config(compose([f"algo={preset}", *overrides])).algo.spec


# --- found by its entry point: the preset rows and files ------------------------------------------
def test_the_entry_point_registers_both_presets_with_no_search_path():
    from stppo.plugins import load_plugins

    assert "turn_drift" in load_plugins()
    s = spec()
    assert (s.name, s.loss_mode, s.ratio_level, s.advantage, s.use_critic, s.dual_clip) == (
        "turn_drift", "turn_drift", "token", "grpo", False, None)
    assert dict(s.options) == {"beta": 0.1}  # the preset row's value
    assert spec(preset="turn_drift_strong").options == {"beta": 0.5}  # a second preset of the mode
    assert spec("+algo.loss_options.beta=0.7").options["beta"] == 0.7  # a run's override
    assert spec("algo.clip_high=0.3").clip_high == 0.3
    assert spec("algo.dual_clip=3.0").dual_clip == 3.0  # the mode declares dual_clip=True


def test_a_mode_without_the_dual_clip_rejects_it_in_one_line():
    with pytest.raises(ValueError, match=r"^algo: loss_mode='cispo' has no dual clip; set dual_clip to null$"):
        spec("algo.dual_clip=3.0", preset="cispo")


# --- the loss against a loop reference (what docs/extending.md shows) ---------------------------
def loop_turn_drift(lp, old, adv, mask, turns, beta, agg="seq-mean-token-mean", clip=0.2, dual=None):
    """turn_drift written token by token: agg(s) + β agg(d²), d the turn's mean log-ratio; s with
    the dual clip min(s, −c·A) on A < 0 when `dual` = c."""
    rho = loop_ratio(lp, old, mask, turns, "token")
    s, _, _ = loop_surrogate(rho, adv, mask, clip, clip)
    if dual is not None:
        for i in range(lp.shape[0]):
            for t in range(lp.shape[1]):
                if mask[i, t] and adv[i, t] < 0:
                    s[i, t] = min(s[i, t], -dual * adv[i, t])
    d = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for k in set(turns[i][mask[i]].tolist()):
            at = mask[i] & (turns[i] == k)
            d[i, at] = (lp[i, at] - old[i, at]).mean()
    return loop_agg(s, mask, agg) + beta * loop_agg(d * d, mask, agg)


def call(x, s, lp=None):
    return policy_loss(x["log_probs"] if lp is None else lp, x["old_log_probs"], x["advantages"],
                       x["loss_mask"], x["turn_ids"], s)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual", [None, 1.5])
def test_turn_drift_equals_its_loop_reference(agg, dual):
    s = spec(f"algo.loss_agg={agg}", "+algo.loss_options.beta=0.5", f"algo.dual_clip={dual or 'null'}")
    x = make_inputs(5, 24, seed=3, spread=1.5, dtype=torch.float64)  # wide: the dual clip binds
    got = call(x, s).loss
    want = loop_turn_drift(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                           x["turn_ids"], 0.5, agg, dual=dual)
    # float64 sums of a few hundred O(1) terms, reordered: far inside 1e-12 relative
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    if dual is not None:  # the dual clip changes the loss on these inputs (the test can fail)
        plain = call(x, spec(f"algo.loss_agg={agg}", "+algo.loss_options.beta=0.5")).loss
        assert float(plain) != pytest.approx(float(got), rel=1e-6)


def test_turn_drift_ignores_garbage_off_agent_tokens_and_passes_gradcheck():
    s = spec("+algo.loss_options.beta=0.5")
    x = make_inputs(4, 20, seed=4, spread=0.5, dtype=torch.float64)
    dirty = {**x, **{k: with_garbage(x[k], x["loss_mask"]) for k in ("log_probs", "old_log_probs",
                                                                       "advantages")}}
    assert float(call(dirty, s).loss) == float(call(x, s).loss)
    lp = x["log_probs"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: call(x, s, v).loss, (lp,))


# --- the trainer -------------------------------------------------------------------------------
def test_micro_batches_equal_the_whole_minibatch_both_ways(monkeypatch):
    """separable=True (each part backwards its share) and, forced off, the chain rule through the
    minibatch's log-probs: the same gradient and metrics as the whole minibatch."""
    import test_microbatch as tm
    from helpers.updates import tiny_policy, update_batch

    algo = to_config(compose(["algo=turn_drift", "+algo.loss_options.beta=0.5", "algo.dual_clip=2.0"])).algo
    policy = tiny_policy()
    mb = update_batch(policy)
    whole = tm._grads(policy, mb, tm._ctx(algo, 0))
    tm._assert_same(whole, tm._grads(policy, mb, tm._ctx(algo, 3)), "shares")
    monkeypatch.setattr(LossSpec, "separable", property(lambda self: False))
    tm._assert_same(whole, tm._grads(policy, mb, tm._ctx(algo, 3)), "linearised")


@pytest.mark.slow
@pytest.mark.parametrize("preset", [("algo=turn_drift",), ("algo=turn_drift_strong", "algo.dual_clip=3.0")],
                         ids=["turn_drift", "turn_drift_strong-dual_clip"])
def test_a_quick_run_logs_the_stabilisers_metrics(tiny_cfg, tmp_path, preset):
    """Both presets of the mode log under its one namespace; the second with the dual clip."""
    from analysis.load import load_study
    from stppo import metric_names as K
    from stppo.train.job import run

    run(tiny_cfg(*preset, "trainer.total_steps=2"))
    frame = load_study("stppo", f"sqlite:///{tmp_path}/mlflow.db", use_cache=False).metrics
    keys = set(frame["metric"].astype(str))
    assert {"turn_drift/penalty", "turn_drift/turn_shift_max", K.CLIP_BIAS_NORM, K.PG_CLIPFRAC,
            K.turn_key(0, "pg_clipfrac"), K.GRAD_NORM} <= keys
    pen = frame[frame["metric"] == "turn_drift/penalty"]["value"]
    assert len(pen) == 2 and all(math.isfinite(v) for v in pen)


# --- a plain folder (not installed): Hydra's search path and `plugin:` ------------------------------
GOOD = """from stppo.algos import Preset, agg_loss, importance_ratio, loss_mode, register_preset


@loss_mode(options={"scale": 1.0}, namespace="mine")
def mine_good(x, spec):
    ratio, _ = importance_ratio(x.log_probs, x.old_log_probs, x.loss_mask, x.turn_ids, "token")
    loss = agg_loss(-ratio * x.advantages * spec.options["scale"], x.loss_mask, spec.loss_agg, x.global_denoms)
    return loss, {"mine/ratio_mean": ratio[x.loss_mask].mean().detach()}


register_preset(Preset("mine_good", loss_mode="mine_good", advantage="grpo", use_critic=False))
"""

# --- the contract: one line, exit 1, before any work ----------------------------------------------
BAD = {
    "broken": ("import does_not_exist_anywhere\n",
               "algo.plugin='mine_broken': module 'mine_broken' cannot be imported (ModuleNotFoundError"),
    "signature": ("from stppo.algos import loss_mode\n"
                  "@loss_mode()\ndef loss(x, spec, extra):\n    return 0, {}\n",
                  "cannot be imported (ValueError: loss mode mine_signature:loss must take exactly two "
                  "arguments (inputs, spec), got (x, spec, extra))"),
    "unregistered": ("from stppo.algos import Preset, register_preset\n"
                     "register_preset(Preset('mine_unregistered', loss_mode='nowhere'))\n",
                     "preset 'mine_unregistered': algo.loss_mode='nowhere' is not valid; allowed: "),
    "no_preset": ("X = 1\n", "algo.name='mine_no_preset' is not valid; allowed: "),
}


def _package(tmp: Path, name: str, source: str, options: str = "") -> Path:
    """A module `mine_<name>` and a config folder with its preset file `algo/mine_<name>.yaml`."""
    (tmp / f"mine_{name}.py").write_text(source)
    conf = tmp / "conf" / "algo"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / f"mine_{name}.yaml").write_text(textwrap.dedent(f"""\
        name: mine_{name}
        plugin: mine_{name}
        {options}"""))
    return tmp / "conf"


def _run(tmp: Path, conf: Path, name: str, *extra: str):
    env = {"PYTHONPATH": str(tmp), "PATH": "/usr/bin:/bin", "HOME": str(tmp)}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), f"hydra.searchpath=[file://{conf}]",
                           f"algo=mine_{name}", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                           f"trainer.out_dir={tmp}/runs", *extra],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp)


def test_a_plain_folder_plugin_composes_from_the_search_path(tmp_path):
    conf = _package(tmp_path, "good", GOOD)
    out = _run(tmp_path, conf, "good", "--cfg", "job", "--resolve")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name: mine_good" in out.stdout and "plugin: mine_good" in out.stdout
    sys.path.insert(0, str(tmp_path))
    try:
        s = to_config(compose([f"hydra.searchpath=[file://{conf}]", "algo=mine_good"])).algo.spec
    finally:
        sys.path.remove(str(tmp_path))
    assert (s.loss_mode, dict(s.options)) == ("mine_good", {"scale": 1.0})
    x = make_inputs(3, 10, seed=1)
    loss, m = call(x, s)
    assert torch.isfinite(loss) and "mine/ratio_mean" in m


@pytest.mark.parametrize("name", list(BAD))
def test_a_broken_stabiliser_is_one_line_and_exit_1_before_any_work(tmp_path, name):
    source, message = BAD[name]
    out = _run(tmp_path, _package(tmp_path, name, source), name)
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("run.py: error: ") and message in last, last
    assert "Traceback" not in out.stderr and not (tmp_path / "mlflow.db").exists()


def test_an_installed_plugin_that_fails_to_import_is_one_line(monkeypatch):
    import stppo.plugins as plugins

    monkeypatch.setattr(plugins, "_entry_points", lambda: (("ghost", "ghost_package_not_there"),))
    with pytest.raises(plugins.PluginError, match=r"^stppo plugin 'ghost' \(entry point group stppo.plugins\): "
                                                  r"module 'ghost_package_not_there' cannot be imported"):
        plugins.load_plugins()


def test_an_unknown_option_is_one_line_and_exit_1(tmp_path):
    out = _run(tmp_path, _package(tmp_path, "opt", GOOD.replace("mine_good", "mine_opt"),
                                  "loss_options: {gamma: 0.3}\n"), "opt")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("run.py: error: algo: loss_mode='mine_opt' has no option(s) gamma; "
                    "valid: scale"), last
    assert not (tmp_path / "mlflow.db").exists()


def test_metrics_outside_the_namespace_are_rejected():
    from stppo.algos import loss_mode

    @loss_mode("leaky_mode", namespace="leaky")
    def leaky(x, spec):
        return x.log_probs.sum(), {"entropy_bonus": x.log_probs.sum().detach()}

    x = make_inputs(2, 6, seed=0)
    with pytest.raises(ValueError, match="returned metric.s. 'entropy_bonus': name its own metrics 'leaky/"):
        call(x, LossSpec(name="leaky", loss_mode="leaky_mode", advantage="grpo", use_critic=False))
