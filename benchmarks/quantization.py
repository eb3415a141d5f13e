"""Decode step time of plait's linears: fp32 and weight-only quantized, A/B in one run.

    python -m benchmarks.quantization [--model smollm2] [--methods none,int8,int4]
    python -m benchmarks.quantization --gemms --methods none,onednn --batches 1,8,16,32,64,128,256
        [--lm-head] [--batches 1,8,32] [--context 128] [--steps 16] [--repeats 3]

    python -m benchmarks.quantization --gemms    # the linears of one decode step only
    python -m benchmarks.quantization --in-process [--threads 1]   # scheduler steps, here

One plait.Engine per method, all started first; each repeat then times every engine in turn
(alternating, so a busy machine's load falls on all alike): (time of 1 + steps new tokens -
time of 1) / steps, the prompts cached after a warm-up (so both times prefill only each
prompt's last token: a prefill of every prompt, seconds at batch 32, varies by more than the
16 steps take). Medians of the repeats.

--in-process steps one Scheduler per method in this process (benchmarks.profile_steps'
InProcess: no IPC), the batch decoding, and times `steps` decode steps of each in turn. With
--threads 1 the clock is this thread's CPU time (time.thread_time), which a shared machine's
other processes do not inflate: the A/B to use on a busy machine (memory and cache contention
still reach it). --gemms, --isa avx2 runs the int8/int4 linears on the AVX2 build.

Methods: none (fp32 on plait's panel kernels, the default), onednn (fp32 on oneDNN's prepacked
weights, --disable-cpu-linear-kernel), bf16 (the layers' linears in bf16 on oneDNN,
--cpu-bf16-linear-rows 1; the logits fp32), amx (fp32 on the panel kernels' AMX path,
--cpu-amx-linear-rows 1, the logits too; an AMX CPU), int8, int4.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import plait
from plait.models.config import ModelConfig
from plait.models.resolve import resolve_model_path


def method_args(method: str, lm_head: bool) -> dict:
    if method == "none":
        return {}
    if method == "onednn":
        return {"disable_cpu_linear_kernel": True}
    if method == "bf16":
        return {"cpu_bf16_linear_rows": 1}
    if method == "amx":
        return {"cpu_amx_linear_rows": 1}
    return {"quantization": method, "quantize_lm_head": lm_head}


def gemm_step(model: str, methods: list[str], batches: list[int], repeats: int,
              lm_head: bool, isa: str | None, clock) -> None:
    """Time of the weight GEMMs of one decode step (every layer's qkv, o, gate_up and down,
    then the logits), random weights at the model's shapes, each layer its own (the weights
    come from memory, as in the model, not from the cache): fp32 through the oneDNN-prepacked
    path plait uses by default, int8/int4 through plait's kernels; the logits through the
    prepacked fp32 path unless `lm_head`."""
    import torch

    from plait.kernels.woq import (
        Int4Linear,
        Int8Linear,
        PanelLinear,
        set_fp32_amx_rows,
        start_linear_kernels,
    )
    from plait.runtime.cpu_tuning import pack_linear

    start_linear_kernels(block=True)

    cfg = ModelConfig.from_dir(str(resolve_model_path(model)))
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    kw = {"isa": isa} if isa else {}
    def bf16(w):
        lin = PanelLinear(w)
        lin.use_bf16_from(1)
        return lin

    if "amx" in methods and not set_fp32_amx_rows(1):
        raise SystemExit("--methods amx: this CPU (or process) has no AMX")
    build = {"none": PanelLinear, "onednn": pack_linear, "bf16": bf16, "amx": PanelLinear,
             "int8": lambda w: Int8Linear(w, **kw), "int4": lambda w: Int4Linear(w, **kw)}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        mods: dict[str, list] = {m: [] for m in methods}
        for _ in range(cfg.num_hidden_layers):
            for n, k in shapes:
                w = torch.randn(n, k, generator=gen) * 0.02
                for m in methods:
                    mods[m].append(build[m](w))
        logits_w = torch.randn(cfg.vocab_size, h, generator=gen) * 0.02
        for m in methods:
            fp32 = m if m in ("none", "onednn", "amx") else "none"  # (bf16: the logits fp32)
            mods[m].append(build[m if lm_head else fp32](logits_w))
        for b in batches:
            xs = {k: torch.randn(b, k, generator=gen) for k in {k for _, k in shapes}}
            per: dict[str, list[float]] = {m: [] for m in methods}
            for r in range(repeats + 1):
                for m, linears in mods.items():
                    set_fp32_amx_rows(1 if m == "amx" else 0)  # (a setting of the kernels)
                    t = clock()
                    for lin in linears:
                        lin(xs[lin.in_features])
                    if r:  # the first round warms up
                        per[m].append(clock() - t)
            base = statistics.median(per[methods[0]])
            for m in methods:
                step = statistics.median(per[m])
                print(f"gemms batch {b:3d} {m:5s}: {step * 1e3:7.2f} ms, "
                      f"{base / step:.2f}x {methods[0]}", flush=True)


def in_process_steps(model: str, methods: list[str], batches: list[int], context: int,
                     steps: int, repeats: int, lm_head: bool, threads: int, clock) -> None:
    """Decode steps of one in-process Scheduler per method, `steps` at a time, alternating;
    on `threads` fixed threads (0: the runner's adaptive thread count)."""
    from benchmarks.profile_steps import InProcess, _prompts
    from benchmarks.engine import build_cpu_kernels

    path = str(resolve_model_path(model))
    runs = {}
    for m in methods:
        kw = method_args(m, lm_head)
        if threads:
            kw["num_threads"] = threads
        runs[m] = InProcess(path, max_total_tokens=max(batches) * (context + 64) * 2 + 1024,
                            **kw)
    build_cpu_kernels()  # the kernels built in the background: in place for all
    new_tokens = (repeats + 1) * steps + 2  # still running when the timing ends
    for b in batches:
        for m, run in runs.items():
            run.submit(_prompts(b, context, run.vocab, b),
                       {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True})
            run.step_until(lambda run=run: run.all_running(b))
        per: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(repeats + 1):
            for m, run in runs.items():
                t = clock()
                for _ in range(steps):
                    run.sched.step()
                if r:  # the first round warms up
                    per[m].append((clock() - t) / steps)
        for run in runs.values():
            run.finish()
        base = statistics.median(per[methods[0]])
        for m in methods:
            step = statistics.median(per[m])
            print(f"in-process batch {b:3d} {m:5s}: step {step * 1e3:7.2f} ms, "
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
    ap.add_argument("--isa", choices=["avx512", "avx2"], help="--gemms: the kernel build")
    ap.add_argument("--in-process", action="store_true", help="scheduler steps in this process")
    ap.add_argument("--threads", type=int, default=0,
                    help="fixed torch threads for --gemms/--in-process (default: all cores, "
                    "adaptive in-process); 1: the clock is this thread's CPU time")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    clock = time.perf_counter
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        clock = time.thread_time if args.threads == 1 else clock
    if args.gemms:
        return gemm_step(args.model, methods, batches, args.repeats, args.lm_head, args.isa,
                         clock)
    if args.in_process:
        return in_process_steps(args.model, methods, batches, args.context, args.steps,
                                args.repeats, args.lm_head, args.threads, clock)
    vocab = ModelConfig.from_dir(str(resolve_model_path(args.model))).vocab_size
    from benchmarks.engine import build_cpu_kernels

    build_cpu_kernels()  # before the engines: each loads them in the background
    engines = {}
    for m in methods:
        kw = method_args(m, args.lm_head)
        engines[m] = plait.Engine(args.model, log_level="warning", max_total_tokens=16384,
                                  speculative_ngram=0, **kw)  # decode steps are timed
    try:
        for b in batches:
            rng = random.Random(b)
            prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.context)]
                       for _ in range(b)]

            def timed(eng, n: int) -> float:  # the prompts stay cached: no prefill but the last
                t = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params={
                    "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
                return time.perf_counter() - t

            per: dict[str, list[float]] = {m: [] for m in methods}
            for eng in engines.values():  # warm-up: the prompts cached, the kernels loaded
                end = time.time() + 3
                while time.time() < end:
                    timed(eng, 2)
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
