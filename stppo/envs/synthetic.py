"""`synthetic_multihop`: the embedded default task, built from a seeded fictional world.

Corpus: one short document per fact (title = the subject entity, e.g. "Elara Voss" /
"Elara Voss was born in Tarnhelm.") plus distractor documents about the same entities.
Questions: 1-, 2- and 3-hop compositions of the relations, e.g.
  2 hops  "In which country was {person} born?"  = located_in(born_in(person)).
The answer never appears in the question text, and every name is invented, so the answer can only
be found by searching. Each question carries its oracle plan in `meta`:
  meta['hops']     number of hops h
  meta['plan']     [(query, gold doc id, intermediate answer)] × h, query = "{entity} {word}"
  meta['chain']    the relation names, meta['subject'] the entity named in the question.
Splits 'sft' (warm start), 'train' (RL), 'val', 'test' never share a question (deduplicated by
text); each split's hop counts follow `hop_mix` (largest-remainder rounding).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from stppo.envs.base import Doc, Question, Task
from stppo.envs.rewards import normalize_answer
from stppo.envs.synthetic_world import RELATIONS, World, build_world, distractor_texts

SPLITS = ("sft", "train", "val", "test")

# (relation chain, question template); {e} is the subject entity.
TEMPLATES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("born_in",), "Where was {e} born?"),
    (("works_for",), "Which organisation does {e} work for?"),
    (("founded_by",), "Who founded {e}?"),
    (("headquartered_in",), "Where is {e} headquartered?"),
    (("located_in",), "Which country is {e} located in?"),
    (("has_capital",), "What is the capital of {e}?"),
    (("born_in", "located_in"), "In which country was {e} born?"),
    (("works_for", "headquartered_in"), "Where is the organisation that {e} works for headquartered?"),
    (("works_for", "founded_by"), "Who founded the organisation that {e} works for?"),
    (("founded_by", "born_in"), "Where was the founder of {e} born?"),
    (("founded_by", "works_for"), "Which organisation does the founder of {e} work for?"),
    (("headquartered_in", "located_in"), "In which country is {e} headquartered?"),
    (("works_for", "headquartered_in", "located_in"),
     "In which country is the organisation that {e} works for headquartered?"),
    (("founded_by", "born_in", "located_in"), "In which country was the founder of {e} born?"),
    (("born_in", "located_in", "has_capital"),
     "What is the capital of the country where {e} was born?"),
    (("works_for", "founded_by", "born_in"),
     "Where was the founder of the organisation that {e} works for born?"),
    (("headquartered_in", "located_in", "has_capital"),
     "What is the capital of the country where {e} is headquartered?"),
)


@dataclass
class SyntheticConfig:
    """Sizes of the world and of the question splits. The defaults are the world of
    `task=synthetic_multihop` (and of the testbed, which asks more multi-hop and RL questions in
    it: conf/task/testbed.yaml); `task.options.<field>` changes one."""
    seed: int = 0  # the world's seed (fixed across a study: every run sees the same world)
    n_people: int = 300
    n_cities: int = 80
    n_countries: int = 20
    n_orgs: int = 60
    works_for_frac: float = 2 / 3  # fraction of people with a works_for fact
    n_distractors: int = 400  # distractor documents, dealt over the entities
    # fractions of 1-, 2-, 3-hop questions (a list in the config, a tuple once built)
    hop_mix: list[float] = field(default_factory=lambda: [0.4, 0.4, 0.2])
    n_sft: int = 800  # warm-start questions (disjoint from all others)
    n_train: int = 400
    n_val: int = 200  # ≥ 200: 100 questions give ±5 points of noise
    n_test: int = 200

    def __post_init__(self) -> None:
        self.hop_mix = tuple(float(x) for x in self.hop_mix)  # type: ignore[assignment]
        for name in ("n_people", "n_cities", "n_countries", "n_orgs"):
            if getattr(self, name) < 2:
                raise ValueError(f"synthetic.{name} must be >= 2, got {getattr(self, name)}")
        if self.n_cities < self.n_countries:
            raise ValueError(f"synthetic.n_cities={self.n_cities} must be >= n_countries="
                             f"{self.n_countries} (every country needs a capital)")
        if not 0.0 <= self.works_for_frac <= 1.0:
            raise ValueError(f"synthetic.works_for_frac must be in [0, 1], got {self.works_for_frac}")
        if len(self.hop_mix) != 3 or min(self.hop_mix) < 0 or abs(sum(self.hop_mix) - 1) > 1e-6:
            raise ValueError(f"synthetic.hop_mix must be 3 non-negative fractions (1, 2, 3 hops) "
                             f"summing to 1, got {self.hop_mix}")
        for name in ("n_distractors", "n_sft", "n_train", "n_val", "n_test"):
            if getattr(self, name) < 0:
                raise ValueError(f"synthetic.{name} must be >= 0, got {getattr(self, name)}")

    def split_sizes(self) -> dict[str, int]:
        return {"sft": self.n_sft, "train": self.n_train, "val": self.n_val, "test": self.n_test}


@dataclass
class SyntheticTask(Task):
    """A `Task` that also keeps its world (the oracle reads facts from it)."""
    world: World | None = field(default=None, repr=False)
    config: SyntheticConfig | None = None


def build_corpus(world: World, rng: random.Random, n_distractors: int) -> tuple[list[Doc], dict]:
    """Fact + distractor documents in a shuffled order, ids 'syn-0000'…; and the gold doc id of
    each (relation, subject)."""
    items = [(f.subject, RELATIONS[f.relation].text.format(s=f.subject, o=f.object),
              (f.relation, f.subject)) for f in world.facts]
    items += [(title, text, None) for title, text in distractor_texts(world, rng, n_distractors)]
    rng.shuffle(items)
    width = max(4, len(str(len(items))))
    corpus, gold = [], {}
    for i, (title, text, key) in enumerate(items):
        doc = Doc(id=f"syn-{i:0{width}d}", title=title, text=text)
        corpus.append(doc)
        if key is not None:
            gold[key] = doc.id
    return corpus, gold


def candidate_questions(world: World, gold: dict) -> dict[int, list[dict]]:
    """Every answerable (template, subject) question, deduplicated by text, grouped by hops."""
    seen: set[str] = set()
    pools: dict[int, list[dict]] = {1: [], 2: [], 3: []}
    for chain, template in TEMPLATES:
        for subject in world.of_kind(RELATIONS[chain[0]].subject):
            plan, entity = [], subject
            for rel in chain:
                obj = world.lookup(rel, entity)
                if obj is None:
                    break
                plan.append((f"{entity} {RELATIONS[rel].word}", gold[(rel, entity)], obj))
                entity = obj
            else:
                text = template.format(e=subject)
                if text in seen or normalize_answer(entity) in normalize_answer(text):
                    continue
                seen.add(text)
                pools[len(chain)].append({"question": text, "answer": entity, "plan": plan,
                                          "chain": chain, "subject": subject})
    return pools


def _allocate(total: int, mix: tuple[float, ...]) -> list[int]:
    """Largest-remainder split of `total` by the fractions `mix` (ties → fewer hops)."""
    raw = [total * m for m in mix]
    counts = [int(r) for r in raw]
    order = sorted(range(len(mix)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def build_splits(pools: dict[int, list[dict]], cfg: SyntheticConfig, rng: random.Random,
                 name: str = "synthetic_multihop") -> dict[str, list[Question]]:
    sizes = cfg.split_sizes()
    per_split = {s: _allocate(n, cfg.hop_mix) for s, n in sizes.items()}
    for h in (1, 2, 3):
        need = sum(per_split[s][h - 1] for s in SPLITS)
        if need > len(pools[h]):
            raise ValueError(
                f"synthetic task: the splits need {need} {h}-hop questions but the world has "
                f"{len(pools[h])}; lower n_sft/n_train/n_val/n_test, change hop_mix, or enlarge "
                "the world (n_people, n_orgs, …)")
        rng.shuffle(pools[h])
    splits: dict[str, list[Question]] = {}
    taken = {1: 0, 2: 0, 3: 0}
    for split in SPLITS:
        rows = []
        for h in (1, 2, 3):
            n = per_split[split][h - 1]
            rows += pools[h][taken[h]: taken[h] + n]
            taken[h] += n
        rng.shuffle(rows)
        splits[split] = [
            Question(id=f"{split}-{i:04d}", question=r["question"], golden_answers=(r["answer"],),
                     meta={"hops": len(r["chain"]), "plan": r["plan"], "chain": r["chain"],
                           "subject": r["subject"], "data_source": name})
            for i, r in enumerate(rows)]
    return splits


def synthetic_config(name: str, options: dict) -> SyntheticConfig:
    """`SyntheticConfig` of `options` (its fields); an unknown one is one ValueError line."""
    unknown = sorted(set(options) - set(SyntheticConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; valid: "
                         f"{', '.join(SyntheticConfig.__dataclass_fields__)}")
    return SyntheticConfig(**options)


def synthetic_options(name: str, options) -> dict:
    """Every field of the world `options` (a mapping of fields, or a `SyntheticConfig`) asks
    for, its default where they say nothing: the values a run records (`stppo.config.TaskConfig`)."""
    c = synthetic_config(name, asdict(options) if isinstance(options, SyntheticConfig) else options)
    return {**asdict(c), "hop_mix": list(c.hop_mix)}


def build_synthetic_task(config: SyntheticConfig | None = None, *, name: str = "synthetic_multihop",
                         **overrides) -> SyntheticTask:
    """The synthetic_multihop task (named `name`); `overrides` are `SyntheticConfig` fields."""
    if config is None:
        config = synthetic_config(name, overrides)
    elif overrides:
        raise ValueError("synthetic_multihop: pass either config or field overrides, not both")
    rng = random.Random(config.seed)
    world = build_world(rng, config.n_people, config.n_cities, config.n_countries,
                        config.n_orgs, config.works_for_frac)
    corpus, gold = build_corpus(world, rng, config.n_distractors)
    splits = build_splits(candidate_questions(world, gold), config, rng, name)
    return SyntheticTask(name=name, corpus=corpus, splits=splits, reward="em",
                         world=world, config=config)
