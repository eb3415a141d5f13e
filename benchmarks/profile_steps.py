"""Where plait's step time goes: model forward vs scheduling, sampling, grammar masking and IPC,
from the scheduler's own timers (StepTimer: forward, sample, schedule, grammar, io).

    python -m benchmarks.profile_steps [--model DIR] [--quick]
    python -m benchmarks.profile_steps --model smollm2 --stream-prefetch-ab 1,2,3

Cases (the timer is reset once a case's batch is in place, so only its steps count):
  decode            32 requests x 128 prompt tokens, decoding together (batch 32)
  decode + JSON     the same, every request constrained to a JSON schema; `grammar mask` is the
                    time in the constraint tracker (bitmask fill, matcher advance, jump-forward,
                    budget closing), and `sampler` the Sampler call (penalties, applying the
                    mask, argmax / sampling): both measured inside `sample` and shown apart
                    (`sample` is what is left: output bookkeeping, stop checks, KV caching)
  prefill           8 distinct 1024-token prompts, 1 output token: extend steps only
  Engine decode     the multi-process Engine (ZMQ between tokenizer, scheduler and detokenizer):
                    deltas of get_server_info()["step_time"] around one generate call; `io` is the
                    scheduler's receive/send (including its idle wait for work), and `outside the
                    scheduler` is the wall time of the call not spent in the scheduler's phases

The first three drive plait.runtime.scheduler.Scheduler in this process through InProcessIO,
which isolates the steps from IPC.

`--stream-prefetch-ab 1,2,3`: instead, the fp32 linears' single-tile stream prefetch
(woq_cpu.cpp's g_single_tile_stream) switched on and off every 8 decode steps of one in-process
scheduler at each batch (in one process, so that this VM's memory bandwidth, which moves 1.7x
within the hour, moves under both alike); the median step of each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from typing import Any

PHASES = ("forward", "schedule", "sample", "grammar", "io")
_ids = itertools.count()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256, vocab - 16) for _ in range(length)] for _ in range(n)]


class InProcess:
    """A Scheduler with in-memory I/O, stepped by hand."""

    def __init__(self, model: str, **server_args: Any) -> None:
        from plait.args import ServerArgs
        from plait.runtime.scheduler import Scheduler
        from plait.models.tokenizer import load_tokenizer
        from plait.runtime.scheduler_process import InProcessIO

        # steps are timed: no speculation (drafts would stand in for them) unless asked for
        server_args.setdefault("speculative_ngram", 0)
        args = ServerArgs(model_path=model, log_level="warning", **server_args)
        self.io = InProcessIO()
        self.sched = Scheduler(args, model, self.io, load_tokenizer(model))
        self.vocab = self.sched.runner.config.vocab_size
        self._time_grammar()

    def _time_grammar(self) -> None:
        """Time the constraint tracker's per-step work (called from inside `sample`)."""
        c, timer = self.sched.constraints, self.sched.timer
        for name in ("bitmask", "accept", "jump_forward", "admit", "plan_closing", "valid_prefix"):
            fn = getattr(c, name, None)
            if fn is None:
                continue

            def timed(*a, _fn=fn, **k):
                with timer("grammar mask"):
                    return _fn(*a, **k)

            setattr(c, name, timed)
        sampler = self.sched.sampler

        def sample(*a, **k):
            with timer("sampler"):
                return sampler(*a, **k)

        self.sched.sampler = sample

    def submit(self, prompts: list[list[int]], sampling: dict) -> list[str]:
        from plait.messages import TokenizedGenerateReq
        from plait.sampling import SamplingParams

        sp = SamplingParams.from_dict(sampling).to_dict()
        rids = [f"prof-{next(_ids)}" for _ in prompts]
        for rid, p in zip(rids, prompts):
            self.io.inbox.put(TokenizedGenerateReq(rid, p, sp, arrival_time=time.time()))
        return rids

    def step_until(self, done, limit_s: float = 600) -> int:
        steps, start = 0, time.perf_counter()
        while not done():
            if time.perf_counter() - start > limit_s:
                raise TimeoutError("profile: the scheduler made no progress")
            if not self.sched.step():
                time.sleep(0.001)  # e.g. waiting for a grammar compile
            steps += 1
        self._raise_errors()
        return steps

    def _raise_errors(self) -> None:
        from plait.messages import RequestErrorOut

        for msg in self.io.outbox:
            if isinstance(msg, RequestErrorOut):
                raise RuntimeError(f"request error: {getattr(msg, 'message', msg)}")
        self.io.outbox.clear()

    def all_running(self, n: int) -> bool:
        s = self.sched
        self._raise_errors()
        return (
            len(s.running) == n
            and not s.waiting
            and s.chunked is None
            and not s.constraints.pending
        )

    def idle(self) -> bool:
        return (
            self.io.inbox.empty() and not self.sched.has_work and not self.sched.constraints.pending
        )

    def measure(self, steps: int) -> dict:
        """Run `steps` steps from a reset timer; the timers and the wall time."""
        s = self.sched
        s.timer.reset()
        before = dict(s.counters)
        start = time.perf_counter()
        for _ in range(steps):
            s.step()
        wall = time.perf_counter() - start
        counters = {
            k: s.counters[k] - before[k]
            for k in ("extend_forwards", "decode_forwards", "generation_tokens", "forced_tokens")
        }
        return _case(s.timer.summary(), wall, counters)

    def finish(self) -> None:
        from plait.messages import AbortReq

        for rid in list(self.sched.reqs):
            self.io.inbox.put(AbortReq(rid))
        self.step_until(self.idle)
        self.sched.kv.flush()


