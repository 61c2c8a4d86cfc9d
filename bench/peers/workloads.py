"""The peer benchmark's workloads, built deterministically from a seed so every system gets the same requests.

    single   one request, 512 random prompt tokens, 128 output tokens: TTFT and decode tokens/s
    c<N>     N concurrent clients, unique 84-token random prompts, 128 output tokens (EOS banned); c=1..8 send
             2N requests (two waves), larger N send N (one burst)
    prefill1k  three 1,000-token random prompts in turn, 2 output tokens each: median TTFT (prefill speed)
    rag      questions (32 by default) over one ~1,500-token document (the same system message), 32 output tokens each
    chat     16 conversations x 4 turns; each turn carries the whole history (the replies actually produced)
    json     16 chat requests whose answer must follow a JSON schema (each peer's own structured-output
             feature; transformers has none, so its output is only prompted), validity rate reported

Random prompts are token ids in [256, vocab) (no special tokens); a fresh seed per round means no system
gets a prefix-cache hit from an earlier round.
"""

from __future__ import annotations

import random

from client import Req

VOCAB = 49152

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "skills", "employed"],
    "additionalProperties": False,
}

_PLACES = [
    "Ashford",
    "Brightwater",
    "Cold Harbor",
    "Dunmore",
    "Eastgate",
    "Fairview",
    "Glenrock",
    "Highmoor",
    "Ironbridge",
    "Juniper Hill",
    "Kingsport",
    "Lakeside",
    "Millbrook",
    "Northfield",
    "Oakridge",
    "Pinecrest",
]
_GOODS = [
    "copper wire",
    "wool blankets",
    "glass jars",
    "oak barrels",
    "rice sacks",
    "steel bolts",
    "olive oil",
    "paper reams",
]
_OWNERS = [
    "Mara Quinn",
    "Tobias Reed",
    "Lena Ortiz",
    "Viktor Hale",
    "Priya Nand",
    "Owen Marsh",
    "Sofia Brandt",
    "Jonah Wells",
]
_CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Hanoi", "Perth"]


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256, VOCAB) for _ in range(n)]


def single(seed: int) -> list[Req]:
    return [Req(ids=random_ids(random.Random(seed), 512), max_tokens=128, tag="single")]


def concurrent(seed: int, clients: int) -> list[Req]:
    rng = random.Random(seed * 1000 + clients)
    n = 2 * clients if clients <= 8 else clients
    return [Req(ids=random_ids(rng, 84), max_tokens=128, tag=f"c{clients}") for _ in range(n)]


def document(seed: int) -> tuple[str, list[tuple[str, str]]]:
    """A ~1,500-token inventory report and (place, good) pairs that questions can ask about."""
    rng = random.Random(seed)
    lines, facts = [], []
    for i, place in enumerate(_PLACES):
        lines.append(f"Section {i + 1}: the {place} depot.")
        for good in rng.sample(_GOODS, 5):
            n, owner = rng.randint(12, 980), rng.choice(_OWNERS)
            lines.append(f"The {place} depot holds {n} crates of {good}, checked last week by {owner}.")
            facts.append((place, good))
        lines.append(f"The {place} depot opens at {rng.randint(5, 9)} in the morning and ships by rail.")
    return " ".join(lines), facts


def rag(seed: int, questions: int = 64) -> list[Req]:
    doc, facts = document(seed)
    rng = random.Random(seed + 1)
    system = (
        "You answer questions about the inventory report below. Answer with one short sentence.\n\n"
        f"REPORT (round {seed}):\n{doc}"
    )
    reqs = []
    for place, good in rng.sample(facts, min(questions, len(facts))):
        q = f"How many crates of {good} does the {place} depot hold, and who checked them?"
        reqs.append(
            Req(
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=32,
                tag="rag",
            )
        )
    return reqs


def chat_openers(seed: int, conversations: int = 16) -> list[list[str]]:
    """For each conversation, its 4 user turns."""
    rng = random.Random(seed)
    topics = [
        "gardening",
        "chess",
        "bread baking",
        "sailing",
        "astronomy",
        "bicycles",
        "beekeeping",
        "pottery",
        "jazz",
        "hiking",
        "photography",
        "origami",
        "tea",
        "volcanoes",
        "knitting",
        "robots",
    ]
    out = []
    for c in range(conversations):
        t = topics[(c + seed) % len(topics)]
        out.append(
            [
                f"Hi! I'm new to {t}. What is the first thing I should learn? (conversation {seed}-{c})",
                f"Thanks. What mistake do beginners in {t} make most often?",
                f"How much time per week should I spend on {t} to improve, {rng.choice(['roughly', 'honestly'])}?",
                "Can you sum up your advice in two sentences?",
            ]
        )
    return out


def chat_turn(history: list[list[dict]], openers: list[list[str]], turn: int) -> list[Req]:
    """Requests of `turn` (0-based): each conversation's history plus its next user message."""
    reqs = []
    for h, turns in zip(history, openers, strict=True):
        h.append({"role": "user", "content": turns[turn]})
        reqs.append(Req(messages=[dict(m) for m in h], max_tokens=32, tag=f"chat{turn}"))
    return reqs


def json_requests(seed: int, n: int = 16, constrained: bool = True) -> list[Req]:
    rng = random.Random(seed)
    import json

    reqs = []
    for i in range(n):
        city = rng.choice(_CITIES)
        prompt = (
            f"Invent a fictional person #{seed}-{i} who lives in {city}. Reply with only a JSON object "
            f"matching this schema: {json.dumps(PERSON_SCHEMA)}"
        )
        reqs.append(
            Req(
                messages=[{"role": "user", "content": prompt}],
                schema=PERSON_SCHEMA if constrained else None,
                max_tokens=160,
                ignore_eos=False,
                tag="json",
            )
        )
    return reqs
