"""One lever on and off: plait's decode step under several ServerArgs variants, A/B in one run.

    python -m benchmarks.levers [--model smollm2] [--batches 1,8,32,64] [--context 256]
        [--variants "default;disable_cpu_attention_kernel=1;disable_cpu_prepack=1"]
        [--steps 16] [--repeats 3]

A variant is `default` or `field=value,field=value` (ServerArgs fields: true/false/1/0,
numbers, strings). One plait.Engine per variant, all started first (and warmed up for a few
seconds, so kernels built or loaded in the background are in place); each repeat then times
every engine in turn, alternating, so a busy machine's load falls on all alike: (time of
1 + steps new tokens - time of 1) / steps, greedy, ignore_eos, the prompts cached in the
engine's radix cache beforehand (as benchmarks/roofline.py does): each call prefills only its
last prompt token. (Until 2026-11-28 the cache was flushed before every call, so each carried
the whole prefill, B x context tokens, and its noise: at batch 32 x 256 a ~9 s prefill
spread by +-1 s put +-60 ms on a 16-step difference of ~65 ms steps; two runs of the same
pair of variants gave 1.06x and 0.60x.)
Medians of the repeats; each variant is also given as a ratio of the first one's step time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import plait
from benchmarks.engine import build_cpu_kernels
from plait.models.config import ModelConfig
from plait.models.resolve import resolve_model_path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_VARIANTS = "default;disable_cpu_attention_kernel=1;disable_cpu_prepack=1"


def parse_variant(text: str) -> dict:
    if text.strip() == "default":
        return {}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        v: object = value.strip()
        if v.lower() in ("1", "true", "yes"):
            v = True
        elif v.lower() in ("0", "false", "no"):
            v = False
        else:
            for number in (int, float):
                try:
                    v = number(v)
                    break
                except ValueError:
                    pass
        out[key.strip()] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    args = ap.parse_args(argv)
    names = [v.strip() for v in args.variants.split(";")]
    batches = [int(b) for b in args.batches.split(",")]
    vocab = ModelConfig.from_dir(str(resolve_model_path(args.model))).vocab_size
    tokens = max(batches) * (args.context + args.steps + 8) + 1024
    build_cpu_kernels()
    # decode steps are timed: no speculation unless a variant asks for it
    engines = {n: plait.Engine(args.model, log_level="warning", max_total_tokens=tokens,
                               **{"speculative_ngram": 0, **parse_variant(n)}) for n in names}
    rows = []
    try:
        end = time.time() + args.warmup_s
        while time.time() < end:
            for eng in engines.values():
                eng.generate(input_ids=[[11, 12, 13] * 20] * 2,
                             sampling_params={"max_new_tokens": 4, "temperature": 0.0})
        for b in batches:
            rng = random.Random(b)
            prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.context)]
                       for _ in range(b)]

            def timed(eng, n: int) -> float:  # the prompts stay cached: no prefill but one
                t = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params={
                    "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
                return time.perf_counter() - t

            per: dict[str, list[float]] = {n: [] for n in names}
            for eng in engines.values():
                eng.flush_cache()  # the last batch's prompts out, this one's in
                timed(eng, 2)
            for _ in range(args.repeats):
                for n, eng in engines.items():
                    per[n].append((timed(eng, 1 + args.steps) - timed(eng, 1)) / args.steps)
            base = statistics.median(per[names[0]])
            for n in names:
                step = statistics.median(per[n])
                rows.append({"batch": b, "variant": n, "step_ms": step * 1e3,
                             "tok_s": b / step, "vs_first": base / step})
                print(f"batch {b:3d} {n:45s} step {step * 1e3:7.2f} ms {b / step:7.1f} tok/s "
                      f"{base / step:.2f}x {names[0]}", flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"levers-{Path(str(args.model)).name}.json"
    out.write_text(json.dumps({"model": args.model, "context": args.context,
                               "steps": args.steps, "repeats": args.repeats, "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
