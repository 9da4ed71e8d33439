"""stppo: stability studies of PPO-family RL for multi-turn LLM search agents.

Importing the package is cheap and torch-free; subpackages (algos, envs, rollout, models, train)
import torch themselves.
"""

__version__ = "0.1.0"
