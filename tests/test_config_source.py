"""Each default lives in one place: the schema (stppo.config). The default group files of conf/
set nothing, `backend=verl` sets only what differs, and the config `python run.py` composes
equals the schema's defaults wherever no preset, model, world or warm-start recipe speaks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from stppo.config import BackendConfig, Config, TrackingConfig, TrainerConfig, compose, to_config

CONF = Path(__file__).resolve().parents[1] / "conf"
DEFAULT_GROUP_FILES = ("trainer/default.yaml", "tracking/mlflow.yaml", "backend/own.yaml")


@pytest.mark.parametrize("name", DEFAULT_GROUP_FILES)
def test_default_group_files_set_nothing(name):
    assert yaml.safe_load((CONF / name).read_text()) is None, f"conf/{name} sets values: the schema holds them"


def _flat(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def test_verl_backend_sets_only_what_differs_from_the_schema():
    set_here = dict(_flat(yaml.safe_load((CONF / "backend/verl.yaml").read_text())))
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    same = [k for k, v in set_here.items() if OmegaConf.select(OmegaConf.create(schema), k) == v]
    assert not same, f"conf/backend/verl.yaml repeats schema defaults: {same}"
    assert set_here["backend.name"] == "verl"


def test_the_default_run_is_the_schema_defaults():
    cfg = to_config(compose([]))
    warm = yaml.safe_load((CONF / "warmstart/testbed_tiny.yaml").read_text())  # the default pair's recipe
    expected = TrainerConfig()
    for k, v in warm.items():
        setattr(expected.warmstart, k, v)
    assert cfg.trainer == expected
    assert cfg.tracking == TrackingConfig()
    assert cfg.backend == BackendConfig()
    assert (cfg.algo.name, cfg.model.name, cfg.task.name) == ("st_ppo", "tiny", "testbed")
