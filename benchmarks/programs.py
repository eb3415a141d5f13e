"""Language-level benchmark (issue 5): plait.lang programs on a `plait serve` process.

    python -m benchmarks.programs [--model PATH] [--quick] [--repeats 1] [--out FILE]

(a) judge: N items x a shared ~800-token rubric, `select` over 5 grades. plait's run_batch
    (prefix traced and prefilled once, items ordered by prefix, each select's prefix committed
    before its one batched 5-choice request) against the same scoring requests sent directly
    over HTTP with no prefix planning (one 5-prompt logprob request per item, same
    concurrency), on one server with the radix cache on.
(b) tree of thought: depth 3 x branching 3; each branch generates a thought and is scored with
    select, the best one is kept. Wall time and cached-token fraction on two servers, radix
    cache on and off, runs alternated.

Prints a markdown table; writes benchmarks/results/programs.json. Not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

import plait.lang as pl

RESULTS = Path(__file__).parent / "results"
GRADES = ["excellent", "good", "fair", "poor", "wrong"]
CONCURRENCY = 64
SERVER_ARGS = {"max_total_tokens": 131072, "log_level": "warning"}

_WORDS = (
    "accuracy completeness clarity evidence reasoning citation relevance structure tone "
    "precision brevity correctness consistency safety helpfulness depth originality"
).split()


def rubric(num_words: int = 560) -> str:
    """A deterministic ~800-token grading rubric."""
    rng = random.Random(5)
    lines = ["You are an expert grader. Read the question and the answer, then grade the answer."]
    while sum(len(line.split()) for line in lines) < num_words:
        a, b, c = rng.sample(_WORDS, 3)
        lines.append(f"- Weigh {a} against {b}; penalize answers that lack {c}.")
    return "\n".join(lines) + "\nGrades: " + ", ".join(GRADES) + ".\n"


def judge_items(n: int) -> list[dict[str, str]]:
    rng = random.Random(6)
    return [
        {
            "question": f"Question {i}: explain {' and '.join(rng.sample(_WORDS, 2))}.",
            "answer": " ".join(rng.choices(_WORDS, k=rng.randint(25, 40))) + ".",
        }
        for i in range(n)
    ]


RUBRIC = rubric()


@pl.function
def judge(s, question, answer):
    s += RUBRIC + "\n" + question + "\nAnswer: " + answer + "\nGrade:"
    s += pl.select("grade", [" " + g for g in GRADES])


def judge_prompt(item: dict[str, str]) -> str:
    return RUBRIC + "\n" + item["question"] + "\nAnswer: " + item["answer"] + "\nGrade:"


async def direct_judge(url: str, tokenizer, items: list[dict[str, str]]) -> dict:
    """The unplanned baseline: per item, one request scoring the 5 grades (SGLang's select
    request shape), all items at the same concurrency, no prefix commit or ordering."""
    sem = asyncio.Semaphore(CONCURRENCY)
    stats = {"prompt_tokens": 0, "cached_tokens": 0, "requests": 0}

    async def one(client: httpx.AsyncClient, item: dict[str, str]) -> str:
        prompt = judge_prompt(item)
        start = len(tokenizer.encode(prompt, add_special_tokens=False)) - 1
        body = {
            "text": [prompt + " " + g for g in GRADES],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        async with sem:
            r = await client.post(url + "/generate", json=body)
        r.raise_for_status()
        outs = r.json()
        means = []
        for o in outs:
            meta = o["meta_info"]
            stats["requests"] += 1
            stats["prompt_tokens"] += meta["prompt_tokens"]
            stats["cached_tokens"] += meta["cached_tokens"]
            values = [e[0] for e in meta["input_token_logprobs"] if e[0] is not None]
            means.append(sum(values) / len(values))
        return GRADES[means.index(max(means))]

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=CONCURRENCY, keepalive_expiry=4.0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        grades = await asyncio.gather(*(one(client, item) for item in items))
    seconds = time.perf_counter() - t0
    return _row(seconds, len(items), stats, grades=grades)


def plait_judge(backend: pl.RuntimeEndpoint, items: list[dict[str, str]]) -> dict:
    states = judge.run_batch(items, backend=backend, num_threads=CONCURRENCY)
    s = states.summary
    stats = {"prompt_tokens": s.usage.prompt_tokens, "cached_tokens": s.usage.cached_tokens,
             "requests": s.usage.requests}
    grades = [st["grade"].strip() if st.error() is None else None for st in states]
    return _row(s.wall_time_s, len(items), stats, failed=s.num_failed, grades=grades)


def _row(seconds: float, n: int, stats: dict, failed: int = 0, grades=None) -> dict:
    prompt = stats["prompt_tokens"]
    return {
        "seconds": seconds,
        "items_per_s": n / seconds,
        "failed": failed,
        **stats,
        "cached_fraction": stats["cached_tokens"] / prompt if prompt else 0.0,
        "grades": grades,
    }


# ---------------------------------------------------------------------- tree of thought
ROOT = rubric(360).replace("grade the answer", "solve the problem step by step")


@pl.function
def tree_of_thought(s, problem, depth=3, branching=3):
    s += ROOT + "\nProblem: " + problem + "\n"
    for level in range(1, depth + 1):
        forks = s.fork(branching)
        for i, f in enumerate(forks):
            f += f"Step {level}, idea {i + 1}:"
            f += pl.gen("thought", max_tokens=16, stop="\n", temperature=0.8)
            f += "\nIs this idea promising?" + pl.select("verdict", [" yes", " maybe", " no"])
        forks.join()
        # keep the idea the model scores most likely to be promising
        yes = [f.get_meta_info("verdict")["scores"][0] for f in forks]
        best = yes.index(max(yes))
        s += f"Step {level}:" + forks[best]["thought"] + "\n"
    s += "Answer:" + pl.gen("answer", max_tokens=16, stop="\n")


def run_trees(backend: pl.RuntimeEndpoint, problems: list[str]) -> dict:
    backend.flush_cache()
    states = tree_of_thought.run_batch([{"problem": p} for p in problems], backend=backend,
                                       num_threads=CONCURRENCY)
    s = states.summary
    return {
        "seconds": s.wall_time_s,
        "trees_per_s": len(problems) / s.wall_time_s,
        "failed": s.num_failed,
        "requests": s.usage.requests,
        "prompt_tokens": s.usage.prompt_tokens,
        "cached_tokens": s.usage.cached_tokens,
        "cached_fraction": s.cached_token_fraction,
    }


# ---------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: plait-tiny)")
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 40 judge items, 4 trees")
    parser.add_argument("--repeats", type=int, default=1, help="repetitions (medians reported)")
    parser.add_argument("--judge-items", type=int, default=None)
    parser.add_argument("--trees", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS / "programs.json"))
    args = parser.parse_args()
    n_items = args.judge_items or (40 if args.quick else 500)
    n_trees = args.trees or (4 if args.quick else 16)

    on = pl.Runtime(args.model, **SERVER_ARGS)
    off = pl.Runtime(args.model, disable_radix_cache=True, **SERVER_ARGS)
    try:
        result = {
            "model": on.get_model_name(),
            "judge": bench_judge(on, n_items, args.repeats),
            "tree": bench_tree(on, off, n_trees, args.repeats),
        }
    finally:
        on.shutdown()
        off.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(markdown(result))


def bench_judge(server: pl.Runtime, n: int, repeats: int) -> dict:
    items = judge_items(n)
    runs: dict[str, list[dict]] = {"plait run_batch": [], "direct HTTP (unplanned)": []}
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            server.flush_cache()
            if name == "plait run_batch":
                runs[name].append(plait_judge(server, items))
            else:
                runs[name].append(asyncio.run(direct_judge(server.url, server.tokenizer, items)))
            print(f"  judge {name:26s} {runs[name][-1]['seconds']:7.2f} s", flush=True)
    rows = {name: _median(rs) for name, rs in runs.items()}
    a, b = rows["plait run_batch"], rows["direct HTTP (unplanned)"]
    agree = sum(x == y for x, y in zip(a.pop("grades"), b.pop("grades"))) / n
    return {"items": n, "rubric_chars": len(RUBRIC), "rows": rows,
            "speedup": b["seconds"] / a["seconds"], "grade_agreement": agree}


def bench_tree(on: pl.Runtime, off: pl.Runtime, n: int, repeats: int) -> dict:
    problems = [f"find a plan for task {i} using {random.Random(i).choice(_WORDS)}"
                for i in range(n)]
    runs: dict[str, list[dict]] = {"radix cache on": [], "radix cache off": []}
    for r in range(repeats):
        pairs = [("radix cache on", on), ("radix cache off", off)]
        for name, server in pairs if r % 2 == 0 else pairs[::-1]:
            runs[name].append(run_trees(server, problems))
            print(f"  tree  {name:26s} {runs[name][-1]['seconds']:7.2f} s", flush=True)
    rows = {name: _median(rs) for name, rs in runs.items()}
    return {"trees": n, "depth": 3, "branching": 3, "rows": rows,
            "speedup": rows["radix cache off"]["seconds"] / rows["radix cache on"]["seconds"]}


def _median(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {**best, "seconds": statistics.median(r["seconds"] for r in runs)}


def markdown(result: dict) -> str:
    j, t = result["judge"], result["tree"]
    lines = [
        f"### Programs — {result['model']}",
        "",
        f"(a) judge: {j['items']} items x {j['rubric_chars']}-char rubric, select over 5 grades",
        "",
        "| run | wall s | items/s | requests | prompt tokens | cached |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in j["rows"].items():
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['items_per_s']:.1f} | {r['requests']} | "
                     f"{r['prompt_tokens']} | {r['cached_fraction']:.1%} |")
    lines += [
        "",
        f"plait run_batch speedup over direct HTTP: **{j['speedup']:.2f}x** "
        f"(same grade on {j['grade_agreement']:.0%} of items)",
        "",
        f"(b) tree of thought: {t['trees']} trees, depth {t['depth']} x branching {t['branching']}",
        "",
        "| server | wall s | trees/s | requests | prompt tokens | cached |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in t["rows"].items():
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['trees_per_s']:.2f} | {r['requests']} | "
                     f"{r['prompt_tokens']} | {r['cached_fraction']:.1%} |")
    lines += ["", f"radix cache on vs off: **{t['speedup']:.2f}x**"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
