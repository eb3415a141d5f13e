"""Decode step time of plait's weight-only quantized linears against fp32, A/B in one run.

    python -m benchmarks.quantization [--model smollm2] [--methods none,int8,int4]
        [--lm-head] [--batches 1,8,32] [--context 128] [--steps 16] [--repeats 3]

    python -m benchmarks.quantization --gemms    # the linears of one decode step only

One plait.Engine per method, all started first; each repeat then times every engine in turn
(alternating, so a busy machine's load falls on all alike): (time of 1 + steps new tokens -
time of 1) / steps, with the prompts' prefix cache flushed. Medians of the repeats.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import plait
from plait.models.config import ModelConfig
from plait.models.resolve import resolve_model_path


def gemm_step(model: str, methods: list[str], batches: list[int], repeats: int) -> None:
    """Time of the weight GEMMs of one decode step (every layer's qkv, o, gate_up and down,
    then the logits), random weights at the model's shapes: fp32 through the oneDNN-prepacked
    path plait uses by default, int8/int4 through plait's kernels (logits included)."""
    import torch

    from plait.kernels.woq import Int4Linear, Int8Linear
    from plait.runtime.cpu_tuning import pack_linear

    cfg = ModelConfig.from_dir(str(resolve_model_path(model)))
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    build = {"none": pack_linear, "int8": Int8Linear, "int4": Int4Linear}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
        logits_w = torch.randn(cfg.vocab_size, h, generator=gen) * 0.02
        mods = {m: ([build[m](w) for w in weights], build[m](logits_w)) for m in methods}
        for b in batches:
            xs = {k: torch.randn(b, k, generator=gen) for k in {k for _, k in shapes}}
            per: dict[str, list[float]] = {m: [] for m in methods}
            for r in range(repeats + 1):
                for m, (layer, head) in mods.items():
                    t = time.perf_counter()
                    for _ in range(cfg.num_hidden_layers):
                        for lin, (_, k) in zip(layer, shapes):
                            lin(xs[k])
                    head(xs[h])
                    if r:  # the first round warms up
                        per[m].append(time.perf_counter() - t)
            base = statistics.median(per[methods[0]])
            for m in methods:
                step = statistics.median(per[m])
                print(f"gemms batch {b:3d} {m:5s}: {step * 1e3:7.2f} ms, "
                      f"{base / step:.2f}x {methods[0]}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--methods", default="none,int8,int4")
    ap.add_argument("--lm-head", action="store_true", help="also quantize the logits GEMM")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemms", action="store_true", help="time the step's linears only")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.gemms:
        return gemm_step(args.model, methods, batches, args.repeats)
    vocab = ModelConfig.from_dir(str(resolve_model_path(args.model))).vocab_size
    engines = {}
    for m in methods:
        kw = {} if m == "none" else {"quantization": m, "quantize_lm_head": args.lm_head}
        engines[m] = plait.Engine(args.model, log_level="warning", max_total_tokens=16384, **kw)
    try:
        for b in batches:
            rng = random.Random(b)
            prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.context)]
                       for _ in range(b)]

            def timed(eng, n: int) -> float:
                eng.flush_cache()
                t = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params={
                    "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
                return time.perf_counter() - t

            per: dict[str, list[float]] = {m: [] for m in methods}
            for eng in engines.values():
                timed(eng, 2)  # warm-up
            for _ in range(args.repeats):
                for m, eng in engines.items():
                    per[m].append((timed(eng, 1 + args.steps) - timed(eng, 1)) / args.steps)
            base = statistics.median(per[methods[0]])
            for m in methods:
                step = statistics.median(per[m])
                print(f"batch {b:3d} {m:5s}: step {step * 1e3:7.2f} ms, {b / step:7.1f} tok/s, "
                      f"{base / step:.2f}x {methods[0]}", flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()


if __name__ == "__main__":
    main()
