"""The oracle: the ideal policy of `synthetic_multihop`, played through a real `SearchEnv`.

For a question with plan [(query_1, doc_1, a_1), …, (query_h, doc_h, a_h)] the oracle writes
  '<search> {entity_k} {relation word_k}</search>'  for k = 1..h   (entity_1 = the subject,
                                                                    entity_{k+1} = a_k)
  '<answer> {a_h}</answer>'
(a space after the opening tag and none before the closing one: a name then tokenises as it does
inside documents, FEASIBILITY.md). With probability `error_rate` an episode holds one mistake,
at a site drawn uniformly among its h hops and its answer: a hop that queries a wrong entity of
the same kind (later hops follow the wrong chain through the world), or a wrong final answer;
either way the episode's answer is wrong. With probability `shortcut_rate` a multi-hop episode
is cut short instead (the careless searcher): after hop k of its h (k drawn uniformly from
1 … h − 1) it answers with the entity that hop found — an intermediate answer, of another kind or
another link of the chain than the one asked for, which reads like an answer in the retrieved
document. Draws use random.Random(f"{seed}/{question.id}") (the shortcut its own stream,
f"{seed}/{question.id}/shortcut", so that shortcut_rate = 0 leaves every episode as before), and
an episode does not depend on which other questions are played with it. Observations come from
the env and its retriever, so warm-start data matches rollouts token for token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from stppo.envs.actions import INVALID_ACTION_OBSERVATION, format_information
from stppo.envs.base import Question, StepResult, Task
from stppo.envs.prompts import build_prompt
from stppo.envs.rewards import normalize_answer
from stppo.envs.synthetic_world import RELATIONS, World


@dataclass
class Episode:
    question: Question
    prompt: str
    turns: list[tuple[str, StepResult]] = field(default_factory=list)  # (action text, result)
    score: float = 0.0  # env.score of the last answer

    @property
    def answer(self) -> str | None:
        answers = [r.answer for _, r in self.turns if r.kind == "answer"]
        return answers[-1] if answers else None


def _other(world: World, kind: str, avoid: Sequence[str], rng: random.Random) -> str:
    """A random entity of `kind` that is none of `avoid` (normalised comparison)."""
    banned = {normalize_answer(a) for a in avoid}
    pool = [n for n in world.of_kind(kind) if normalize_answer(n) not in banned]
    return rng.choice(pool or world.of_kind(kind))


def oracle_actions(question: Question, world: World, error_rate: float = 0.0,
                   seed: int = 0, shortcut_rate: float = 0.0) -> list[str]:
    """The oracle's action texts for one question (h searches, then the answer; fewer searches
    when the episode is cut short)."""
    chain, subject = question.meta.get("chain"), question.meta.get("subject")
    if not chain or subject is None:
        raise ValueError(f"oracle: question {question.id!r} has no meta['chain'/'subject']; the "
                         "oracle plays synthetic_multihop questions only")
    rng = random.Random(f"{seed}/{question.id}")
    site = rng.randrange(len(chain) + 1) if rng.random() < error_rate else None
    entity, actions, found = subject, [], []
    for k, rel in enumerate(chain):
        relation = RELATIONS[rel]
        if k == site:
            entity = _other(world, relation.subject, [entity], rng)
        actions.append(f"<search> {entity} {relation.word}</search>")
        entity = world.lookup(rel, entity) or _other(world, relation.object, [], rng)
        found.append(entity)  # what search k + 1 finds
    if site is not None and normalize_answer(entity) in map(normalize_answer, question.golden_answers):
        entity = _other(world, RELATIONS[chain[-1]].object, question.golden_answers, rng)
    cut = _shortcut(question, len(chain), seed, shortcut_rate)
    if cut is not None:  # answer with what the last search kept found
        actions, entity = actions[:cut], found[cut - 1]
    actions.append(f"<answer> {entity}</answer>")
    return actions


def _shortcut(question: Question, hops: int, seed: int, rate: float) -> int | None:
    """The number of searches after which a cut-short episode answers, or None."""
    if hops < 2 or rate <= 0.0:
        return None
    rng = random.Random(f"{seed}/{question.id}/shortcut")
    return rng.randint(1, hops - 1) if rng.random() < rate else None


def run_oracle(env, task: Task, questions: Sequence[Question], *, error_rate: float = 0.0,
               seed: int = 0, shortcut_rate: float = 0.0) -> list[Episode]:
    """Play the oracle on `questions` through `env` (a SearchEnv), all episodes in lock step:
    one `env.step_batch` (hence one retriever call) per turn."""
    world = getattr(task, "world", None)
    if world is None:
        raise ValueError(f"oracle: task {task.name!r} has no world; the oracle plays "
                         "synthetic_multihop tasks only")
    for name, rate in (("error_rate", error_rate), ("shortcut_rate", shortcut_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"oracle {name} must be in [0, 1], got {rate}")
    plans = [oracle_actions(q, world, error_rate, seed, shortcut_rate) for q in questions]
    too_long = [(q.id, len(p)) for q, p in zip(questions, plans) if len(p) > env.max_turns]
    if too_long:
        qid, n = too_long[0]
        raise ValueError(f"oracle: question {qid!r} needs {n} turns but env max_turns="
                         f"{env.max_turns}; raise max_turns or lower the 3-hop share (hop_mix)")
    episodes = [Episode(q, env.prompt(q)) for q in questions]
    active = list(range(len(questions)))
    turn = 0
    while active:
        results = env.step_batch([questions[i] for i in active], [plans[i][turn] for i in active],
                                 [turn] * len(active))
        for i, res in zip(active, results):
            episodes[i].turns.append((plans[i][turn], res))
        active = [i for i, res in zip(active, results) if not res.done]
        turn += 1
    for ep in episodes:
        ep.score = env.score(ep.question, ep.answer)
    return episodes


def tokenizer_texts(task: Task, env=None, *, prompt_styles: Sequence[str] = ("compact", "search_r1"),
                    ) -> Iterator[str]:
    """Every kind of text a policy reads or writes on `task`, for training a tokenizer: corpus
    documents in their observation form, the corrective observation, the prompts of every split
    (in `env`'s style, else in `prompt_styles`) and the oracle's actions (gold answers for tasks
    without a world)."""
    for doc in task.corpus:
        yield format_information([doc])
    yield INVALID_ACTION_OBSERVATION
    world = getattr(task, "world", None)
    for split in task.splits:
        for q in task.split(split):
            if env is not None:
                yield env.prompt(q)
            else:
                yield from (build_prompt(q, style) for style in prompt_styles)
            if world is not None:
                yield from oracle_actions(q, world)
            else:
                yield from (f"<answer> {g}</answer>" for g in q.golden_answers)
