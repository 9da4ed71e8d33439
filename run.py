"""Hydra entry point: compose the config, train one run, return its objective.

    python run.py                                   # default experiment (st_ppo, tiny, synthetic)
    python run.py algo=ppo seed=1                   # any preset / seed
    python run.py -m algo=ppo,s_ppo,st_ppo seed=0,1,2   # a study (multirun)
"""

import hydra
from omegaconf import DictConfig

from stppo.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from stppo.train import run

    return run(cfg)


if __name__ == "__main__":
    main()
