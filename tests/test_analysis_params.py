"""The params the analysis reads (`stppo.config.param_names`, `analysis.params`): keys checked against the
config schema, logged by a run under those keys, and a missing key an error unless the run
predates the setting."""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd
import pytest

from analysis.params import param_column
from stppo.config import param_names as P
from stppo.config import compose, to_config
from stppo.tracker import flatten


def test_every_key_is_a_field_of_the_schema_and_a_run_logs_it():
    keys = [v for v in vars(P).values() if isinstance(v, P.ParamKey)]
    assert len(keys) >= 10
    logged = flatten(asdict(to_config(compose(["algo=ppo"]))))
    for k in keys:
        assert k.path in logged, k.path
    assert any(k.startswith(P.COLLAPSE) for k in logged)


@pytest.mark.parametrize("path, message", [
    ("trainer.offpolicy.lagg", "OffPolicyConfig has no field 'lagg'"),
    ("trainer.actor_lr.x", "'actor_lr' has no fields"),
    ("algorithm.name", "Config has no field 'algorithm'"),
])
def test_a_key_that_is_no_field_fails_where_it_is_named(path, message):
    with pytest.raises(KeyError, match=message):
        P.param_key(path)


def _params(rows: dict[str, dict[str, str]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs = pd.DataFrame({"run_id": list(rows)})
    params = pd.DataFrame([{"run_id": r, "key": k, "value": v} for r, kv in rows.items() for k, v in kv.items()],
                          columns=["run_id", "key", "value"])
    return runs, params


def test_a_run_from_before_the_setting_reads_its_legacy_value():
    runs, params = _params({"new": {"trainer.offpolicy.lag": "3", "trainer.offpolicy.lag_mode": "uniform"},
                            "old": {"trainer.actor_lr": "1e-4"}})
    assert param_column(runs, params, P.LAG).tolist() == ["3", "0"]
    assert param_column(runs, params, P.LAG_MODE).tolist() == ["uniform", "fixed"]


def test_a_run_that_logs_the_section_without_the_key_is_an_error():
    """A renamed field: the run logged trainer.offpolicy.* but not the key read."""
    runs, params = _params({"a": {"trainer.offpolicy.lag": "3"}, "b": {"trainer.offpolicy.delay": "3"}})
    with pytest.raises(ValueError, match=r"trainer.offpolicy.lag is missing from 1 run.s. that log "
                                         r"trainer.offpolicy.\* \(b\): renamed in the config\?"):
        param_column(runs, params, P.LAG)


def test_a_key_without_a_legacy_value_is_required():
    runs, params = _params({"a": {"trainer.actor_lr": "1e-4"}, "b": {}})
    with pytest.raises(ValueError, match=r"param trainer.actor_lr is missing from 1 run.s. \(b"):
        param_column(runs, params, P.ACTOR_LR)
