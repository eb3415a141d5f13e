"""JSON extraction: fill a Pydantic model from free text with schema-constrained generation.

    python examples/json_extraction.py [--url http://127.0.0.1:30000] [--docs 4]

`gen(json_schema=Model)` masks every token that would leave the schema, so the output parses
as the model whatever the weights (the default model's are random: the values are arbitrary,
their types and bounds are not). Bounded fields keep the JSON short enough to finish within
`max_tokens`.
"""

from __future__ import annotations

import argparse
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

import plait as pl


class Contact(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=16)
    role: Literal["customer", "employee", "partner"]
    vip: bool


DOCS = [
    "Maria Lopez, 34, a long-time customer from Madrid, asked about her VIP upgrade.",
    "Our new employee Kenji Sato (29) starts next week in the Osaka office.",
    "Partner contact: Ada Okafor, 41, based in Lagos; not a VIP account.",
    "Tom Berg from Oslo, 58, called again about his order. He is a regular customer.",
    "Priya Nair, 23, joined the Pune team as an employee in March.",
    "Lukas Weber (47), partner from Vienna, VIP since 2019.",
]


@pl.function
def extract(s, doc):
    s += pl.system("Extract the contact described in the text as JSON.")
    s += pl.user(doc)
    s += pl.assistant(pl.gen("contact", json_schema=Contact, max_tokens=96, temperature=0))


def main(n_docs: int = 4, backend: pl.Backend | None = None) -> list[Contact | None]:
    docs = [DOCS[i % len(DOCS)] for i in range(n_docs)]
    states = extract.run_batch([{"doc": d} for d in docs], backend=backend)
    contacts: list[Contact | None] = []
    for doc, state in zip(docs, states):
        print("text:   ", doc)
        if state.error() is not None:
            print("failed: ", state.error())
            contacts.append(None)
            continue
        meta = state.get_meta_info("contact")
        try:
            contact = Contact.model_validate_json(state["contact"])
        except ValidationError as e:  # only if generation stopped at max_tokens mid-object
            print(f"invalid ({meta['finish_reason']}): {state['contact']!r}\n  {e}")
            contacts.append(None)
            continue
        print("parsed: ", repr(contact))
        print(
            f"tokens:  {meta['completion_tokens']} generated, "
            f"{meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens cached\n"
        )
        contacts.append(contact)
    print(states.summary)
    return contacts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `plait serve` (default: the embedded model)")
    parser.add_argument("--docs", type=int, default=4)
    args = parser.parse_args()
    backend = pl.RuntimeEndpoint(args.url) if args.url else pl.EngineBackend()
    pl.set_default_backend(backend)
    try:
        main(args.docs)
    finally:
        backend.shutdown()
