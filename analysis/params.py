"""A run's params as columns of a per-run table, read through the keys of `stppo.config.param_names`."""

from __future__ import annotations

import pandas as pd

from stppo.config.param_names import ParamKey


def param_values(runs: pd.DataFrame, params: pd.DataFrame, key: str | ParamKey) -> pd.Series:
    """The value (string) of param `key` for each run of `runs`, aligned with its rows (NaN where
    a run did not log it)."""
    key = key.path if isinstance(key, ParamKey) else key
    hits = params.loc[params["key"] == key, ["run_id", "value"]].drop_duplicates("run_id", keep="last")
    values = hits.set_index(hits["run_id"].astype(str))["value"].astype(str)
    return runs["run_id"].astype(str).map(values)


def param_column(runs: pd.DataFrame, params: pd.DataFrame, key: ParamKey) -> pd.Series:
    """The value (string) of `key` for each run of `runs`. A run without it reads `key.legacy` when
    it logged nothing of the key's section (it predates the setting); otherwise — no legacy value,
    or the section logged without the key (a renamed field) — ValueError naming the runs."""
    values = param_values(runs, params, key)
    missing = values.isna().to_numpy()
    if not missing.any():
        return values
    ids = runs["run_id"].astype(str)[missing]
    if key.legacy is None:
        raise ValueError(f"param {key.path} is missing from {len(ids)} run(s) ({', '.join(ids[:3])}…)")
    in_section = set(params.loc[params["key"].astype(str).str.startswith(key.section), "run_id"].astype(str))
    partial = [r for r in ids if r in in_section]
    if partial:
        raise ValueError(f"param {key.path} is missing from {len(partial)} run(s) that log {key.section}* "
                         f"({', '.join(partial[:3])}): renamed in the config?")
    return values.where(~missing, key.legacy)
