"""Tree of thought: branch, score each branch with `select`, keep the best, branch again.

    python examples/tree_of_thought.py [--url http://127.0.0.1:30000] [--depth 3] [--branches 3]

`s.fork(n)` commits the text so far to the runtime once (one prefill), so every branch's
requests hit the radix cache; `get_meta_info(name)` shows each request's cached tokens. (The
default model has random weights: the thoughts are gibberish, the search is real.)
"""

from __future__ import annotations

import argparse

import plait as pl

PROBLEM = "Plan a three-day trip to Kyoto on a small budget, visiting temples and gardens."
VERDICTS = [" promising", " unclear", " hopeless"]


@pl.function
def tree_of_thought(s, problem, depth=3, branches=3):
    s += "You solve problems step by step, trying several ideas at each step.\n"
    s += "Problem: " + problem + "\n"
    tree = []
    for level in range(depth):
        forks = s.fork(branches)
        for i, f in enumerate(forks):
            f += f"Step {level + 1}, idea {i + 1}:"
            f += pl.gen("thought", max_tokens=16, stop="\n", temperature=0.8, seed=10 * level + i)
            f += "\nThis idea is" + pl.select("verdict", VERDICTS)
        nodes = []
        for f in forks:  # reading a branch waits for it; the branches ran concurrently
            gen_meta, verdict = f.get_meta_info("thought"), f.get_meta_info("verdict")
            nodes.append(
                {
                    "thought": f["thought"].strip(),
                    "verdict": f["verdict"].strip(),
                    "score": verdict["scores"][0],  # mean logprob of " promising"
                    "cached": gen_meta["cached_tokens"],
                    "prompt": gen_meta["prompt_tokens"],
                }
            )
        forks.join()
        best = max(range(branches), key=lambda i: nodes[i]["score"])
        tree.append({"nodes": nodes, "best": best})
        s += f"Step {level + 1}: " + nodes[best]["thought"] + "\n"  # prune: only the best goes on
    s += "Plan:" + pl.gen("plan", max_tokens=24, stop="\n", temperature=0)
    return tree


def main(depth: int = 3, branches: int = 3, backend: pl.Backend | None = None):
    state = tree_of_thought.run(problem=PROBLEM, depth=depth, branches=branches, backend=backend)
    if state.error() is not None:
        raise state.error()
    print("problem:", PROBLEM)
    for level, step in enumerate(state.ret_value):
        print(f"step {level + 1}")
        for i, node in enumerate(step["nodes"]):
            mark = "*" if i == step["best"] else " "
            print(
                f"  {mark} [{node['score']:7.3f} {node['verdict']:<9}] "
                f"cached {node['cached']:3d}/{node['prompt']:<3d} {node['thought']!r}"
            )
    plan = state.get_meta_info("plan")
    print(f"plan: {state['plan']!r} (cached {plan['cached_tokens']}/{plan['prompt_tokens']})")
    usage = state.usage  # every request of the program, branches included
    print(
        f"{usage.requests} requests, {usage.prompt_tokens} prompt tokens, "
        f"{usage.cached_token_fraction:.1%} cached, {usage.completion_tokens} generated"
    )
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `plait serve` (default: the embedded model)")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--branches", type=int, default=3)
    args = parser.parse_args()
    backend = pl.RuntimeEndpoint(args.url) if args.url else pl.EngineBackend()
    pl.set_default_backend(backend)
    try:
        main(args.depth, args.branches)
    finally:
        backend.shutdown()
