"""Study v3's tables (analysis.studies.staleness*): the parts and machines read from the runs, the
pre-specified contrasts C1–C8 on a hand-made per-run table with known counts, and the command
on parquet folders exported from a real MLflow store of synthetic stale runs."""

from __future__ import annotations

from math import comb

import numpy as np
import pandas as pd
import pytest

from analysis.group_tests import holm
from analysis.studies.staleness_contrasts import CONTRASTS, contrast_table
from analysis.studies.staleness_runs import L1F, L2, SIZE_GPU, machine_column, part_column


def fisher_two_sided(ka: int, na: int, kb: int, nb: int) -> float:
    """Reference: the hypergeometric tables with the same margins no likelier than the observed."""
    k, n = ka + kb, na + nb
    prob = {x: comb(na, x) * comb(nb, k - x) / comb(n, k) for x in range(max(0, k - nb), min(k, na) + 1)}
    return sum(p for p in prob.values() if p <= prob[ka] * (1 + 1e-9))


def _cell(experiment, part, machine, model, lag, algo, n, k, mode="fixed"):
    """n runs of one cell, the first k collapsed; final success 0.1 (collapsed) or 0.8, + 0.01·seed."""
    return [{"run_id": f"{experiment}-{model}-{algo}-{lag}-{mode}-{s}", "experiment": experiment, "part": part,
             "machine": machine, "model": model, "lag": lag, "lag_mode": mode, "algo": algo, "collapsed": s < k,
             "final_success": (0.1 if s < k else 0.8) + 0.01 * s} for s in range(n)]


def _runs(gpu: bool = True) -> pd.DataFrame:
    p1 = [(L1F, "1", "cpu", "tiny", 4, a, 3, k) for a, k in (
        ("s_ppo", 3), ("st_ppo", 2), ("so_ppo", 1), ("ppo", 0), ("turn_ppo", 0), ("grpo", 3),
        ("grpo+decoupled_geo_rs", 0), ("ppo+bypass_ppo_clip", 0), ("bapo", 1))]
    p1 += [(L1F, "1", "cpu", "tiny", 2, "ppo", 3, 1)]
    p2 = [(L2, "2", "cpu", "tiny", lag, a, 3, k) for a, lag, k in (
        ("ppo", 0, 0), ("ppo", 2, 1), ("ppo", 8, 3), ("grpo", 0, 0), ("grpo", 8, 2))]
    p3 = [(L1F, "3", "cpu", "small", 2, "ppo", 3, 2)]
    if gpu:
        p3 += [(SIZE_GPU, "3", "gpu", "base", 2, "ppo", 3, 3), (SIZE_GPU, "3", "gpu", "small", 2, "ppo", 3, 1)]
    rows = [r for spec in p1 + p2 + p3 for r in _cell(*spec)]
    rows += _cell(L1F, "1", "cpu", "tiny", 4, "ppo", 3, 3, mode="uniform")  # in no contrast
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def result():
    return contrast_table(_runs(), n_boot=2000)


