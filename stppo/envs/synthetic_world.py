"""A seeded fictional world: entities with generated pronounceable names and typed relations.

Every random choice draws from one `random.Random(seed)` in a fixed order over lists (never sets
or hash-ordered containers), so the same config gives the same world byte for byte. No name word
is a substring of another (case-insensitive), so no entity name hides inside another one.

Relations (all functional: a subject has at most one object):
  born_in           person  → city     "{s} was born in {o}."
  works_for         person  → org      "{s} works for {o}."
  founded_by        org     → person   "{s} was founded by {o}."
  headquartered_in  org     → city     "{s} is headquartered in {o}."
  located_in        city    → country  "{s} is located in {o}."
  has_capital       country → city     "The capital of {s} is {o}."  (a city located in {s})
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("person", "city", "country", "org")


@dataclass(frozen=True)
class Relation:
    name: str
    subject: str  # entity kind
    object: str  # entity kind
    word: str  # the relation word of the oracle's query "{entity} {word}"; appears in the text
    text: str  # the fact document's text template


RELATIONS = {r.name: r for r in (
    Relation("born_in", "person", "city", "born", "{s} was born in {o}."),
    Relation("works_for", "person", "org", "works", "{s} works for {o}."),
    Relation("founded_by", "org", "person", "founded", "{s} was founded by {o}."),
    Relation("headquartered_in", "org", "city", "headquartered", "{s} is headquartered in {o}."),
    Relation("located_in", "city", "country", "located", "{s} is located in {o}."),
    Relation("has_capital", "country", "city", "capital", "The capital of {s} is {o}."),
)}

# Distractor sentences about an entity: no relation word, sometimes naming another entity.
DISTRACTORS = {
    "person": ("{s} enjoys {hobby}.", "{s} once visited {city}.", "{s} wrote a book about {topic}.",
               "{s} is a friend of {person}."),
    "city": ("{s} is known for its {thing}.", "Many travellers from {city} visit {s}.",
             "{s} hosts a yearly {event}."),
    "country": ("{s} is famous for its {thing}.", "{s} borders {country}.",
                "{s} exports {goods}."),
    "org": ("{s} sponsors a {event}.", "{s} employs many {staff}.", "{s} has an office near {city}."),
}
FILLERS = {
    "hobby": ("sailing", "painting", "chess", "gardening", "archery", "pottery", "astronomy"),
    "topic": ("rivers", "old maps", "music", "bridges", "clocks", "birds", "trade routes"),
    "thing": ("markets", "bridges", "gardens", "festivals", "harbour", "libraries", "towers"),
    "event": ("music festival", "boat race", "book fair", "chess tournament", "harvest fair"),
    "goods": ("wool", "timber", "salt", "copper", "tea", "glassware", "spices"),
    "staff": ("engineers", "writers", "chemists", "sailors", "designers", "clerks"),
}

# Mostly plain consonants and vowels (repeats weight the draw): short, pronounceable names.
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ae", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "nd", "rn", "m", "x", "k")
_CITY_SUFFIXES = ("holm", "ford", "mere", "grad", "wick", "haven", "burg", "dale")
_COUNTRY_SUFFIXES = ("ia", "land", "mark", "stan", "ora")
# No kind word may be a relation word ("Works" would match every "works for" query).
_ORG_KINDS = ("Industries", "Labs", "Group", "Guild", "Mills", "Systems", "Holdings", "Institute",
              "Trading", "Foundry")


# Template words a name must not equal (a name "Born" would blur the "{x} born" queries).
_RESERVED = frozenset(
    w.strip(".{}").lower() for r in RELATIONS.values() for w in (r.word, *r.text.split())
) | frozenset(w.strip(".{}").lower() for ts in DISTRACTORS.values() for t in ts for w in t.split()
              ) | frozenset(w.lower() for v in FILLERS.values() for x in v for w in x.split())


@dataclass(frozen=True)
class Entity:
    name: str
    kind: str  # one of KINDS


@dataclass(frozen=True)
class Fact:
    relation: str  # a key of RELATIONS
    subject: str  # entity name
    object: str  # entity name


@dataclass
class World:
    entities: list[Entity]
    facts: list[Fact]
    _lookup: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._lookup = {(f.relation, f.subject): f.object for f in self.facts}
        self._kind = {e.name: e.kind for e in self.entities}

    def lookup(self, relation: str, subject: str) -> str | None:
        """The object of (relation, subject), or None when the subject has no such fact."""
        return self._lookup.get((relation, subject))

    def kind(self, name: str) -> str:
        return self._kind[name]

    def of_kind(self, kind: str) -> list[str]:
        return [e.name for e in self.entities if e.kind == kind]


class _Namer:
    """Draws unique name words; no word is a substring of another (case-insensitive)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words: list[str] = []

    def _ok(self, word: str) -> bool:
        w = word.lower()
        return w not in _RESERVED and all(w not in o and o not in w for o in self.words)

    def word(self, syllables: int, suffixes: tuple[str, ...] = ("",)) -> str:
        for _ in range(10_000):
            core = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS)
                           for _ in range(syllables))
            word = (core + self.rng.choice(_CODAS) + self.rng.choice(suffixes)).capitalize()
            if self._ok(word):
                self.words.append(word.lower())
                return word
        raise ValueError("synthetic world: ran out of distinct names; lower the entity counts")


