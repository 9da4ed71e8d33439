"""Identical runs count once (analysis.identical): runs whose trajectory series are equal bit for
bit (same model, task, seed) form one unit, which every count and test takes once."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.group_tests import two_group_tests
from analysis.identical import apart, merged_units, once, unit_column
from analysis.load import load_study
from fixtures.runs import synthetic_series, write_run
from analysis.tables import per_run_table
from stppo import metric_names as T


def _tags(algo: str, seed: int) -> dict:
    return {T.TAG_ALGO: algo, T.TAG_MODEL: "tiny", T.TAG_TASK: "testbed", T.TAG_SEED: str(seed),
            T.TAG_SWEEP: "", T.TAG_GIT_COMMIT: "synthetic"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """ppo ≡ s_ppo ≡ st_ppo per seed (one series written three times), turn_ppo its own; seed 0
    collapses, seed 1 does not; grpo and dapo seed 1 differ in one response length at one step;
    sspo seed 1 has dapo's outcomes and another entropy."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('identical')}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("dup")
    ids = {}
    for seed in (0, 1):
        series = synthetic_series(20, seed=seed, collapse_at=10 if seed == 0 else None)
        for algo in ("ppo", "s_ppo", "st_ppo"):
            ids[algo, seed] = write_run(client, exp, tags=_tags(algo, seed), params={}, series=series, per_step=False)
        own = synthetic_series(20, seed=100 + seed, collapse_at=12 if seed == 0 else None)
        ids["turn_ppo", seed] = write_run(client, exp, tags=_tags("turn_ppo", seed), params={}, series=own,
                                          per_step=False)
    near = synthetic_series(20, seed=1)  # one response one token longer at step 7
    near[T.RESPONSE_LENGTH_MEAN] = [(s, 60.0 + (1 / 64 if s == 7 else 0.0)) for s in range(1, 21)]
    same = synthetic_series(20, seed=1)  # the same outcomes, another entropy (rounding)
    same[T.RESPONSE_LENGTH_MEAN] = [(s, 60.0) for s in range(1, 21)]
    same[T.ENTROPY] = [(s, 1.0 + 1e-12) for s in range(1, 21)]
    ids["grpo", 1] = write_run(client, exp, tags=_tags("grpo", 1), params={}, series=near, per_step=False)
    ids["dapo", 1] = write_run(client, exp, tags=_tags("dapo", 1), params={}, series=same, per_step=False)
    rounded = {**same, T.ENTROPY: [(s, 1.0 + 2e-12) for s in range(1, 21)]}  # dapo's outcomes, rounding apart
    ids["sspo", 1] = write_run(client, exp, tags=_tags("sspo", 1), params={}, series=rounded, per_step=False)
    return load_study("dup", uri, use_cache=False), ids


def test_runs_with_equal_series_share_a_unit_and_a_differing_value_splits_it(study):
    s, ids = study
    unit = unit_column(s)
    for seed in (0, 1):
        trio = {unit[ids[a, seed]] for a in ("ppo", "s_ppo", "st_ppo")}
        assert len(trio) == 1 and unit[ids["turn_ppo", seed]] not in trio
    assert unit[ids["ppo", 0]] != unit[ids["ppo", 1]]  # the same preset, another seed
    assert unit[ids["grpo", 1]] != unit[ids["dapo", 1]]  # one response length apart
    assert unit[ids["sspo", 1]] == unit[ids["dapo", 1]]  # the same outcomes, another entropy
    assert len(set(unit)) == 6  # 2 trios, 2 turn_ppo, grpo, dapo ≡ sspo


def test_the_table_lists_what_it_merged_and_counts_each_unit_once(study):
    s, _ = study
    runs = per_run_table(s)
    merged = merged_units(runs)
    assert sorted(merged["presets"]) == ["dapo ≡ sspo"] + ["ppo ≡ s_ppo ≡ st_ppo"] * 2
    assert len(once(runs)) == 6


def test_two_groups_count_each_unit_once_and_leave_shared_units_out(study):
    s, _ = study
    runs = per_run_table(s)
    corrected = runs[runs["algo"].isin(["s_ppo", "st_ppo"])]
    plain = runs[runs["algo"].isin(["ppo", "turn_ppo"])]
    # corrected: 4 runs, 2 units — both also in `plain` (ppo): nothing of `corrected` is left
    a, b, shared = apart(corrected, plain)
    assert (len(a), len(b), shared) == (0, 2, 2)
    row = two_group_tests(corrected, plain)
    assert (row["collapsed_a"], row["collapsed_b"], row["shared_units"]) == ("0/0", "1/2", 2)
    assert pd.isna(row["fisher_p"]) and pd.isna(row["welch_p"])
    # counted as runs the trio's collapse (seed 0) would be three collapses against one
    turn = runs[runs["algo"] == "turn_ppo"]
    row = two_group_tests(runs[runs["algo"].isin(["ppo", "s_ppo", "st_ppo"])], turn)
    assert (row["collapsed_a"], row["collapsed_b"], row["shared_units"]) == ("1/2", "1/2", 0)
