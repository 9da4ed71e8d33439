"""Training: the RL loop, the SFT warm start, checkpoints (DESIGN.md §5: stppo/train/)."""


def run(cfg):
    """Train one run from a composed config; see `stppo.train.run.run`."""
    from stppo.train.run import run as _run

    return _run(cfg)


__all__ = ["run"]
