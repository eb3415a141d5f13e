"""One lever on and off on whole workloads: plait.Engine under several ServerArgs variants,
A/B in one run (benchmarks/levers.py does the same for the decode step).

    python -m benchmarks.workload_levers [--model smollm2] [--workloads judge,tree,prefill]
        [--variants "default;disable_cpu_extend_kernel=1"] [--repeats 3]

Workloads: `judge` and `tree` as in benchmarks/run.py's suite (radix cache on, flushed before
every run), `prefill`: 8 distinct 1024-token prompts, 1 output token (prefill tokens/s). One
Engine per variant, all started first and warmed up (kernels built or loaded in the
background are in place); each repeat runs every variant in turn, the order reversed on odd
repeats, so a busy machine's load falls on all alike. Medians; each variant also as a ratio
of the first one's time. Outputs are checked to be the same across variants.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from benchmarks import workloads as wl
from benchmarks.engine import PlaitEngine, build_cpu_kernels
from benchmarks.levers import parse_variant
from plait.models.config import ModelConfig
from plait.models.resolve import resolve_model_path

RESULTS = Path(__file__).resolve().parent / "results"
KV_TOKENS = 131072  # as benchmarks/run.py


def prefill_workload(vocab: int, n: int = 8, length: int = 1024) -> wl.SuiteWorkload:
    rng = random.Random(5)
    prompts = [[rng.randrange(256, vocab - 16) for _ in range(length)] for _ in range(n)]
    return wl.SuiteWorkload("prefill", prompts, 1, f"{n} distinct {length}-token prompts, 1 out")


def workloads(vocab: int, names: list[str]) -> dict[str, wl.SuiteWorkload]:
    suite = wl.suite(vocab)
    return {n: prefill_workload(vocab) if n == "prefill" else suite[n] for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--variants", default="default;disable_cpu_extend_kernel=1")
    ap.add_argument("--workloads", default="judge,tree,prefill")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=None,
                    help="result file (default: results/workload-levers-<model>.json)")
    ap.add_argument("--kv-tokens", type=int, default=KV_TOKENS,
                    help="KV pool of each engine (SmolLM2: 46 KB a token; mind the engines' sum)")
    args = ap.parse_args(argv)
    names = [v.strip() for v in args.variants.split(";")]
    model = str(resolve_model_path(args.model))
    vocab = ModelConfig.from_dir(model).vocab_size
    loads = workloads(vocab, [w.strip() for w in args.workloads.split(",")])
    build_cpu_kernels()
    engines = {
        n: PlaitEngine(
            n, model, log_level="warning", max_total_tokens=args.kv_tokens, **parse_variant(n)
        )
        for n in names
    }
    rows = []
    try:
        for e in engines.values():
            e.warm_up(args.warmup_s / len(engines))
        for w in loads.values():
            for e in engines.values():
                e.run_suite(w.head(2))
            per: dict[str, list[float]] = {n: [] for n in names}
            outputs: dict[str, list] = {}
            for r in range(args.repeats):
                for n in names if r % 2 == 0 else names[::-1]:
                    secs, outs = engines[n].run_suite(w)
                    per[n].append(secs)
                    outputs.setdefault(n, outs)
            base = statistics.median(per[names[0]])
            tokens = sum(len(p) for p in w.prompts)
            for n in names:
                t = statistics.median(per[n])
                same = outputs[n] == outputs[names[0]]
                rows.append(
                    {
                        "workload": w.name,
                        "variant": n,
                        "seconds": t,
                        "runs": per[n],
                        "vs_first": base / t,
                        "same_outputs": same,
                    }
                )
                extra = f" {tokens / t:7.0f} prompt tok/s" if w.name == "prefill" else ""
                print(
                    f"{w.name:8s} {n:40s} {t:7.3f} s{extra}  {base / t:.2f}x {names[0]}"
                    f"{'' if same else '  OUTPUTS DIFFER'}  runs {[round(x, 3) for x in per[n]]}",
                    flush=True,
                )
    finally:
        for e in engines.values():
            e.close()
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / f"workload-levers-{Path(args.model).name}.json"
    out.write_text(
        json.dumps({"model": args.model, "repeats": args.repeats, "rows": rows}, indent=1)
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
