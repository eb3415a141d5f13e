"""N-gram speculative decoding on/off (`--speculative-ngram`), A/B alternated in one process.

Two in-process schedulers on the same model (one with speculation, one without) run the same
greedy requests in turn; each run starts with an empty radix cache. Reports output tokens per
second (prefill included; from each side's fastest run, since on a shared machine interference
only adds time), the speedup, the acceptance rate (accepted / proposed draft tokens),
forwards per output token, and whether the outputs are token-identical.

    python -m benchmarks.speculative --model smollm2 --workload extract decode --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time

from plait.args import ServerArgs
from plait.messages import BatchTokenOut, TokenizedGenerateReq
from plait.models.resolve import resolve_model_path
from plait.models.tokenizer import load_tokenizer
from plait.runtime.scheduler import Scheduler
from plait.runtime.scheduler_process import InProcessIO

from benchmarks import quality, workloads


def extract_prompts(tokenizer, n: int) -> list[list[int]]:
    """quality.py's extraction prompts (free-form JSON answer): the answer copies names,
    cities and goods from the prompt."""
    items = quality.extraction_items(n, seed=99)
    texts = [
        quality.chat_prompt(tokenizer, quality.EXTRACT_SYSTEM, it["text"] + "\nAnswer in JSON.")
        for it in items
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def run_once(
    s: Scheduler, io: InProcessIO, prompts, max_new: int, batch: int = 0
) -> tuple[float, dict, dict]:
    """All prompts at once (batch 0), or `batch` at a time, each group run to completion."""
    assert s.kv.flush()
    io.outbox.clear()
    before = dict(s.counters)
    group = batch or len(prompts)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), group):
        for i in range(start, min(start + group, len(prompts))):
            sp = {"temperature": 0.0, "max_new_tokens": max_new}
            io.inbox.put(TokenizedGenerateReq(rid=f"r{i}", input_ids=prompts[i], sampling_params=sp))
        s.step()
        while s.has_work:
            s.step()
    wall = time.perf_counter() - t0
    outs: dict[str, list[int]] = {}
    for msg in io.outbox:
        if isinstance(msg, BatchTokenOut):
            for rid, ids in zip(msg.rids, msg.new_token_ids):
                outs.setdefault(rid, []).extend(ids)
    delta = {k: s.counters[k] - before[k] for k in s.counters}
    return wall, outs, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workload", nargs="+", default=["extract", "decode"])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--speculative-ngram", type=int, default=4)
    ap.add_argument("--max-rows", type=int, default=None,
                    help="--speculative-ngram-max-rows (default: ServerArgs')")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=0, help="requests at a time (0: all at once)")
    ap.add_argument("--max-total-tokens", type=int, default=1 << 16)
    opts = ap.parse_args()
    path = resolve_model_path(opts.model)
    tok = load_tokenizer(path)
    made = {}
    for k in (0, opts.speculative_ngram):
        io = InProcessIO()
        rows = {} if opts.max_rows is None else {"speculative_ngram_max_rows": opts.max_rows}
        args = ServerArgs(
            model_path=path, speculative_ngram=k, max_total_tokens=opts.max_total_tokens, **rows
        )
        made[k] = (Scheduler(args, path, io, tok), io)
    loads = {
        "extract": (extract_prompts(tok, opts.num_requests), 160),
        "decode": (workloads.decode(len(tok), n=opts.num_requests).prompts, 128),
    }
    report = {}
    for name in opts.workload:
        prompts, max_new = loads[name]
        run_once(*made[opts.speculative_ngram], prompts[:2], 8)  # warm-up, both
        run_once(*made[0], prompts[:2], 8)
        times: dict[int, list[float]] = {k: [] for k in made}
        outs, deltas = {}, {}
        for _ in range(opts.repeats):
            for k in made:  # alternate off / on
                wall, outs[k], deltas[k] = run_once(*made[k], prompts, max_new, opts.batch)
                times[k].append(wall)
        n_out = sum(len(v) for v in outs[0].values())
        d = deltas[opts.speculative_ngram]
        # the fastest run of each: on a shared machine, interference only adds time
        tps = {k: n_out / min(t) for k, t in times.items()}
        report[name] = {
            "requests": len(prompts),
            "batch": opts.batch or len(prompts),
            "output_tokens": n_out,
            "tok_s_off": round(tps[0], 1),
            "tok_s_on": round(tps[opts.speculative_ngram], 1),
            "speedup": round(tps[opts.speculative_ngram] / tps[0], 3),
            "acceptance": round(d["spec_accepted_tokens"] / max(1, d["spec_draft_tokens"]), 3),
            "accepted_per_output_token": round(d["spec_accepted_tokens"] / max(1, n_out), 3),
            "forwards_off": deltas[0]["decode_forwards"] + deltas[0]["extend_forwards"],
            "forwards_on": d["decode_forwards"] + d["extend_forwards"] + d["spec_forwards"],
            "identical": outs[0] == outs[opts.speculative_ngram],
            "walls_off": [round(t, 2) for t in times[0]],
            "walls_on": [round(t, 2) for t in times[opts.speculative_ngram]],
        }
        print(name, json.dumps(report[name]), flush=True)


if __name__ == "__main__":
    main()
