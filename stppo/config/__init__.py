"""stppo.config — the run's configuration: the schema behind `conf/`, its composition, the
parameter names the analysis reads.

    algo         the `algo` group: a preset and the run's overrides → one `LossSpec`
    schema       every other group's dataclass, and `Config`, the root
    compose      `conf/` → `Config`: Hydra's ConfigStore, `compose`, `to_config`
    identity     `run_identity`: a run's job folder from its settings
    param_names  the MLflow params the analysis reads, checked against the schema

Hydra composes YAML from `conf/` over the schema (type-checked by OmegaConf); `to_config` then
builds the dataclasses, whose `__post_init__` rejects invalid settings with one line that names
the field and the allowed values. Nothing mutates a config after that. Every default lives in
the schema, once: `conf/` holds only what differs (tests/test_config_source.py). Import the names
from here; torch-free, so importing is cheap.
"""

from stppo.config.algo import (DEFAULT_SUBSENTENCE_DELIMITERS, KL_ESTIMATORS, AlgoConfig,
                               ClipBiasConfig, DynamicSamplingConfig, KLConfig, OverlongConfig,
                               RolloutCorrectionOptions, delimiter_chars, resolve_loss)
from stppo.config.compose import CONF_DIR, compose, register_configs, to_config
from stppo.config.identity import run_identity
from stppo.config.schema import (BACKENDS, OFFPOLICY_LAG_MODES, ROLLOUT_ENGINES, BackendConfig,
                                 Config, CriticWarmStartConfig, DiagnosticsConfig, ModelConfig,
                                 OffPolicyConfig, RetrieverConfig, RolloutSettings, TaskConfig,
                                 TrackingConfig, TrainerConfig, WarmStartConfig)

__all__ = [
    "AlgoConfig", "BACKENDS", "BackendConfig", "CONF_DIR", "ClipBiasConfig", "Config",
    "CriticWarmStartConfig", "DEFAULT_SUBSENTENCE_DELIMITERS", "DiagnosticsConfig",
    "DynamicSamplingConfig", "KLConfig", "KL_ESTIMATORS", "ModelConfig", "OFFPOLICY_LAG_MODES",
    "OffPolicyConfig", "OverlongConfig", "ROLLOUT_ENGINES", "RetrieverConfig",
    "RolloutCorrectionOptions", "RolloutSettings", "TaskConfig", "TrackingConfig",
    "TrainerConfig", "WarmStartConfig", "compose", "delimiter_chars", "register_configs",
    "resolve_loss", "run_identity", "to_config",
]