def _names(rng: random.Random, n_people: int, n_cities: int, n_countries: int,
           n_orgs: int) -> dict[str, list[str]]:
    namer = _Namer(rng)
    countries = [namer.word(2, _COUNTRY_SUFFIXES) for _ in range(n_countries)]
    cities = [namer.word(2, _CITY_SUFFIXES) for _ in range(n_cities)]
    orgs = [f"{namer.word(2)} {rng.choice(_ORG_KINDS)}" for _ in range(n_orgs)]
    first = [namer.word(2) for _ in range(max(8, n_people // 3))]  # first names recur
    people = [f"{rng.choice(first)} {namer.word(rng.choice((1, 2)))}" for _ in range(n_people)]
    return {"person": people, "city": cities, "country": countries, "org": orgs}


def build_world(rng: random.Random, n_people: int, n_cities: int, n_countries: int, n_orgs: int,
                works_for_frac: float) -> World:
    """Entities and facts of the world (see the module docstring for the relations)."""
    names = _names(rng, n_people, n_cities, n_countries, n_orgs)
    entities = [Entity(n, kind) for kind in KINDS for n in names[kind]]
    people, cities, countries, orgs = (names[k] for k in ("person", "city", "country", "org"))
    facts: list[Fact] = []
    shuffled = cities[:]
    rng.shuffle(shuffled)
    country_of = {c: countries[i % len(countries)] for i, c in enumerate(shuffled)}
    for city in cities:
        facts.append(Fact("located_in", city, country_of[city]))
    for i, country in enumerate(countries):  # the first city dealt to a country is its capital
        facts.append(Fact("has_capital", country, shuffled[i]))
    for person in people:
        facts.append(Fact("born_in", person, rng.choice(cities)))
    for org in orgs:
        facts.append(Fact("headquartered_in", org, rng.choice(cities)))
        facts.append(Fact("founded_by", org, rng.choice(people)))
    workers = rng.sample(people, round(works_for_frac * len(people)))
    for person in people:  # keep the world's person order, not the sample's
        if person in workers:
            facts.append(Fact("works_for", person, rng.choice(orgs)))
    return World(entities, facts)


def distractor_texts(world: World, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """`n` (title, text) distractor documents, dealt over the entities in a shuffled order."""
    order = world.entities[:]
    rng.shuffle(order)
    pools = {k: world.of_kind(k) for k in KINDS}
    out = []
    for i in range(n):
        ent = order[i % len(order)]
        templates = DISTRACTORS[ent.kind]
        template = templates[(i // len(order) + rng.randrange(4)) % len(templates)]
        others = {k: rng.choice([x for x in pools[k] if x != ent.name] or pools[k]) for k in KINDS}
        fill = {k: rng.choice(v) for k, v in FILLERS.items()}
        out.append((ent.name, template.format(s=ent.name, **others, **fill)))
    return out
