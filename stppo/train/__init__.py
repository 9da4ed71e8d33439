"""Training: the RL loop, the SFT warm start, checkpoints (docs/design.md, "Layout": stppo/train/)."""


def run(cfg):
    """Train one run from a composed config; see `stppo.train.job.run`."""
    from stppo.train.job import run as _run

    return _run(cfg)


__all__ = ["run"]
