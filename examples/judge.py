"""LLM-as-judge: grade a labeled set of answers under one shared rubric, and score the judge
against the labels.

    python examples/judge.py [--url URL | --model PATH] [--limit N]

Each item is a question, a candidate answer and a gold label (correct / incorrect): simple facts
and one-digit arithmetic, generated from a seed. Every item is the same rubric (with worked
examples) plus its own question and answer; `select` scores the two verdicts by their
log-probabilities in one batched request. `run_batch` prefills the shared rubric once and the
radix cache serves it to every item (the summary's cached-token fraction shows it). The last
line compares the judge's accuracy with the majority-class baseline.
"""

from __future__ import annotations

import random

import plait as pl

VERDICTS = ["correct", "incorrect"]

FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What color is the sky on a clear day?", "blue"),
    ("What color is grass?", "green"),
    ("What color is snow?", "white"),
    ("How many legs does a spider have?", "eight"),
    ("How many days are in a week?", "seven"),
    ("What animal says moo?", "a cow"),
    ("What do bees make?", "honey"),
    ("What is frozen water called?", "ice"),
    ("Which planet do we live on?", "Earth"),
    ("Which star is closest to Earth?", "the Sun"),
]

RUBRIC = """You check answers to questions. Reply with one word: correct or incorrect.

Question: What is the capital of Canada?
Answer: Ottawa
Verdict: correct

Question: What is 3 + 4?
Answer: 9
Verdict: incorrect

Question: How many wheels does a bicycle have?
Answer: two
Verdict: correct

Question: What color is a banana?
Answer: purple
Verdict: incorrect"""


def make_items(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n labeled items, half facts and half sums, alternating right and wrong answers."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        right = i % 4 < 2  # the labels are balanced over every 4 items
        if i % 2 == 0:
            question, answer = rng.choice(FACTS)
            if not right:
                answer = rng.choice([a for q, a in FACTS if q != question])
        else:
            x, y = rng.randint(1, 9), rng.randint(1, 9)
            question = f"What is {x} + {y}?"
            answer = str(x + y if right else x + y + rng.choice([-2, -1, 1, 2]))
        items.append({"question": question, "answer": answer, "label": VERDICTS[0 if right else 1]})
    return items


@pl.function
def judge(s, question, answer):
    s += pl.system(RUBRIC)
    s += pl.user(f"Question: {question}\nAnswer: {answer}\nVerdict:")
    s += pl.assistant(pl.select("verdict", VERDICTS))


def accuracy(predictions: list[str | None], labels: list[str]) -> float:
    return sum(p == g for p, g in zip(predictions, labels)) / len(labels)


def majority_baseline(labels: list[str]) -> float:
    return max(labels.count(v) for v in set(labels)) / len(labels)


def main(limit: int = 40, backend: pl.Backend | None = None, progress_bar: bool = True) -> dict:
    items = make_items(limit)
    states = judge.run_batch(
        [{"question": it["question"], "answer": it["answer"]} for it in items],
        backend=backend,
        progress_bar=progress_bar,
    )
    predictions = []
    for item, state in zip(items, states):
        if state.error() is not None:
            print(f"failed: {state.error()}")
            predictions.append(None)
            continue
        scores = state.get_meta_info("verdict")["scores"]  # mean token logprob per verdict
        predictions.append(state["verdict"])
        mark = "ok " if state["verdict"] == item["label"] else "BAD"
        print(
            f"{mark} {state['verdict']:<9} (gold {item['label']:<9}) "
            f"margin {scores[0] - scores[1]:+6.2f} | {item['question']} -> {item['answer']}"
        )
    labels = [it["label"] for it in items]
    summary = states.summary
    print(summary)
    result = {
        "accuracy": accuracy(predictions, labels),
        "majority_baseline": majority_baseline(labels),
        "n": len(items),
        "cached_token_fraction": summary.cached_token_fraction,
    }
    print(
        f"judge accuracy {result['accuracy']:.1%} on {len(items)} items "
        f"(majority baseline {result['majority_baseline']:.1%}); "
        f"cached-token fraction {summary.cached_token_fraction:.1%}"
    )
    return result


if __name__ == "__main__":
    from _common import run_example  # examples/ is on sys.path when a script runs

    run_example(__doc__, main, 40, "number of labeled items")
