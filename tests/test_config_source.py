"""Each default lives in one place: the schema (stppo.config), a loss mode's `@loss_mode`
declaration, a synthetic world's `SyntheticConfig`. The default group files of conf/ set
nothing, no file of conf/ restates a default, `backend=verl` sets only what differs, the config
`python run.py` composes equals the schema's defaults wherever no preset, model, world or
warm-start recipe speaks, and a preset fixes only what differs from the loss's defaults."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import MISSING, OmegaConf

from stppo.config import (AlgoConfig, BackendConfig, Config, TrackingConfig, TrainerConfig,
                          compose, to_config)
from stppo.envs.synthetic import SyntheticConfig

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


# --- one source per default: no value of conf/ restates what it overrides ---------------------------
SYNTHETIC_TASKS = ("testbed", "synthetic_multihop")  # their task.options are SyntheticConfig's fields


def _schema_defaults(cls) -> dict:
    """The schema's defaults as a nested dict (MISSING fields left out)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = _schema_defaults(hints[f.name])
        elif f.default is not dataclasses.MISSING and f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = _schema_defaults(type(value)) if dataclasses.is_dataclass(value) else value
    return out


def _layer(path: Path, data: dict, conf: Path) -> tuple[str, dict]:
    """(the key prefix of a conf file's values, what they lay over). A group file lies on the
    schema (a synthetic task's options on SyntheticConfig); a `_global_` file (an experiment, a
    level, a regime) on the composition it selects (its `override /group:` entries, else the
    default run's groups), so a value that restates a group file's counts too."""
    head = path.read_text().split("\n", 1)[0]
    world = {f.name: f.default for f in dataclasses.fields(SyntheticConfig)}
    if "@package _global_" not in head:
        prefix = head.split("@package", 1)[1].strip() + "." if "@package" in head else (
            path.parent.relative_to(conf).parts[0] + "." if path.parent != conf else "")
        base = _schema_defaults(Config)
        if prefix == "task." and data.get("name") in SYNTHETIC_TASKS:
            base["task"]["options"] = world
        return prefix, base
    overrides = [f"{k.split('/', 1)[1]}={v}" for entry in data.get("defaults", [])
                 if isinstance(entry, dict) for k, v in entry.items() if k.startswith("override /")
                 and not k.startswith("override /hydra")]
    base = OmegaConf.to_container(compose(overrides), resolve=False)
    if base["task"]["name"] in SYNTHETIC_TASKS:
        base["task"]["options"] = {**world, **base["task"].get("options", {})}
    return "", base


def _at(node, key: str):
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def conf_values(conf: Path | None = None) -> list[tuple[str, str, object, object]]:
    """(file, key, value, what it overrides or MISSING) of every value conf/ sets, Hydra's own
    launcher presets and `hydra:` keys aside."""
    conf = conf or CONF
    out = []
    for path in sorted(conf.rglob("*.yaml")):
        rel = path.relative_to(conf).as_posix()
        if rel.startswith("hydra/"):
            continue
        data = yaml.safe_load(path.read_text()) or {}
        prefix, base = _layer(path, data, conf)
        for key, value in _flat({k: v for k, v in data.items() if k not in ("defaults", "hydra")}):
            out.append((rel, prefix + key, value, _at(base, prefix + key)))
    return out


def restated_defaults(conf: Path | None = None) -> list[tuple[str, str, object]]:
    """The values of conf/ equal to what they override: the schema's default (a group file), or
    what the composition under a `_global_` file already has (its groups' files over the schema)."""
    return [(f, k, v) for f, k, v, d in conf_values(conf) if d is not MISSING and _same(v, d)]


def test_no_conf_value_restates_a_default():
    assert len(conf_values()) > 100  # the walk reads conf/
    restated = restated_defaults()
    assert not restated, ("conf/ restates defaults (delete these lines: the schema, or the group file "
                          f"under them, holds the value): {restated}")


