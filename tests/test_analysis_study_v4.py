"""Study v4's tables (analysis.studies.study_v4): the levels read from the runs, the contrasts
D1–D8 with the area under the validation curve as a second outcome on a hand-made per-run table
with known counts (identical units once, the learning-rate ladder kept out of the contrasts, D4 from
the KL-matched control, Holm over the whole table), and the command on folders exported from a
real MLflow store of synthetic runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.contrasts import contrast_columns
from analysis.group_tests import holm
from analysis.stats import welch_test
from analysis.studies.study_v4 import LR, level_column, v4_contrasts


def test_levels_from_experiment_lag_and_correction():
    runs = pd.DataFrame({"experiment": ["testbed", "testbed_reuse", "testbed", "testbed", "testbed", "other"],
                         "lag": [0, 0, 2, 4, 2, 0],
                         "correction": ["none", "none", "bypass_ppo_clip", "bypass_ppo_clip", "none", "none"]})
    # a lag without the coupled form is no level of v4 (its decoupled form hides the staleness)
    assert level_column(runs).fillna("none").tolist() == ["on", "reuse", "lag2", "lag4", "none", "none"]


def test_a_point_named_like_a_column_takes_its_place():
    cols = contrast_columns("level", {"auc": "val_auc"})
    assert cols.count("level") == 1 and cols.index("level") == 1
    assert cols[cols.index("welch_p_holm") + 1:cols.index("shared_units")] == (
        "auc_a", "auc_b", "auc_diff", "auc_diff_low", "auc_diff_high", "auc_p", "auc_p_holm")
    assert contrast_columns("lag")[3] == "lag"  # v3's layout


def _cell(level, algo, n, k, *, model="tiny", lr=LR, auc=0.6, kl=1e-3, seed0=0):
    """n runs of one cell, the first k collapsed; final success 0.1 (collapsed) or 0.8 and val_auc
    `auc` − 0.2 (collapsed) or `auc`, each + 0.01·seed."""
    exp = "testbed_reuse" if level == "reuse" else "testbed"
    return [{"run_id": f"{model}-{level}-{algo}-{lr:g}-{s}", "experiment": exp, "machine": "cpu", "level": level,
             "model": model, "lr": lr, "algo": algo, "seed": s, "unit": f"{model}-{level}-{algo}-{lr:g}-{s}",
             "collapsed": s - seed0 < k, "final_success": (0.1 if s - seed0 < k else 0.8) + 0.01 * s,
             "val_auc": (auc - 0.2 if s - seed0 < k else auc) + 0.01 * s, "mean_step_kl": kl * (1 + 0.01 * s)}
            for s in range(seed0, seed0 + n)]


def _runs() -> pd.DataFrame:
    specs = [("reuse", "ppo", 5, 5, {"kl": 4e-3}), ("reuse", "turn_ppo", 5, 4, {}), ("reuse", "s_ppo", 5, 1, {}),
             ("reuse", "st_ppo", 5, 0, {"auc": 0.7, "kl": 1e-3}),
             ("reuse", "ppo", 5, 1, {"lr": 5e-5, "kl": 1.1e-3}), ("reuse", "ppo", 5, 3, {"lr": 1e-4, "kl": 2e-3}),
             ("lag2", "ppo", 5, 2, {}), ("lag2", "st_ppo", 5, 1, {}), ("on", "ppo", 5, 0, {}), ("on", "st_ppo", 5, 0, {}),
             ("on", "turn_ppo", 5, 0, {}), ("on", "s_ppo", 5, 0, {}),
             ("reuse", "grpo", 3, 3, {}), ("reuse", "grpo+decoupled_token_is", 3, 0, {}),
             ("reuse", "ppo", 3, 3, {"model": "small"}), ("reuse", "st_ppo", 3, 0, {"model": "small"})]
    rows = [r for level, algo, n, k, kw in specs for r in _cell(level, algo, n, k, **kw)]
    runs = pd.DataFrame(rows)
    # on-policy s_ppo's seeds 0 and 1 are the same training run as ppo's (one unit each)
    same = (runs["level"] == "on") & (runs["algo"] == "s_ppo") & (runs["seed"] < 2)
    runs.loc[same, "unit"] = runs.loc[same, "unit"].str.replace("s_ppo", "ppo")
    return runs


@pytest.fixture(scope="module")
def result():
    return v4_contrasts(_runs(), n_boot=2000)


def test_contrast_counts_units_once_and_keep_the_ladder_out(result):
    t = result.table.set_index(["contrast", "level", "a"])
    expected = {  # (contrast, level, a): (b, collapsed a, collapsed b)
        ("D1", "reuse", "s_ppo, st_ppo"): ("ppo, turn_ppo", "1/10", "9/10"),  # ppo at lr 5e-5/1e-4 not pooled
        ("D2", "reuse", "turn_ppo, st_ppo"): ("ppo, s_ppo", "4/10", "6/10"),
        ("D3", "reuse", "st_ppo"): ("ppo", "0/5", "5/5"),
        ("D3", "lag2", "st_ppo"): ("ppo", "1/5", "2/5"),
        ("D3", "on", "st_ppo"): ("ppo", "0/5", "0/5"),
        ("D6", "reuse", "grpo+decoupled_token_is"): ("grpo", "0/3", "3/3"),
        ("D8", "reuse", "small st_ppo"): ("tiny st_ppo", "0/3", "0/5"),
    }
    for key, (b, ka, kb) in expected.items():
        row = t.loc[key]
        assert (row["b"], row["collapsed_a"], row["collapsed_b"]) == (b, ka, kb), key
    d5 = t.loc[("D5", "on", "s_ppo")]
    assert d5["collapsed_a"] == "0/3" and d5["shared_units"] == 2  # the two shared units are in neither group
    lines = "\n".join(result.missing)
    assert "D1 s_ppo, st_ppo vs ppo, turn_ppo: not computed at level lag4" in lines
    assert "D7 critic-free vs critic: not computed at level lag4: no runs of critic-free at level lag4; critic" in lines


def test_the_area_under_the_validation_curve_is_a_second_outcome(result):
    row = result.table.set_index(["contrast", "level", "a"]).loc[("D3", "reuse", "st_ppo")]
    st = [0.7 + 0.01 * s for s in range(5)]
    ppo = [0.4 + 0.01 * s for s in range(5)]  # every seed collapsed: auc − 0.2
    assert row["auc_a"] == pytest.approx(np.mean(st)) and row["auc_b"] == pytest.approx(np.mean(ppo))
    assert row["auc_diff"] == pytest.approx(0.3)
    assert row["auc_diff_low"] <= 0.3 <= row["auc_diff_high"]
    assert row["auc_p"] == pytest.approx(welch_test(st, ppo)["p"])


def test_d4_pairs_st_ppo_with_the_rung_of_nearest_step_kl_and_holm_covers_it(result):
    t = result.table
    d4 = t[t["contrast"] == "D4"]
    assert len(d4) == 1
    r = d4.iloc[0]
    # st_ppo's step KL ≈ 1.02e-3: the nearest rung is ppo at 5e-5 (1.1e-3), one collapse of 5
    assert r["b"].startswith("ppo at lr 5e-05") and (r["collapsed_a"], r["collapsed_b"]) == ("0/5", "1/5")
    # the engine's row: a bootstrap interval around the area's difference, as every other row has
    assert r["level"] == "reuse" and r["auc_diff_low"] <= r["auc_diff"] <= r["auc_diff_high"]
    assert r["auc_diff_low"] < r["auc_diff_high"]
    assert t["contrast"].tolist().index("D4") > t["contrast"].tolist().index("D3")
    for p in ("fisher_p", "welch_p", "auc_p"):
        np.testing.assert_allclose(t[f"{p}_holm"], holm(t[p]), equal_nan=True)


def test_d4_says_when_the_ladder_does_not_reach_st_ppos_kl():
    runs = _runs()
    runs = runs[~((runs["algo"] == "ppo") & (runs["lr"] != LR))]  # no ladder: ppo at 4e-3 only, 4× st_ppo's
    res = v4_contrasts(runs, n_boot=200)
    assert "D4" not in set(res.table["contrast"])
    assert any(line.startswith("D4 (st_ppo vs ppo at the matched per-step KL") for line in res.missing)


def test_cli_on_exported_synthetic_runs(tmp_path, capsys, monkeypatch):
    from analysis import load_study
    from analysis.export import export_study
    from fixtures.stale_runs import StaleCell as C, write_stale_study
    from analysis.studies.study_v4 import main

    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    coupled = "bypass_ppo_clip"
    write_stale_study(uri, "testbed", (C("ppo", 0, 2, 0, actor_lr=LR), C("st_ppo", 0, 2, 0, actor_lr=LR),
                                       C("ppo", 2, 2, 2, correction=coupled, actor_lr=LR),
                                       C("st_ppo", 2, 2, 1, correction=coupled, actor_lr=LR),
                                       C("ppo", 2, 2, 2, actor_lr=LR)))  # decoupled: no level
    write_stale_study(uri, "testbed_reuse", (C("ppo", 0, 2, 2, actor_lr=LR), C("st_ppo", 0, 2, 0, actor_lr=LR)))
    write_stale_study(uri, "study_v4_pilot", (C("ppo", 0, 1, 1, actor_lr=LR),))
    for name in ("testbed", "testbed_reuse", "study_v4_pilot"):
        export_study(load_study([name], uri), tmp_path / "data" / name)
    out = tmp_path / "out"
    assert main(["--data", *map(str, sorted((tmp_path / "data").iterdir())), "--out", str(out),
                 "--n-boot", "200"]) == 0
    said = capsys.readouterr().out
    assert "tiny lag2: 4; tiny on: 4; tiny reuse: 4 (pilot 1; left out: 0 unfinished, 0 repeats, 2 of no level)" in said
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs["algo"]) == {"ppo", "st_ppo"} and len(runs) == 12
    assert set(runs["host"]) == {"cpu (not recorded)"}  # the fixture's runs carry no host tag
    assert runs["clip_bias_triggered"].isna().all()  # nor a clipping-bias scale
    con = pd.read_csv(out / "contrasts.csv").set_index(["contrast", "level", "a"])
    assert con.loc[("D3", "lag2", "st_ppo"), ["collapsed_a", "collapsed_b"]].tolist() == ["1/2", "2/2"]
    assert con.loc[("D3", "reuse", "st_ppo"), ["collapsed_a", "collapsed_b"]].tolist() == ["0/2", "2/2"]
    md = (out / "contrasts.md").read_text()
    assert "### D3: st_ppo vs ppo (every level)" in md and "| auc |" in md
    hazard = pd.read_csv(out / "hazard.csv")
    by_preset = hazard[hazard["validation"] == "by preset"]
    # 10 units: on-policy ppo and st_ppo never collapse and log the same outcome series (one unit per seed)
    assert set(by_preset["model"]) == {"hazard", "best single", "config only"} and (by_preset["runs"] == 10).all()
    assert len(pd.read_csv(out / "merged_units.csv")) == 2
    # seeds 0 and 1 only: the seed split has nothing to hold out
    assert hazard.loc[hazard["validation"] == "seeds 0–2 → 3–4", "model"].str.startswith("not computed").all()
    for name in ("cells.csv", "merged_units.csv", "kl_control.csv", "not_computed.txt", "hazard_compare.csv",
                 "outcomes.png"):
        assert (out / name).exists()
    # these synthetic runs log no live checks, and have no learning-rate ladder: nothing to draw
    assert not (out / "live_curves.png").exists() and not (out / "kl_control.png").exists()
    cells = pd.read_csv(out / "cells.csv")
    assert (cells["val_auc_low"] <= cells["val_auc"]).all() and (cells["val_auc"] <= cells["val_auc_high"]).all()
    tables = (out / "cells.md").read_text()
    assert tables.index("#### tiny, on") < tables.index("#### tiny, reuse") < tables.index("#### tiny, lag2")
    reuse_ppo = cells[(cells["level"] == "reuse") & (cells["algo"] == "ppo")].iloc[0]
    assert f"| ppo | 0.0002 | 2 | 2/2 [{reuse_ppo['collapse_p_low']:.2f}, 1.00] |" in tables
    assert main(["--data", str(tmp_path / "data" / "study_v4_pilot"), "--out", str(out)]) == 2
    assert "no run of study v4's levels" in capsys.readouterr().err


def test_kl_control_figure_draws_the_ladder_and_the_stabilisers_each_unit_once():
    from analysis.studies.study_v4 import KL_STABILISERS
    from analysis.studies.study_v4_figures import fig_kl_control

    runs = _runs()
    fig = fig_kl_control(runs, lr=LR, stabilisers=KL_STABILISERS)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["ppo, lr 5e-05", "ppo, lr 0.0001", "ppo, lr 0.0002",
                      *(f"{a}, lr 0.0002" for a in KL_STABILISERS)]
    # per series: the finite points (kept and collapsed, hollow) and the mean: 5 runs each
    offsets = [len(c.get_offsets()) for c in fig.axes[0].collections]
    assert sum(offsets) == 6 * (5 + 1)
    assert fig_kl_control(runs[runs["lr"] == LR], lr=LR, stabilisers=KL_STABILISERS) is None
    # a rung above the study's rate: the stabilisers are still drawn at the study's rate
    higher = runs[(runs["algo"] == "ppo") & (runs["lr"] == LR) & (runs["level"] == "reuse")].assign(
        lr=4e-4, unit=lambda r: r["unit"] + "-4e-4")
    labels = fig_kl_control(pd.concat([runs, higher]), lr=LR, stabilisers=KL_STABILISERS).axes[0] \
        .get_legend_handles_labels()[1]
    assert labels[-3:] == [f"{a}, lr 0.0002" for a in KL_STABILISERS]


def test_live_curves_take_each_unit_once_under_its_v4_label():
    from types import SimpleNamespace

    from analysis.studies.study_v4 import LEVELS
    from analysis.studies.study_v4_figures import LIVE, fig_live_curves, live_frame

    runs = pd.DataFrame({"run_id": ["a", "b", "c", "d"], "unit": ["a", "a", "c", "d"],
                         "algo": ["ppo", "ppo", "st_ppo", "grpo+decoupled_token_is"],
                         "level": ["lag2", "lag2", "lag2", "reuse"], "model": "tiny", "lr": [LR, LR, LR, 1e-4]})
    # the store's algo tag of a coupled run is its preset label with the correction
    tags = {"a": "ppo+bypass_ppo_clip", "b": "ppo+bypass_ppo_clip", "c": "st_ppo+bypass_ppo_clip",
            "d": "grpo+decoupled_token_is"}
    metrics = pd.DataFrame([{"run_id": r, "algo": tags[r], "model": "tiny", "task": "testbed", "metric": m,
                             "step": t, "value": 0.5} for r in "abcd" for m in (LIVE, "other") for t in (0, 5)])
    m = live_frame(SimpleNamespace(metrics=metrics), runs, model="tiny", lr=LR)
    assert sorted(set(zip(m["run_id"], m["algo"], m["level"]))) == [("a", "ppo", "lag2"), ("c", "st_ppo", "lag2")]
    assert len(m) == 4 and set(m["metric"]) == {LIVE}
    fig = fig_live_curves(SimpleNamespace(metrics=metrics), runs, levels=LEVELS, lr=LR)
    assert [ax.get_title() for ax in fig.axes] == [f"lag2: live success (tiny, lr {LR:g})"]


def test_host_is_the_runs_tag_or_not_recorded():
    from types import SimpleNamespace

    from analysis.studies.study_v4 import NOT_RECORDED, host_column

    study = SimpleNamespace(runs=pd.DataFrame({"run_id": ["a", "b", "c"], "host": ["cpu:AVX2", "", None]}))
    assert host_column(study, pd.Series(["c", "a", "b"])).tolist() == [NOT_RECORDED, "cpu:AVX2", NOT_RECORDED]
    older = SimpleNamespace(runs=pd.DataFrame({"run_id": ["a"]}))  # exported before the tag existed
    assert host_column(older, pd.Series(["a"])).tolist() == [NOT_RECORDED]
