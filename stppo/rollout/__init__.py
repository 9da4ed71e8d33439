"""The multi-turn batched generation engine → `stppo.batch.Batch` (docs/design.md §1, §3)."""

from stppo.rollout.config import RolloutConfig
from stppo.rollout.engine import TurnOutput, generate_turn, rollout
from stppo.rollout.episodes import (collate_episodes, encode_episode, encode_prompt,
                                    group_ids_by_question)
from stppo.rollout.sampling import sample_next, top_p_filter
from stppo.rollout.stopping import StopChecker, eos_token_ids

__all__ = [
    "RolloutConfig", "StopChecker", "TurnOutput", "collate_episodes", "encode_episode",
    "encode_prompt", "eos_token_ids", "generate_turn", "group_ids_by_question", "rollout",
    "sample_next", "top_p_filter",
]