def test_a_default_world_written_in_yaml_is_the_python_default():
    """A value that every synthetic task file sets alike is the world's default written in YAML:
    it belongs in SyntheticConfig (and then the test above removes it from the files); and
    `task=synthetic_multihop` is SyntheticConfig's world, recorded whole."""
    rows: dict[str, list] = {}
    tasks = [p for p in (CONF / "task").glob("*.yaml")
             if (yaml.safe_load(p.read_text()) or {}).get("name") in SYNTHETIC_TASKS]
    for p in tasks:
        for key, value in _flat((yaml.safe_load(p.read_text()) or {}).get("options") or {}):
            rows.setdefault(key, []).append(value)
    world = {f.name: f.default for f in dataclasses.fields(SyntheticConfig)}
    for key, values in rows.items():
        if len(tasks) > 1 and len(values) == len(tasks) and all(_same(v, values[0]) for v in values):
            assert _same(values[0], world[key]), (f"every synthetic task file sets options.{key}="
                                                  f"{values[0]!r}; SyntheticConfig says {world[key]!r}")
    recorded = to_config(compose(["task=synthetic_multihop"])).task.options
    assert recorded == {**dataclasses.asdict(SyntheticConfig()), "hop_mix": [0.4, 0.4, 0.2]}


def test_the_restatement_check_sees_a_restated_value(tmp_path):
    """The walk is not blind: values that write a default are caught, one that overrides a group
    file's value is not (frontier's levels, the testbed world under an experiment)."""
    fake = tmp_path / "conf"
    (fake / "task").mkdir(parents=True)
    (fake / "task" / "testbed.yaml").write_text("name: testbed\noptions:\n  n_people: 300\n  n_train: 600\n")
    (fake / "x.yaml").write_text("# @package _global_\ntrainer:\n  ppo_epochs: 2\n  actor_lr: 1.0e-4\n"
                                 "  minibatch_size: 8\ntask:\n  options: {n_train: 400, n_val: 200}\n")
    assert sorted((k, v) for _, k, v in restated_defaults(fake)) == [
        ("task.options.n_people", 300), ("task.options.n_val", 200), ("trainer.actor_lr", 1e-4),
        ("trainer.ppo_epochs", 2)]


def test_presets_fix_only_what_differs_from_the_loss_defaults():
    """A preset is a partial LossSpec: it fixes no field at LossSpec's default and no option at
    its loss mode's `@loss_mode` default (one source per default)."""
    from stppo.algos import LOSS_MODES, PRESETS, LossSpec
    from stppo.algos.presets import BUILT_IN

    plain = LossSpec("x")
    for name in BUILT_IN:
        fixes = dict(PRESETS[name].fixes)
        same = [k for k, v in fixes.items() if k not in ("options", "clip_bias") and getattr(plain, k) == v]
        assert not same, f"preset {name!r} restates LossSpec's defaults: {same}"
        mode = LOSS_MODES[PRESETS[name].loss_mode]
        opts = [k for k, v in dict(fixes.get("options", {})).items() if mode.options.get(k) == v]
        assert not opts, f"preset {name!r} restates its loss mode's option defaults: {opts}"


def test_the_algo_group_sets_each_loss_field_of_the_spec():
    """AlgoConfig's loss fields are LossSpec's, by name: null in the schema (the preset's), and
    resolved into the spec through one loop (`stppo.algos.spec.PLAIN_FIELDS`)."""
    from stppo.algos.spec import PLAIN_FIELDS

    algo = {f.name: f for f in dataclasses.fields(AlgoConfig)}
    for name in PLAIN_FIELDS:
        assert name in algo and algo[name].default is None, name
    a = to_config(compose(["algo=dapo"])).algo
    assert {n: getattr(a, n) for n in PLAIN_FIELDS} == {n: getattr(a.spec, n) for n in PLAIN_FIELDS}
