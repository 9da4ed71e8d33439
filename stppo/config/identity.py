"""`run_identity`: the name of a run's job folder, from its config."""

from __future__ import annotations

from dataclasses import asdict

from stppo.config.schema import Config, OffPolicyConfig


# Settings that do not change what a run computes, left out of its identity: how it resumes and
# shows progress, where it is tracked; the verl launcher's own process knobs.
_NOT_IDENTITY = {"trainer": ("resume", "progress"),
                 "backend_verl": ("dry_run", "poll_s", "stop_grace_s", "python")}


def run_identity(cfg: "Config") -> str:
    """The name of a run's job folder (`trainer.out_dir/<experiment>/<name>`: its checkpoints),
    for both backends: `<algo>-<model>-<task>-seed<seed>[-verl]-<hash of its settings>`. Same
    settings ⇒ same name, so a resumed run finds its checkpoints. Settings added with a default
    that changes nothing (on-policy `trainer.offpolicy`, verl's unset `rollout_gpus_per_node`)
    are left out, so earlier runs keep their folders."""
    from stppo.cache import content_hash

    d = asdict(cfg)
    for k in _NOT_IDENTITY["trainer"]:
        d["trainer"].pop(k)
    d.pop("tracking")
    if d["trainer"]["offpolicy"] == asdict(OffPolicyConfig()):
        d["trainer"].pop("offpolicy")
    tag = ""
    if cfg.backend.name == "verl":
        for k in _NOT_IDENTITY["backend_verl"]:
            d["backend"].pop(k)
        if d["backend"]["rollout_gpus_per_node"] is None:
            d["backend"].pop("rollout_gpus_per_node")
        tag = "-verl"
    return f"{cfg.algo.name}-{cfg.model.name}-{cfg.task.name}-seed{cfg.seed}{tag}-{content_hash(d, length=8)}"