def test_contrast_groups_counts_and_fisher(result):
    t = result.table.set_index(["contrast", "lag", "a"])
    expected = {  # (contrast, lag, group a): (b, k/n of a, k/n of b)
        ("C1", 4, "s_ppo, st_ppo, so_ppo"): ("ppo, turn_ppo", "6/9", "0/6"),  # the uniform-lag ppo is not pooled
        ("C2", 4, "turn_ppo, st_ppo"): ("ppo, s_ppo", "2/6", "3/6"),
        ("C3", 4, "critic (GAE)"): ("critic-free", "6/15", "4/6"),  # grpo and bapo; not grpo+decoupled_geo_rs
        ("C4", 4, "grpo+decoupled_geo_rs"): ("grpo", "0/3", "3/3"),
        ("C5", 4, "bapo"): ("grpo", "1/3", "3/3"),
        ("C6", 4, "ppo+bypass_ppo_clip"): ("ppo", "0/3", "0/3"),
        ("C7", 2, "lag 2"): ("lag 0", "1/3", "0/3"),  # pooled over the presets at both lags: ppo
        ("C7", 8, "lag 8"): ("lag 0", "5/6", "0/6"),
        ("C8", 2, "small ppo"): ("tiny ppo", "2/3", "1/3"),  # CPU small against part 1's tiny
        ("C8-gpu", 2, "base ppo"): ("small ppo", "3/3", "1/3"),  # within the GPU experiment
    }
    assert {key: (r["b"], r["collapsed_a"], r["collapsed_b"]) for key, r in t.iterrows()} == expected
    for _, r in result.table.iterrows():
        ka, na = map(int, r["collapsed_a"].split("/"))
        kb, nb = map(int, r["collapsed_b"].split("/"))
        assert r["fisher_p"] == pytest.approx(fisher_two_sided(ka, na, kb, nb), rel=1e-9)
    assert t.loc[("C4", 4, "grpo+decoupled_geo_rs"), "fisher_p"] == pytest.approx(0.1)
    assert t.loc[("C7", 8, "lag 8"), "fisher_p"] == pytest.approx(fisher_two_sided(5, 6, 0, 6))
    assert t.loc[("C8-gpu", 2, "base ppo"), ["level", "machine"]].tolist() == [SIZE_GPU, "gpu"]
    assert t.loc[("C8", 2, "small ppo"), ["level", "machine"]].tolist() == [L1F, "cpu"]
    assert t.loc[("C7", 2, "lag 2"), "absent"] == "not in both groups: grpo"
    assert t.loc[("C1", 4, "s_ppo, st_ppo, so_ppo"), "absent"] == ""
    assert "critic-free: so_grpo, dapo, cispo, dppo_tv, sspo" in t.loc[("C3", 4, "critic (GAE)"), "absent"]


def test_success_difference_and_holm_over_the_whole_table(result):
    t = result.table
    c4 = t[t["contrast"] == "C4"].iloc[0]
    assert (c4["success_a"], c4["success_b"]) == pytest.approx((0.81, 0.11))
    assert c4["success_diff"] == pytest.approx(0.70)
    assert 0.68 <= c4["success_diff_low"] <= 0.70 <= c4["success_diff_high"] <= 0.72
    assert c4["welch_p"] < 1e-4
    # one Holm family per test over all ten rows: the smallest Fisher p times 10
    assert len(t) == 10
    i = t["fisher_p"].idxmin()
    assert t.loc[i, "contrast"] == "C7" and t.loc[i, "fisher_p_holm"] == pytest.approx(10 * t.loc[i, "fisher_p"])
    np.testing.assert_allclose(t["fisher_p_holm"], holm(t["fisher_p"]))
    np.testing.assert_allclose(t["welch_p_holm"], holm(t["welch_p"]))
    assert (t["fisher_p_holm"] >= t["fisher_p"]).all()


def test_what_could_not_be_computed_is_one_line_each(result):
    lines = result.missing
    assert ("C1 s_ppo, st_ppo, so_ppo vs ppo, turn_ppo: not computed at lags 1, 2, 8, 16, 24: no runs of "
            "s_ppo, st_ppo, so_ppo at lags 1, 2, 8, 16, 24; ppo, turn_ppo at lags 1, 8, 16, 24") in lines
    assert ("C5 dppo_tv vs grpo: not computed at lags 1, 2, 4, 8, 16, 24: no runs of dppo_tv at lags 1, 2, 4, 8, 16, "
            "24; grpo at lags 1, 2, 8, 16, 24") in lines
    assert ("C8-gpu small ppo vs tiny ppo: not computed at lags 0, 2, 8: no runs of small ppo at lags 0, 8; "
            "tiny ppo at lags 0, 2, 8") in lines
    assert len([m for m in lines if m.startswith("C4 ")]) == 4  # one line per pair
    assert not any(m.startswith("C7 ") and "lag 2" in m for m in lines)
    assert len(lines) == len(set(lines))
    # a part that is not there at all: one line for its contrast; no GPU runs: no C8-gpu line
    no_p2 = _runs(gpu=False)
    res = contrast_table(no_p2[no_p2["part"] != "2"], n_boot=200)
    c7 = [m for m in res.missing if m.startswith("C7")]
    assert c7 == ["C7 (lag k vs lag 0, pooled over part 2's presets; l2, k ∈ {2, 8}): not computed: no runs of "
                  "part 2 (frontier_l2 runs with trainer.offpolicy.lag)"]
    assert not any(m.startswith("C8-gpu") for m in res.missing)
    assert set(res.table["contrast"]) == {"C1", "C2", "C3", "C4", "C5", "C6", "C8"}


