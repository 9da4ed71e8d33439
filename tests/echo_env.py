"""An `AgentEnv` for rollout tests: every turn is answered with one fixed observation, and the
episode ends after `max_turns` (importable from any test module, like servers.py)."""

from stppo.envs.base import StepResult


class EchoEnv:
    def __init__(self, max_turns: int = 3,
                 observation: str = "\n<information> Alice was born in Lyon.</information>\n"):
        self.max_turns, self.observation = max_turns, observation

    def prompt(self, q):
        return f"Question: {q.question}\n"

    def step_batch(self, questions, actions, turns):
        return [StepResult("invalid", self.observation, False) for _ in actions]

    def score(self, q, answer):
        return 0.0