def _case(timer: dict, wall: float, counters: dict) -> dict:
    seconds = {p: v["seconds"] for p, v in timer.items()}
    calls = {p: v["calls"] for p, v in timer.items()}
    top = sum(v for p, v in seconds.items() if p in PHASES)
    for nested in ("grammar mask", "sampler"):  # nested in `sample`: show them apart
        if nested in seconds:
            seconds["sample"] = seconds.get("sample", 0.0) - seconds[nested]
    seconds["other (untimed)"] = max(0.0, wall - top)
    forwards = counters.get("extend_forwards", 0) + counters.get("decode_forwards", 0)
    return {
        "wall_s": wall,
        "forwards": forwards,
        "ms_per_step": 1e3 * wall / max(1, forwards),
        "seconds": seconds,
        "calls": calls,
        "counters": counters,
        "share": {p: v / wall for p, v in seconds.items()} if wall else {},
    }


def profile_in_process(model: str, quick: bool) -> dict:
    n, plen, steps = (8, 32, 8) if quick else (32, 128, 64)
    pn, pl = (2, 256) if quick else (8, 1024)
    ip = InProcess(model, max_total_tokens=65536)
    cases: dict = {}
    # warm-up: first calls allocate and pick kernels
    ip.submit(
        _prompts(2, 16, ip.vocab, 0), {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    )
    ip.step_until(ip.idle)
    greedy = {"temperature": 0.0, "ignore_eos": True}

    ip.submit(_prompts(n, plen, ip.vocab, 1), {**greedy, "max_new_tokens": steps + 4})
    ip.step_until(lambda: ip.all_running(n))
    cases[f"decode (batch {n})"] = ip.measure(steps)
    ip.finish()

    try:
        from benchmarks.workloads import PERSON_SCHEMA

        schema = json.dumps(PERSON_SCHEMA)
        ip.submit(
            _prompts(n, plen, ip.vocab, 2),
            {"temperature": 0.0, "max_new_tokens": steps + 4, "json_schema": schema},
        )
        ip.step_until(lambda: ip.all_running(n))
        cases[f"decode + JSON (batch {n})"] = ip.measure(steps)
        ip.finish()
    except Exception as e:
        cases[f"decode + JSON (batch {n})"] = {"error": f"{type(e).__name__}: {e}"}
        ip = InProcess(model, max_total_tokens=65536)  # the failed one may hold requests

    ip.sched.timer.reset()
    start = time.perf_counter()
    ip.submit(_prompts(pn, pl, ip.vocab, 3), {**greedy, "max_new_tokens": 1})
    before = dict(ip.sched.counters)
    ip.step_until(ip.idle)
    wall = time.perf_counter() - start
    counters = {k: ip.sched.counters[k] - before[k] for k in ("extend_forwards", "decode_forwards")}
    cases[f"prefill ({pn} x {pl} tokens)"] = _case(ip.sched.timer.summary(), wall, counters)
    return cases


def profile_engine(model: str, quick: bool) -> dict:
    import plait

    n, plen, out = (8, 32, 8) if quick else (32, 128, 64)
    engine = plait.Engine(model, max_total_tokens=65536, log_level="warning", speculative_ngram=0)
    try:
        vocab = engine.model_info["vocab_size"]
        sp = {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=_prompts(2, 16, vocab, 0), sampling_params=sp)  # warm-up
        prompts = _prompts(n, plen, vocab, 4)
        before = engine.get_server_info()
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - start
        after = engine.get_server_info()
    finally:
        engine.shutdown()
    timer = {}
    for p, v in after["step_time"].items():
        b = before["step_time"].get(p, {"seconds": 0.0, "calls": 0})
        timer[p] = {"seconds": v["seconds"] - b["seconds"], "calls": v["calls"] - b["calls"]}
    counters = {
        k: after[k] - before[k] for k in ("extend_forwards", "decode_forwards", "generation_tokens")
    }
    case = _case(timer, wall, counters)
    case["seconds"]["outside the scheduler"] = case["seconds"].pop("other (untimed)")
    case["share"] = {p: v / wall for p, v in case["seconds"].items()}
    return {f"Engine decode ({n} x {plen} -> {out}, multi-process)": case}


def stream_prefetch_ab(model: str, batches: list[int], blocks: int = 40, steps: int = 8,
                       context: int = 256) -> dict:
    """The fp32 linears' single-tile stream prefetch (woq_cpu.cpp's g_single_tile_stream, 1-3
    rows) on and off in one in-process scheduler: B requests decoding, the setting switched
    every `steps` decode steps (after one settling step), `blocks` blocks in all; the median
    seconds a step of each, and on / off (> 1: off is faster)."""
    import statistics

    from plait.kernels import woq

    out = {}
    for b in batches:
        ip = InProcess(model, max_total_tokens=max(8192, 2 * b * (context + 2000)))
        woq.start_linear_kernels(block=True)
        ops = woq.linear_ops()
        default = ops.set_fp32_stream_prefetch(True)
        vocab = ip.vocab
        ip.submit(_prompts(b, context, vocab, 7), {
            "max_new_tokens": 2 + blocks * (steps + 1) + 32, "temperature": 0.0,
            "ignore_eos": True})
        ip.step_until(lambda b=b: ip.all_running(b))
        for _ in range(16):
            ip.sched.step()
        per = {True: [], False: []}
        try:
            for blk in range(blocks):
                on = blk % 2 == 0
                ops.set_fp32_stream_prefetch(on)
                ip.sched.step()
                t = time.perf_counter()
                for _ in range(steps):
                    ip.sched.step()
                per[on].append((time.perf_counter() - t) / steps)
        finally:
            ops.set_fp32_stream_prefetch(default)
        on, off = statistics.median(per[True]), statistics.median(per[False])
        out[b] = {"on_s": on, "off_s": off, "on_over_off": on / off, "default": default}
        print(f"batch {b}: stream prefetch on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms a step "
              f"(on/off {on / off:.3f}x; default {'on' if default else 'off'})", flush=True)
        del ip
    return out


def run(model: str, quick: bool = False) -> dict:
    import torch

    cases = profile_in_process(model, quick)
    try:
        cases.update(profile_engine(model, quick))
    except Exception as e:
        cases["Engine decode (multi-process)"] = {"error": f"{type(e).__name__}: {e}"}
    return {"model": model, "torch_threads": torch.get_num_threads(), "cases": cases}


def markdown(prof: dict) -> str:
    cases = prof["cases"]
    ok = {k: v for k, v in cases.items() if "share" in v}
    phases: list[str] = []
    for v in ok.values():
        phases += [p for p in v["seconds"] if p not in phases]
    lines = [
        "## Profile of plait's step time",
        "",
        f"{prof['model']}, {prof['torch_threads']} torch threads. Share of wall time per phase "
        "(scheduler timers; timer reset once each case's batch is in place).",
        "",
        "| phase | " + " | ".join(ok) + " |",
        "|---|" + "---|" * len(ok),
    ]
    for p in phases:
        cells = [f"{v['share'][p]:.1%}" if p in v["share"] else "—" for v in ok.values()]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append(
        "| **ms per forward** | "
        + " | ".join(f"{v['ms_per_step']:.2f}" for v in ok.values())
        + " |"
    )
    for k, v in cases.items():
        if "error" in v:
            lines.append(f"\n- {k}: not measured ({v['error']})")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: plait-tiny)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--stream-prefetch-ab", default=None, metavar="BATCHES",
                    help="instead: decode steps at these batches (e.g. 1,2,3) with the fp32 "
                         "linears' single-tile stream prefetch on and off, alternated")
    args = ap.parse_args(argv)

    from plait.models.resolve import resolve_model_path

    if args.stream_prefetch_ab:
        res = stream_prefetch_ab(resolve_model_path(args.model or "plait-tiny"),
                                 [int(b) for b in args.stream_prefetch_ab.split(",")])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    prof = run(resolve_model_path(args.model or "plait-tiny"), args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(prof, f, indent=1)
    print(markdown(prof))


if __name__ == "__main__":
    main()