def test_contrasts_are_the_readme_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs/results/staleness/README.md").read_text()
    section = readme.split("## Pre-specified contrasts", 1)[1].split("\n## ", 1)[0]
    table = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| C")}
    assert [c.id for c in CONTRASTS] == [*table, "C8-gpu"]
    for c in CONTRASTS[:-1]:
        assert c.wording.replace("`", "") in table[c.id].replace("`", "")
        assert c.at.replace("`", "") in table[c.id].replace("`", "")


def test_parts_and_machines_from_the_runs():
    runs = pd.DataFrame({"run_id": list("abcdefg"),
                         "experiment": [L1F, L1F, L1F, L2, L2, SIZE_GPU, "staleness_pilot"],
                         "model": ["tiny", "small", "tiny", "tiny", "tiny", "tiny", "tiny"]})
    devices = {"a": "auto", "b": "cpu", "c": "cuda:0", "d": "auto", "e": "auto", "f": "auto", "g": "auto"}
    params = pd.DataFrame({"run_id": ["d", *devices], "value": ["2", *devices.values()],
                           "key": ["trainer.offpolicy.lag", *["trainer.device"] * len(devices)]})
    runs["machine"] = machine_column(runs, params).to_numpy()
    assert runs["machine"].tolist() == ["cpu", "cpu", "gpu", "cpu", "cpu", "gpu", "cpu"]
    # e: a study-v2 run of frontier_l2 (no lag param): no part; c: tiny on a GPU: part 3
    assert part_column(runs, params).fillna("-").tolist() == ["1", "3", "3", "2", "-", "3", "-"]


