"""Tree of thought on small sums: at each step fork into branches that each propose the next
partial sum, keep the value most branches agree on (ties: the branch whose own check the model
scores highest with `select`), and go on from it. The final answer is checked.

    python examples/tree_of_thought.py [--url URL | --model PATH] [--limit N] [--branches 3]

`s.fork(n)` commits the text so far to the runtime once (one prefill), so every branch's
requests hit the radix cache; `forks.join()` gathers each branch's variables. The last line
prints solved/total.
"""

from __future__ import annotations

import random
from collections import Counter

import plait as pl

VERDICTS = [" yes", " no"]


def make_tasks(n: int, seed: int = 0) -> list[list[int]]:
    """n lists of three small numbers to add."""
    rng = random.Random(seed)
    return [[rng.randint(1, 20) for _ in range(3)] for _ in range(n)]


def choose(values: list[str], check_scores: list[float]) -> int:
    """The branch to keep: the most common value, ties broken by the check score of " yes"."""
    counts = Counter(values)
    return max(range(len(values)), key=lambda i: (counts[values[i]], check_scores[i]))


@pl.function
def add_up(s, numbers, branches=3):
    s += "Add the numbers one at a time.\n"
    s += "Example: 4 + 7 + 2. Step 1: 4 + 7 = 11. Step 2: 11 + 2 = 13. Answer: 13\n"
    s += " + ".join(map(str, numbers)) + "."
    total, tree = numbers[0], []
    for step, n in enumerate(numbers[1:], start=1):
        s += f" Step {step}: {total} + {n} ="
        forks = s.fork(branches)
        for i, f in enumerate(forks):
            f += " " + pl.gen_int("value", max_tokens=4, temperature=0.7, seed=100 * step + i)
            f += ". Is that right?" + pl.select("check", VERDICTS)
        values = [f["value"] for f in forks]  # reading a branch waits for it
        scores = [f.get_meta_info("check")["scores"][0] for f in forks]
        forks.join()
        best = choose(values, scores)
        tree.append({"values": values, "scores": scores, "best": best})
        total = int(values[best])
        s += f" {total}."  # prune: only the kept value goes on
    s += " Answer: " + str(total)
    return {"tree": tree, "answer": total}


def main(limit: int = 10, branches: int = 3, backend: pl.Backend | None = None) -> dict:
    tasks = make_tasks(limit)
    states = add_up.run_batch(
        [{"numbers": t, "branches": branches} for t in tasks], backend=backend
    )
    solved = 0
    for numbers, state in zip(tasks, states):
        if state.error() is not None:
            print(f"{numbers}: failed: {state.error()}")
            continue
        answer = state.ret_value["answer"]
        ok = answer == sum(numbers)
        solved += ok
        steps = " | ".join(
            f"{node['values']} keep {node['values'][node['best']]}"
            for node in state.ret_value["tree"]
        )
        print(f"{'ok ' if ok else 'BAD'} {' + '.join(map(str, numbers))} = {answer}   {steps}")
    print(states.summary)
    print(f"tree of thought solved {solved}/{len(tasks)} ({solved / len(tasks):.0%})")
    return {"solved": solved, "total": len(tasks), "states": states}


if __name__ == "__main__":
    from _common import run_example  # examples/ is on sys.path when a script runs

    run_example(__doc__, main, 10, "number of tasks", branches=3)
