"""A researcher's stabiliser as a package of its own (`stppo.algos.plugins`, docs/extending.md),
with the example package tests/plugin_example (`turn_drift`, installed by `make test`): its preset
file found through Hydra's search path; its loss checked against a loop reference, for mask
invariance and by gradcheck with the project's test helpers; micro-batches equal to the whole
minibatch; a quick run that logs its metrics, stppo's stability metrics and the per-turn ones,
read by the analysis; an Optuna sweep over its option; and every contract violation one line and
exit 1 before any work. (torchrun: tests/test_distributed.py; verl: tests/verl.)"""

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
from test_algos_helpers import loop_agg, loop_ratio, loop_surrogate, make_inputs, with_garbage

ROOT = Path(__file__).resolve().parents[1]
SEARCH = "hydra.searchpath=[pkg://turn_drift.conf]"


def spec(*overrides: str) -> LossSpec:
    return to_config(compose([SEARCH, "algo=turn_drift", *overrides])).algo.spec


# --- the preset file ---------------------------------------------------------------------------
def test_the_preset_file_names_the_function_and_its_options():
    s = spec()
    assert (s.name, s.loss_mode, s.ratio_level, s.advantage, s.use_critic) == (
        "turn_drift", "turn_drift", "token", "grpo", False)
    assert dict(s.options) == {"beta": 0.1}  # the preset file's value
    assert spec("algo.loss_options.beta=0.7").options["beta"] == 0.7  # a run's override
    assert spec("algo.clip_high=0.3").clip_high == 0.3


# --- the loss against a loop reference (what docs/extending.md shows) ---------------------------
def loop_turn_drift(lp, old, adv, mask, turns, beta, agg="seq-mean-token-mean", clip=0.2):
    """turn_drift written token by token: agg(s) + β agg(d²), d the turn's mean log-ratio."""
    rho = loop_ratio(lp, old, mask, turns, "token")
    s, _, _ = loop_surrogate(rho, adv, mask, clip, clip)
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
def test_turn_drift_equals_its_loop_reference(agg):
    s = spec(f"algo.loss_agg={agg}", "algo.loss_options.beta=0.5")
    x = make_inputs(5, 24, seed=3, spread=0.5, dtype=torch.float64)
    got = call(x, s).loss
    want = loop_turn_drift(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                           x["turn_ids"], 0.5, agg)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_turn_drift_ignores_garbage_off_agent_tokens_and_passes_gradcheck():
    s = spec("algo.loss_options.beta=0.5")
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

    algo = to_config(compose([SEARCH, "algo=turn_drift", "algo.loss_options.beta=0.5"])).algo
    policy = tm._model()
    mb = tm._batch(policy)
    whole = tm._grads(policy, mb, tm._ctx(algo, 0))
    tm._assert_same(whole, tm._grads(policy, mb, tm._ctx(algo, 3)), "shares")
    monkeypatch.setattr(LossSpec, "separable", property(lambda self: False))
    tm._assert_same(whole, tm._grads(policy, mb, tm._ctx(algo, 3)), "linearised")


@pytest.mark.slow
def test_a_quick_run_logs_the_stabilisers_metrics(tiny_cfg, tmp_path):
    from analysis.load import load_study
    from stppo import metric_names as K
    from stppo.train.job import run

    run(tiny_cfg(SEARCH, "algo=turn_drift", "trainer.total_steps=2"))
    frame = load_study("stppo", f"sqlite:///{tmp_path}/mlflow.db", use_cache=False).metrics
    keys = set(frame["metric"].astype(str))
    assert {"turn_drift/penalty", "turn_drift/turn_shift_max", K.CLIP_BIAS_NORM, K.PG_CLIPFRAC,
            K.turn_key(0, "pg_clipfrac"), K.GRAD_NORM} <= keys
    pen = frame[frame["metric"] == "turn_drift/penalty"]["value"]
    assert len(pen) == 2 and all(math.isfinite(v) for v in pen)


# --- the contract: one line, exit 1, before any work ----------------------------------------------
BAD = {
    "broken": ("import does_not_exist_anywhere\n", "cannot be imported (ModuleNotFoundError"),
    "plain": ("def loss(x, spec):\n    return x.log_probs.sum(), {}\n",
              "is not a stabiliser: decorate it with"),
    "signature": ("from stppo.algos.plugins import stabiliser\n"
                  "def loss(x, spec, extra):\n    return 0, {}\n"
                  "loss.stppo_stabiliser = {}\n",
                  "must take exactly two arguments (inputs, spec), got (x, spec, extra)"),
}


def _package(tmp: Path, name: str, source: str, options: str = "") -> Path:
    """A module `mine_<name>` and a config folder with its preset file `algo/mine_<name>.yaml`."""
    (tmp / f"mine_{name}.py").write_text(source)
    conf = tmp / "conf" / "algo"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / f"mine_{name}.yaml").write_text(textwrap.dedent(f"""\
        name: mine_{name}
        loss: mine_{name}:loss
        advantage: grpo
        use_critic: false
        {options}"""))
    return tmp / "conf"


def _run(tmp: Path, conf: Path, name: str):
    env = {"PYTHONPATH": str(tmp), "PATH": "/usr/bin:/bin", "HOME": str(tmp)}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), f"hydra.searchpath=[file://{conf}]",
                           f"algo=mine_{name}", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                           f"trainer.out_dir={tmp}/runs"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp)


@pytest.mark.parametrize("name", list(BAD))
def test_a_broken_stabiliser_is_one_line_and_exit_1_before_any_work(tmp_path, name):
    source, message = BAD[name]
    out = _run(tmp_path, _package(tmp_path, name, source), name)
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("run.py: error: algo.loss=") and message in last, last
    assert "Traceback" not in out.stderr and not (tmp_path / "mlflow.db").exists()


def test_an_unknown_option_is_one_line_and_exit_1(tmp_path):
    source = ("from stppo.algos.plugins import stabiliser\n"
              "@stabiliser(options={'beta': 0.1})\n"
              "def loss(x, spec):\n    return x.log_probs.sum(), {}\n")
    out = _run(tmp_path, _package(tmp_path, "opt", source, "loss_options: {gamma: 0.3}\n"), "opt")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("run.py: error: algo: loss_mode='mine_opt' has no option(s) gamma; "
                    "valid: beta"), last
    assert not (tmp_path / "mlflow.db").exists()


def test_metrics_outside_the_namespace_are_rejected():
    from stppo.algos.plugins import register_stabiliser, stabiliser

    @stabiliser()
    def leaky(x, spec):
        return x.log_probs.sum(), {"entropy_bonus": x.log_probs.sum().detach()}

    sys.modules[__name__].leaky = leaky
    register_stabiliser("leaky", f"{__name__}:leaky")
    x = make_inputs(2, 6, seed=0)
    with pytest.raises(ValueError, match="returned metric.s. 'entropy_bonus': name its own metrics 'leaky/"):
        call(x, LossSpec(name="leaky", loss_mode="leaky", advantage="grpo", use_critic=False))
