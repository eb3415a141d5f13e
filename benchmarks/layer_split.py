"""Where a decode step goes, kernel by kernel (issue 13): the C++ decode layer loop
(fused_cpu.cpp's DecodeLayers) timed between its kernels, beside the step's other parts.

    python -m benchmarks.layer_split [--model smollm2 | plait-tiny | DIR] [--batches 1,8,32]
        [--context 256] [--steps 32] [--quantization none|int8|int4] [--out FILE.json]

For each batch B: B requests of `context - 1` random prompt tokens decode together in an
in-process scheduler (benchmarks.profile_steps.InProcess: no IPC); once all of them run, the
next `steps` steps are timed. Per step: the wall time, the model runner's forward, the logits
GEMM (or the logit screen's greedy picks, plait/runtime/logit_screen.py, where it is on), and each layer kernel summed over the layers (qkv_proj, rope_store_kv, attention, o_proj,
add_rms_norm, gate_up_proj, silu_mul, down_proj; each kernel's Python-free call as the loop
makes it, with its own thread fork and join). The context grows by `steps` tokens while timed.
A forward the C++ loop does not take (the kernels not built, shared prefixes in the batch) is
an error here: the split would be empty.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def decoding(model: str, batch: int, context: int, steps: int, quantization: str = "none"):
    """An in-process scheduler with `batch` requests of `context - 1` random prompt tokens
    decoding together (room for `steps` more steps), warmed; returns it and its C++ layer loop
    (fused_cpu.cpp's DecodeLayers)."""
    from benchmarks.engine import build_cpu_kernels
    from benchmarks.profile_steps import InProcess

    build_cpu_kernels()
    ip = InProcess(model, quantization=quantization)
    rng = random.Random(batch)
    vocab = ip.vocab
    prompts = [[rng.randrange(256, vocab - 16) for _ in range(context - 1)]
               for _ in range(batch)]
    ip.submit(prompts, {"max_new_tokens": steps + 16, "temperature": 0.0, "ignore_eos": True})
    ip.step_until(lambda: ip.all_running(batch))
    for _ in range(4):  # warm: the C++ loop is built on the first plain decode forward
        ip.sched.step()
    model_ = ip.sched.runner.model
    decoder = model_._decoder[1] if model_._decoder is not None else None
    if decoder is None:
        raise RuntimeError("the decode steps did not run the C++ layer loop (DecodeLayers)")
    return ip, decoder


def split(model: str, batch: int, context: int, steps: int, quantization: str) -> dict:
    ip, decoder = decoding(model, batch, context, steps, quantization)
    runner = ip.sched.runner
    clock = time.perf_counter
    spent = {"forward": 0.0, "logits": 0.0}

    def timed(fn, key):
        def call(*a, **k):
            t = clock()
            out = fn(*a, **k)
            spent[key] += clock() - t
            return out
        return call

    runner.forward = timed(runner.forward, "forward")
    runner.model.compute_logits = timed(runner.model.compute_logits, "logits")
    if runner.logit_screen is not None:  # greedy steps pick through it (logit_screen.py)
        runner.logit_screen = timed(runner.logit_screen, "logits")
    decoder.reset_timings()
    decoder.set_timing(True)
    start = clock()
    for _ in range(steps):
        ip.sched.step()
    wall = clock() - start
    decoder.set_timing(False)
    kernels = {k: v / steps for k, v in decoder.timings().items()}
    return {
        "batch": batch, "context": context, "steps": steps, "quantization": quantization,
        "step_s": wall / steps, "forward_s": spent["forward"] / steps,
        "logits_s": spent["logits"] / steps, "layers_s": sum(kernels.values()),
        "kernels_s": kernels, "threads": torch.get_num_threads(),
    }


def main() -> None:
    from benchmarks.run import _git
    from plait.models.resolve import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    rows = [split(model, int(b), args.context, args.steps, args.quantization)
            for b in args.batches.split(",")]
    names = list(rows[0]["kernels_s"])

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    print(f"## Decode step split: {Path(model).name}, {args.quantization} layers, context "
          f"{args.context}, {args.steps} steps (ms a step)\n")
    print("| batch | step | forward | layers | " + " | ".join(names) + " | logits |")
    print("|---" * (len(names) + 5) + "|")
    for r in rows:
        cells = [ms(r["kernels_s"][n]) for n in names]
        print(f"| {r['batch']} | {ms(r['step_s'])} | {ms(r['forward_s'])} | {ms(r['layers_s'])} | "
              + " | ".join(cells) + f" | {ms(r['logits_s'])} |")
    if args.out:
        args.out.write_text(json.dumps({"model": model, "git": _git(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
