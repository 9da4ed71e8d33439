"""From `conf/` to a validated `Config`: Hydra's ConfigStore registration, composition outside
`run.py` (tests, benchmarks, notebooks) and `to_config`."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from stppo.config.schema import Config


def register_configs() -> None:
    """Register the root schema with Hydra's ConfigStore and the plugins' preset folders with its
    search path (both idempotent). Hydra 1.4 finds the search-path plugin by its entry point
    (pyproject.toml); 1.3 (verl's environment) does not read entry points, so it is registered
    here too — Hydra keeps one registration of a class."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    from stppo.hydra_search_path import StppoSearchPath

    cs = ConfigStore.instance()
    if "stppo_schema.yaml" not in cs.repo:
        from stppo.envs.synthetic import SyntheticConfig

        cs.store(name="stppo_schema", node=Config)
        cs.store(group="world", name="synthetic", node=SyntheticConfig)
    Plugins.instance().register(StppoSearchPath)


def to_config(cfg: DictConfig | dict) -> Config:
    """Composed DictConfig → validated dataclasses. Raises ValueError naming the bad field."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):  # composed without the schema
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    return obj


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose `conf/` with Hydra overrides outside `run.py` (tests, benchmarks, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), **_version_base()):
        return hydra_compose(config_name, overrides=list(overrides))


def _version_base() -> dict:
    """Hydra < 1.4 (verl's environment has 1.3.8) assumes 1.1's defaults, with a warning, unless
    told `version_base`; 1.4 (stppo's pin) deprecates the argument and warns when it is given."""
    import hydra

    major, minor = (int(x) for x in hydra.__version__.split(".")[:2])
    return {"version_base": "1.3"} if (major, minor) < (1, 4) else {}
