"""Would splitting a decode batch between the cores pay (issue 13, decode at batch 32)?

    python -m benchmarks.batch_split [--model smollm2 | plait-tiny | DIR] [--batch 32]
        [--context 256] [--repeats 12] [--out FILE.json]

A decode step's linears are compute-bound at 32 rows and its attention is bound by reading the
KV, and the C++ layer loop (fused_cpu.cpp's DecodeLayers) runs them one after the other on both
cores. Splitting the batch in two lets one half's attention run beside the other half's
linears, at the price of streaming every layer's weights once per half. This replays one
captured decode step of the layer loop (B requests of `context` tokens, benchmarks.layer_split's
in-process scheduler) three ways, alternated `repeats` times:
  whole       all B rows, the loop on every torch thread (what plait runs)
  side by side  two halves, each the whole loop on one thread in its own Python thread (the loop
              releases the GIL), running freely so that their phases drift apart: the most
              overlap of attention and linears a split can give, without a pipeline's waits
  in turn     the two halves one after the other on every thread
The outputs of the split runs are checked to equal the whole batch's bit for bit (from 3 rows
on, a row's arithmetic in the panel linears and the attention does not depend on its batch; 1-
and 2-row linears sum in another order, hence halves of 3 rows or more: --batch >= 6). Prints
the medians; session 37 on the Intel Xeon model-207 VM, SmolLM2 at batch 32: side by side 0.86x
the whole batch (78.08 vs 67.44 ms; benchmarks/results/batch-split-smollm2-xeon207-s37.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch


def capture(decoder, ip) -> tuple:
    """The arguments of the layer loop's next call (one scheduler step's)."""
    model = ip.sched.runner.model
    seen: dict[str, tuple] = {}

    class Spy:
        def run(self, *args):
            seen["args"] = args
            return decoder.run(*args)

    model._decoder = (model._decoder[0], Spy())
    try:
        ip.sched.step()
    finally:
        model._decoder = (model._decoder[0], decoder)
    return seen["args"]


def main() -> None:
    from benchmarks.layer_split import decoding
    from benchmarks.run import _git
    from plait.models.resolve import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.batch < 6 or args.batch % 2:
        ap.error("--batch: an even number of at least 6 (halves of 3 rows or more)")
    model = resolve_model_path(args.model)
    ip, decoder = decoding(model, args.batch, args.context, 8)
    x, h, cos, sin, loc, slots, lens, scale, groups = capture(decoder, ip)
    if groups:
        raise RuntimeError("the captured step has shared prefixes: the halves would need them")
    threads = torch.get_num_threads()
    halves = [slice(0, args.batch // 2), slice(args.batch // 2, args.batch)]

    def run(rows: slice):
        return decoder.run(x[rows].clone(), h[rows].clone(), cos[rows], sin[rows], loc[rows],
                           slots[rows], lens[rows], scale, groups)

    def whole():
        return run(slice(None))

    def side_by_side():
        out = [None, None]

        def one(i: int) -> None:
            torch.set_num_threads(1)  # this Python thread's loop on one core
            out[i] = run(halves[i])

        workers = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return torch.cat(out)

    def in_turn():
        return torch.cat([run(rows) for rows in halves])

    ways = {"whole": whole, "side by side": side_by_side, "in turn": in_turn}
    reference = whole()
    for name in ("side by side", "in turn"):
        torch.set_num_threads(threads)
        if not torch.equal(ways[name](), reference):
            raise AssertionError(f"{name}: the halves' output differs from the whole batch's")
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            torch.set_num_threads(threads)
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    print(f"## One decode step's layer loop, {Path(model).name}, batch {args.batch}, context "
          f"{args.context}, {threads} threads, medians of {args.repeats}\n")
    print("| way | ms | vs whole |\n|---|---|---|")
    for name, s in medians.items():
        print(f"| {name} | {s * 1e3:.2f} | {medians['whole'] / s:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({
            "model": model, "git": _git(), "batch": args.batch, "context": args.context,
            "threads": threads, "seconds": seconds, "median_s": medians}, indent=1))


if __name__ == "__main__":
    main()
