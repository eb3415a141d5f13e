"""JSON extraction: fill a Pydantic model from free text with schema-constrained generation, and
check every field against the record the sentence was written from.

    python examples/json_extraction.py [--url URL | --model PATH] [--limit N]

The sentences come from templates with known fields (seeded, so every run sees the same ones).
`gen(json_schema=Person)` masks every token that would leave the schema, so each output parses
and validates; whether the values are the right ones is up to the model, and the field accuracy
line says how often they are.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, Field, ValidationError

import plait as pl


class Person(BaseModel):
    name: str = Field(max_length=32)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=24)


NAMES = [
    "Alice Martin",
    "Kenji Sato",
    "Maria Lopez",
    "Tom Berg",
    "Priya Nair",
    "Ada Okafor",
    "Lukas Weber",
    "Emma Brown",
    "Omar Haddad",
    "Sofia Rossi",
]
CITIES = ["Paris", "Osaka", "Madrid", "Oslo", "Pune", "Lagos", "Vienna", "Boston", "Cairo", "Rome"]
TEMPLATES = [
    "{name} is {age} years old and lives in {city}.",
    "{name}, {age}, works in {city}.",
    "Meet {name} from {city}; {name_first} turned {age} this year.",
    "Our new colleague {name} ({age}) moved to {city} last month.",
]


def make_items(n: int, seed: int = 0) -> list[tuple[str, Person]]:
    """n (sentence, the record it states) pairs."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        person = Person(name=rng.choice(NAMES), age=rng.randint(18, 90), city=rng.choice(CITIES))
        text = TEMPLATES[i % len(TEMPLATES)].format(
            **person.model_dump(), name_first=person.name.split()[0]
        )
        items.append((text, person))
    return items


def field_matches(output: str, expected: Person) -> dict[str, bool] | None:
    """Per field, whether the output's value equals the expected one; None if it does not
    parse as a Person."""
    try:
        got = Person.model_validate_json(output)
    except ValidationError:
        return None
    return {f: getattr(got, f) == getattr(expected, f) for f in Person.model_fields}


@pl.function
def extract(s, text):
    s += pl.system("Extract the person described in the text as JSON with name, age and city.")
    s += pl.user(text)
    s += pl.assistant(pl.gen("person", json_schema=Person, max_tokens=64, temperature=0))


def main(limit: int = 40, backend: pl.Backend | None = None) -> dict[str, float]:
    items = make_items(limit)
    states = extract.run_batch([{"text": t} for t, _ in items], backend=backend)
    parsed, correct = 0, dict.fromkeys(Person.model_fields, 0)
    for (text, expected), state in zip(items, states):
        out = None if state.error() is not None else state["person"]
        matches = None if out is None else field_matches(out, expected)
        if matches is not None:
            parsed += 1
            for f, ok in matches.items():
                correct[f] += ok
        print(f"{text}\n  -> {out if out is not None else state.error()}")
    n = len(items)
    result = {"parsed": parsed / n, **{f: c / n for f, c in correct.items()}}
    result["fields"] = sum(correct.values()) / (n * len(correct))
    print(states.summary)
    per_field = ", ".join(f"{f} {correct[f] / n:.0%}" for f in correct)
    print(
        f"parsed {parsed}/{n} ({result['parsed']:.0%}); field accuracy "
        f"{result['fields']:.1%} ({per_field})"
    )
    return result


if __name__ == "__main__":
    from _common import run_example  # examples/ is on sys.path when a script runs

    run_example(__doc__, main, 40, "number of sentences")
