"""The KL-matched control (analysis.kl_control): a stabiliser is paired with the plain preset's
learning-rate rung of the nearest per-step KL, which tells "more stable" from "moves less"."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.kl_control import kl_matched_table


def _runs() -> pd.DataFrame:
    """ppo at lr 1e-4 / 3e-4 / 1e-3 with step KL 0.001 / 0.004 / 0.02 (4 seeds each; the top
    rung collapses in 3 of 4, the others never); `slow` at lr 1e-3 moves like ppo at 3e-4 (KL
    0.0035) and never collapses — it only moves less; `stable` at 1e-3 moves like ppo at 1e-3
    (KL 0.018) and never collapses — stabilised; `tiny` (KL 1e-5) is below the ladder."""
    rows = []
    for lr, kl, collapsed in ((1e-4, 0.001, 0), (3e-4, 0.004, 0), (1e-3, 0.02, 3)):
        rows += [dict(algo="ppo", lr=lr, mean_step_kl=kl, collapsed=s < collapsed) for s in range(4)]
    for algo, kl in (("slow", 0.0035), ("stable", 0.018), ("tiny", 1e-5)):
        rows += [dict(algo=algo, lr=1e-3, mean_step_kl=kl, collapsed=False) for _ in range(4)]
    out = pd.DataFrame(rows)
    out["experiment"] = "study"
    out["unit"] = [f"u{i}" for i in range(len(out))]
    out["final_success"] = (~out["collapsed"]).astype(float) * 0.8
    out["val_auc"] = out["final_success"] / 2
    return out


def test_each_stabiliser_meets_the_rung_of_its_step_kl():
    t = kl_matched_table(_runs(), ["slow", "stable", "tiny"]).set_index("stabiliser")
    assert t.loc["slow", "matched_lr"] == 3e-4 and t.loc["stable", "matched_lr"] == 1e-3
    assert t.loc["slow", "matched"] and t.loc["stable", "matched"]
    assert t.loc["slow", "log_kl_ratio"] == pytest.approx(math.log(0.004 / 0.0035))
    # both beat ppo at their own lr (3/4 collapsed) …
    assert (t.loc["slow", "collapsed_same_lr"], t.loc["stable", "collapsed_same_lr"]) == ("3/4", "3/4")
    # … but only `stable` beats the KL-matched ppo: `slow` only moves less
    assert (t.loc["slow", "collapsed_x"], t.loc["slow", "collapsed_matched"]) == ("0/4", "0/4")
    assert (t.loc["stable", "collapsed_x"], t.loc["stable", "collapsed_matched"]) == ("0/4", "3/4")


def test_a_step_kl_beyond_the_ladder_is_not_matched():
    t = kl_matched_table(_runs(), ["tiny"]).set_index("stabiliser")
    assert not t.loc["tiny", "matched"] and t.loc["tiny", "matched_lr"] == 1e-4  # 100× apart
