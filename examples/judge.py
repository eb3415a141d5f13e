"""LLM-as-judge: grade a batch of answers against one shared rubric.

    python examples/judge.py [--url http://127.0.0.1:30000] [--items 50]

Every item is the same system prompt (the rubric) plus its own question and answer; `select`
scores the five grades by their log-probabilities in one batched request. `run_batch` traces
the items, prefills the shared rubric once, and the radix cache serves it to every item: the
summary's cached-token fraction shows it. (The default model has random weights: the grades
are arbitrary, the structure is real.)
"""

from __future__ import annotations

import argparse
import random

import plait as pl

GRADES = ["excellent", "good", "fair", "poor", "wrong"]

RUBRIC = """You are a strict, fair grader. Read the question and the answer, then grade the answer.
- excellent: correct, complete, and clearly explained.
- good: correct with minor omissions.
- fair: partly correct, or correct but poorly explained.
- poor: mostly incorrect or irrelevant.
- wrong: incorrect, or no answer at all.
Judge only the content; ignore style, length, and spelling. Reply with the grade only."""

TOPICS = [
    "photosynthesis",
    "binary search",
    "inflation",
    "plate tectonics",
    "recursion",
    "vaccines",
    "supply and demand",
    "the water cycle",
    "TCP handshakes",
    "entropy",
]


@pl.function
def judge(s, question, answer):
    s += pl.system(RUBRIC)
    s += pl.user(f"Question: {question}\nAnswer: {answer}")
    s += pl.assistant(pl.select("grade", GRADES))


def make_items(n: int) -> list[dict[str, str]]:
    rng = random.Random(0)
    items = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        other = rng.choice(TOPICS)
        items.append(
            {
                "question": f"In two sentences, explain {topic}.",
                "answer": f"{topic.capitalize()} is closely related to {other}; item {i}.",
            }
        )
    return items


def main(n_items: int = 50, backend: pl.Backend | None = None, progress_bar: bool = True):
    items = make_items(n_items)
    states = judge.run_batch(items, backend=backend, progress_bar=progress_bar, temperature=0)
    for i, state in enumerate(states):
        if state.error() is not None:
            print(f"{i:3d}  failed: {state.error()}")
            continue
        scores = state.get_meta_info("grade")["scores"]  # mean token logprob per grade
        print(
            f"{i:3d}  {state['grade']:<9}  score {max(scores):7.3f}  "
            f"spread {max(scores) - min(scores):6.3f}  | {items[i]['question']}"
        )
    counts = {g: sum(st["grade"] == g for st in states if st.error() is None) for g in GRADES}
    print("grades:", counts)
    summary = states.summary
    print(summary)  # programs, requests, prompt tokens (cached share), wall time
    print(
        f"cached-token fraction: {summary.cached_token_fraction:.1%} "
        f"(shared prefix: {summary.common_prefix_chars} chars)"
    )
    return states


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `plait serve` (default: the embedded model)")
    parser.add_argument("--items", type=int, default=50)
    args = parser.parse_args()
    backend = pl.RuntimeEndpoint(args.url) if args.url else pl.EngineBackend()
    pl.set_default_backend(backend)
    try:
        main(args.items)
    finally:
        backend.shutdown()
