"""A generated encyclopedia of fictional entities and questions whose answers exist only in it (issue: search
tools). No pretrained model knows these names, so a gain on the questions can only come from searching.

`World(world)` builds the same entities for the same `world` number: countries, cities (each in a country),
people (born in a city in a year, with an occupation) and organizations (founded by a person in a year,
headquartered in a city). `corpus(world)` is its passages (id, title, text): two per person (birth; work),
one per city and one per organization, so a fact sits in one passage and its neighbours are distractors that
share names and words. `questions(world, split, n, seed)` asks 1-hop and 2-hop questions: every fact is
either a training fact or a held-out one (by a hash of the entity and relation), and a question belongs to the
split of the facts it chains (both, for 2-hop); held-out questions ask only what training questions never do. Each record's
source is its hop count ("1-hop", "2-hop": pass@k is reported per source) and its `metadata` holds the
supporting passage ids and the relation chain.

As a task: `data.task="entities"` (`generate`; options {"two_hop_share": 0.5}: the training records come from
the training facts, the held-out evaluation's from the held-out ones) over the corpus "rlax.data.entities:corpus"
(world 0), the search environment's `env.corpus` (configs/search_tool.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from rlax.data.records import Record

# Plain syllables (one consonant, one vowel, an optional coda): names a small model can copy into a query
# letter for letter, and that tokenize short.
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "h"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "n", "r", "l", "s"]
_JOBS = ["cartographer", "glassblower", "astronomer", "shipwright", "botanist", "archivist", "composer", "engineer",
         "weaver", "miller", "printer", "surveyor", "apothecary", "clockmaker", "mason", "beekeeper"]
_KINDS = ["guild", "company", "academy", "society", "foundry", "observatory"]
SPLITS = ("train", "heldout")


def _word(rng: random.Random, syllables: int) -> str:
  return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


@dataclasses.dataclass(frozen=True)
class World:
  """The entities of world number `world`; sizes grow with `scale` (1: 16 countries, 24 cities, 96 people, 32
  organizations)."""
  world: int = 0
  scale: int = 1

  def __post_init__(self):
    rng = random.Random(f"entities/{self.world}/{self.scale}")
    used: set[str] = set()

    def name(syllables: int, words: int = 1) -> str:
      while True:
        n = " ".join(_word(rng, syllables) for _ in range(words))
        if n not in used:
          used.add(n)
          return n

    countries = [name(2) for _ in range(16 * self.scale)]  # enough that guessing the commonest one scores little
    cities = {name(2): rng.choice(countries) for _ in range(24 * self.scale)}
    people = {name(2, 2): (rng.choice(list(cities)), rng.randrange(1650, 1900), rng.choice(_JOBS))
              for _ in range(96 * self.scale)}
    orgs = {f"{name(3)} {rng.choice(_KINDS).title()}": (rng.choice(list(people)), rng.randrange(1700, 1950),
                                                         rng.choice(list(cities)))
            for _ in range(32 * self.scale)}
    for k, v in dict(countries=countries, cities=cities, people=people, orgs=orgs).items():
      object.__setattr__(self, k, v)

  def passages(self) -> list[dict]:
    out = []
    for c, country in self.cities.items():
      out.append(dict(id=f"city/{c}", title=c, text=f"{c} is a city in {country}."))
    for p, (city, year, job) in self.people.items():
      out.append(dict(id=f"person/{p}/birth", title=p, text=f"{p} was born in {city} in {year}."))
      out.append(dict(id=f"person/{p}/work", title=p, text=f"{p} worked as a {job}."))
    for o, (founder, year, hq) in self.orgs.items():
      out.append(dict(id=f"org/{o}", title=o,
                      text=f"The {o} was founded by {founder} in {year}. Its headquarters are in {hq}."))
    return out

  def facts(self) -> list[tuple[str, str, str, str]]:
    """(subject, relation, answer, supporting passage id) for every fact."""
    out = [(c, "country", k, f"city/{c}") for c, k in self.cities.items()]
    for p, (city, year, job) in self.people.items():
      out += [(p, "birthplace", city, f"person/{p}/birth"), (p, "birth_year", str(year), f"person/{p}/birth"),
              (p, "occupation", job, f"person/{p}/work")]
    for o, (founder, year, hq) in self.orgs.items():
      out += [(o, "founder", founder, f"org/{o}"), (o, "founded", str(year), f"org/{o}"),
              (o, "headquarters", hq, f"org/{o}")]
    return out


def split_of(subject: str, relation: str, heldout_share: float = 0.25) -> str:
  """The split of a fact: a hash of (subject, relation), so it does not depend on which questions are drawn."""
  h = int.from_bytes(hashlib.sha256(f"{subject}|{relation}".encode()).digest()[:8], "big") / 2 ** 64
  return "heldout" if h < heldout_share else "train"


_ONE_HOP = {"country": "In which country is the city of {s}?", "birthplace": "In which city was {s} born?",
            "birth_year": "In which year was {s} born?", "occupation": "What did {s} work as?",
            "founder": "Who founded the {s}?", "founded": "In which year was the {s} founded?",
            "headquarters": "In which city are the headquarters of the {s}?"}
# (first relation, second relation): the second is asked of the first's answer.
_TWO_HOP = {("birthplace", "country"): "In which country was {s} born?",
            ("headquarters", "country"): "In which country are the headquarters of the {s}?",
            ("founder", "birthplace"): "In which city was the founder of the {s} born?",
            ("founder", "birth_year"): "In which year was the founder of the {s} born?",
            ("founder", "occupation"): "What did the founder of the {s} work as?"}


def questions(world: World, split: str, n: int, seed: int, two_hop_share: float = 0.5) -> list[Record]:
  """`n` questions of `split` ("train" or "heldout"), about half of them 2-hop; the same (world, split, seed)
  gives the same records. A question's split is that of the facts it chains (a 2-hop question's two)."""
  if split not in SPLITS:
    raise ValueError(f"entities: split={split!r}; use one of {SPLITS}")
  by = {(s, r): (a, pid) for s, r, a, pid in world.facts()}
  one = [(s, r) for (s, r) in by if split_of(s, r) == split]
  two = [(s, r1, r2) for (s, r1), (mid, _) in by.items() for (first, r2) in _TWO_HOP
         if first == r1 and (mid, r2) in by and split_of(mid, r2) == split and split_of(s, r1) == split]
  if not one or not two:
    raise ValueError(f"entities: world {world.world} has no {split} questions")
  rng = random.Random(f"entities/questions/{world.world}/{split}/{seed}")
  out = []
  for i in range(n):
    if rng.random() < two_hop_share:
      s, r1, r2 = rng.choice(two)
      mid, pid1 = by[(s, r1)]
      answer, pid2 = by[(mid, r2)]
      text, chain, support = _TWO_HOP[(r1, r2)].format(s=s), [r1, r2], [pid1, pid2]
    else:
      s, r = rng.choice(one)
      answer, pid = by[(s, r)]
      text, chain, support = _ONE_HOP[r].format(s=s), [r], [pid]
    out.append(Record(id=f"entities-{world.world}-{split}-{seed}-{i}", prompt=text, answer=answer, task="search_qa",
                      source=f"{len(chain)}-hop", metadata={"hops": len(chain), "relations": chain,
                                                            "support_ids": support, "split": split}))
  return out


def corpus(world: int = 0) -> list[dict]:
  """World `world`'s passages: the corpus of the `entities` task (env.corpus="rlax.data.entities:corpus")."""
  return World(world).passages()


def generate(n: int, difficulty: int = 1, seed: int = 0, split: str = "train", two_hop_share: float = 0.5
             ) -> list[Record]:
  """The `entities` task's records of world 0 (rlax.data.synthetic.GENERATORS); `difficulty` is unused: the hop
  mix is `two_hop_share`."""
  del difficulty
  return questions(World(0), "heldout" if split == "eval" else "train", n, seed, two_hop_share=float(two_hop_share))