# --- the command on folders exported from a real MLflow store ------------------------------------------
def _store_cells():
    from fixtures.stale_runs import StaleCell as C

    part1 = (C("ppo", 0, 2, 0), C("ppo", 2, 2, 2), C("s_ppo", 2, 2, 1), C("grpo", 2, 2, 1),
             C("grpo", 2, 2, 0, correction="decoupled_geo_rs"), C("ppo", 4, 2, 2),
             C("ppo", 4, 2, 0, correction="bypass_ppo_clip"), C("ppo", 4, 2, 1, lag_mode="uniform"),
             C("ppo", 0, 2, 0, model="small"), C("ppo", 2, 2, 0, model="small"))
    part2 = (C("ppo", 0, 2, 0), C("ppo", 2, 2, 2), C("grpo", 0, 2, 0), C("grpo", 2, 2, 1))
    return {L1F: part1, L2: part2, "staleness_pilot": (C("ppo", 0, 1, 0),)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One exported folder per experiment of `_store_cells`, from a real MLflow store."""
    from analysis import load_study
    from analysis.export import export_study
    from fixtures.stale_runs import write_stale_study

    root = tmp_path_factory.mktemp("v3_store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    folders = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STPPO_CACHE_DIR", str(root / "cache"))
        for name, cells in _store_cells().items():
            write_stale_study(uri, name, cells)
            export_study(load_study([name], uri), root / name)
            folders[name] = root / name
    return folders


def test_cli_writes_cells_contrasts_and_figures(exported, tmp_path, capsys):
    from analysis.studies.staleness import main

    out = tmp_path / "v3"
    assert main(["--data", *map(str, exported.values()), "--out", str(out), "--n-boot", "500"]) == 0
    said = capsys.readouterr().out
    assert "part 1 (frontier_l1f, tiny, CPU): 16 runs, 7 collapsed" in said
    assert "part 2 (frontier_l2 runs with trainer.offpolicy.lag): 8 runs, 3 collapsed" in said
    assert "left out: the runs of staleness_pilot (no part of the study)" in said
    cells = pd.read_csv(out / "cells.csv").set_index(["part", "model", "level", "lag", "lag_mode", "algo"])
    assert cells.loc[(1, "tiny", L1F, 2, "fixed", "ppo"), ["runs", "collapsed"]].tolist() == [2, 2]
    assert cells.loc[(1, "tiny", L1F, 4, "uniform", "ppo"), "collapsed"] == 1
    assert cells.loc[(3, "small", L1F, 2, "fixed", "ppo"), "collapsed"] == 0
    assert cells.loc[(2, "tiny", L2, 2, "fixed", "grpo"), "collapse_p"] == 0.5
    stale = cells.loc[(1, "tiny", L1F, 2, "fixed", "ppo")]
    assert stale["mean_offpolicy_kl"] > 0 and stale["mean_rollout_chi2"] > 0 and stale["mean_rollout_kl"] > 0
    assert np.isnan(cells.loc[(1, "tiny", L1F, 0, "fixed", "ppo"), "mean_offpolicy_kl"])  # not stale: not logged
    con = pd.read_csv(out / "contrasts.csv").set_index(["contrast", "lag", "a"])
    assert con.loc[("C6", 4, "ppo+bypass_ppo_clip"), ["collapsed_a", "collapsed_b"]].tolist() == ["0/2", "2/2"]
    assert con.loc[("C6", 4, "ppo+bypass_ppo_clip"), "fisher_p"] == pytest.approx(1 / 3)
    assert con.loc[("C7", 2, "lag 2"), ["collapsed_a", "collapsed_b"]].tolist() == ["3/4", "0/4"]
    assert con.loc[("C8", 2, "small ppo"), ["collapsed_a", "collapsed_b"]].tolist() == ["0/2", "2/2"]
    assert con.loc[("C4", 2, "grpo+decoupled_geo_rs"), "success_diff"] == pytest.approx(0.375)  # 0.8 − (0.8+0.05)/2
    for name in ("fig_staleness_frontier", "fig_success_vs_lag", "fig_size", "fig_l2_vs_l1f"):
        assert (out / f"{name}.png").stat().st_size > 10_000 and (out / f"{name}.pdf").exists()
    missing = (out / "not_computed.txt").read_text().splitlines()
    assert any(m.startswith("C7 lag k vs lag 0: not computed at lag 8") for m in missing)


def test_cli_names_a_missing_part_and_rejects_bad_input(exported, tmp_path, capsys):
    from analysis.studies.staleness import main

    out = tmp_path / "p1"
    assert main(["--data", str(exported[L1F]), "--out", str(out), "--n-boot", "200"]) == 0
    said = capsys.readouterr().out
    assert "part 2 (frontier_l2 runs with trainer.offpolicy.lag): no runs" in said
    assert ("C7 (lag k vs lag 0, pooled over part 2's presets; l2, k ∈ {2, 8}): not computed: no runs of part 2 "
            "(frontier_l2 runs with trainer.offpolicy.lag)") in said
    assert not (out / "fig_l2_vs_l1f.png").exists() and (out / "fig_size.png").exists()
    assert main(["--data", str(exported["staleness_pilot"]), "--out", str(out)]) == 2
    assert "no run of the study's parts" in capsys.readouterr().err
    assert main(["--data", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing/runs.parquet does not exist" in capsys.readouterr().err


def test_a_seed_run_twice_counts_once(tmp_path, capsys, monkeypatch):
    """A multirun repeated over a cell (the same preset, lag and seed again) adds no replicate: the
    first run of each seed is kept, and the command says how many it left out."""
    from analysis import load_study
    from analysis.export import export_study
    from analysis.studies.staleness import main
    from fixtures.stale_runs import StaleCell as C, write_stale_study

    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_stale_study(uri, L1F, (C("ppo", 2, 2, 2), C("grpo", 2, 2, 0)))
    write_stale_study(uri, L1F, (C("ppo", 2, 2, 0),))  # seeds 0 and 1 of ppo at lag 2 again
    export_study(load_study([L1F], uri), tmp_path / "data")
    assert main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--n-boot", "200"]) == 0
    assert "left out: 2 repeated runs of a cell's seed (the first run of each kept)" in capsys.readouterr().out
    cells = pd.read_csv(tmp_path / "out" / "cells.csv").set_index(["lag", "algo"])
    assert cells.loc[(2, "ppo"), ["runs", "collapsed"]].tolist() == [2, 2]  # the first runs: both collapsed
