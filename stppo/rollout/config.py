"""Settings of the rollout engine (validated at construction; max_turns comes from the env)."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("auto", "eager", "static")


@dataclass(frozen=True)
class RolloutConfig:
    max_new_tokens: int = 64  # per turn (one generation call)
    max_total_tokens: int = 1024  # prompt + all turns + observations; beyond it ⇒ truncated
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # argmax instead of sampling (temperature and top_p are then unused)
    # auto: static on CUDA for the models the lean code supports (Qwen2/Llama, SDPA, full
    # attention), else eager; eager: `engine.py`; static: `static.py` (fixed-size cache, buckets)
    engine: str = "auto"
    check_every: int = 8  # static: decoding steps between the host's looks (stop tags, compaction)
    cuda_graphs: bool = True  # static on CUDA: replay each bucket's step as a captured graph

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens!r}; expected an int >= 1")
        if not isinstance(self.max_total_tokens, int) or self.max_total_tokens < 2:
            raise ValueError(f"rollout.max_total_tokens={self.max_total_tokens!r}; "
                             "expected an int >= 2")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature={self.temperature!r}; expected a float > 0 "
                             "(use greedy=true for argmax decoding)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p!r}; expected 0 < top_p <= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"rollout.engine={self.engine!r}; allowed: {', '.join(ENGINES)}")
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(f"rollout.check_every={self.check_every!r}; expected an int >= 1")
        if not isinstance(self.greedy, bool):
            raise ValueError(f"rollout.greedy={self.greedy!r}; expected true or false")

    @classmethod
    def from_settings(cls, settings, *, greedy: bool = False) -> "RolloutConfig":
        """The engine's settings from a run's `trainer.rollout` (stppo.config.RolloutSettings)."""
        return cls(max_new_tokens=settings.max_new_tokens, max_total_tokens=settings.max_total_tokens,
                   temperature=settings.temperature, top_p=settings.top_p, greedy=greedy,
                   engine=settings.engine, check_every=settings.check_every,
                   cuda_graphs=settings.cuda_graphs)
