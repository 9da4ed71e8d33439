"""Optuna studies over stppo runs (docs/usage.md, "Optuna sweeps": clip ranges, the clip-bias scale's τ).

    python run.py -m +sweep=clip_range algo=st_ppo              # one study per preset
    python run.py -m +sweep=clip_range algo=ppo hydra.sweeper.n_trials=40 +experiment=quick

`sweeps.study`: the objective, pruning through the collapse detector, resuming a killed study.
`sweeps.hydra_sweeper`: the Hydra sweeper plugin (`hydra/sweeper=stppo_optuna`) and launcher schemas.
"""


def register_hydra_plugins() -> None:
    """Make Hydra see stppo's sweeper and launcher schemas (run.py does this at import)."""
    from sweeps.hydra_sweeper import register

    register()
