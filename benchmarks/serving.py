"""HTTP serving benchmark: N concurrent streaming chat clients against `plait serve`.

    python -m benchmarks.serving [--model PATH] [--concurrency 1,8,32] [--requests 64]
                                 [--max-tokens 64] [--prefix-words 400] [--cache on,off]
    python -m benchmarks.serving --smoke          # a few seconds: 1 and 4 clients, 8 requests

Workload: a shared-prefix chat (one long system prompt — rubric plus few-shot examples —
then a distinct short user question per request), streamed through /v1/chat/completions with
`ignore_eos` so every request generates exactly --max-tokens tokens. Each client is closed-loop
(sends its next request when the previous one finished). For each cache mode a fresh server
starts (ServerProcess), gets a warm-up request, and runs every concurrency level from a flushed
cache. Reports requests/s, output tokens/s, TTFT and TPOT p50/p99 and the prompt cache hit rate;
prints a markdown table and writes benchmarks/results/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"

WORDS = (
    "answer grade rubric clear correct partial wrong reason evidence claim source detail "
    "summary concise polite helpful step example question context fact error check score "
    "explain compare list define measure estimate verify assume conclude"
).split()


# ---------------------------------------------------------------------- workload
def shared_prefix_chats(n: int, prefix_words: int, seed: int = 0) -> list[list[dict]]:
    """n conversations sharing one long system prompt; each asks its own question."""
    rng = random.Random(seed)
    rubric = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    system = f"You grade answers. Rubric and examples follow.\n{rubric}\nGrade the next answer."
    chats = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(12 + rng.randrange(8)))
        chats.append(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Answer {i}: {question}"},
            ]
        )
    return chats


# ---------------------------------------------------------------------- one request
@dataclass
class RequestResult:
    ttft: float
    tpot: float | None
    latency: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    retries: int = 0  # sends again after the server dropped a kept-alive connection


async def one_chat(
    client: httpx.AsyncClient, model: str, messages, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    usage = None
    async with contextlib.AsyncExitStack() as stack:
        for retries in range(2):
            try:
                resp = await stack.enter_async_context(
                    client.stream("POST", "/v1/chat/completions", json=body))
                break
            except httpx.RemoteProtocolError:
                # a kept-alive connection the server closed as the request went out (llama.cpp's
                # llama-server, now and then): nothing came back, so send it again, once, on a
                # fresh connection; the time lost stays in this request's TTFT
                if retries:
                    raise
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    n = usage["completion_tokens"]
    return RequestResult(
        ttft=first - start,
        tpot=(end - first) / (n - 1) if n > 1 else None,
        latency=end - start,
        output_tokens=n,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        retries=retries,
    )


# ---------------------------------------------------------------------- one level
async def run_level(
    url: str, model: str, chats, concurrency: int, max_tokens: int, api_key: str | None = None
) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for chat in chats:
        queue.put_nowait(chat)
    results: list[RequestResult] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=limits, headers=headers
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                chat = queue.get_nowait()
                results.append(await one_chat(client, model, chat, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(results, wall, concurrency)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarize(results: list[RequestResult], wall: float, concurrency: int) -> dict:
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    out = sum(r.output_tokens for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "seconds": wall,
        "req_s": len(results) / wall,
        "out_tok_s": out / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "tpot_p50_ms": 1e3 * pct(tpot, 50) if tpot else None,
        "tpot_p99_ms": 1e3 * pct(tpot, 99) if tpot else None,
        "latency_mean_s": statistics.mean(r.latency for r in results),
        "prompt_tokens_mean": prompt / len(results),
        "cache_hit_rate": sum(r.cached_tokens for r in results) / max(1, prompt),
        "retries": sum(r.retries for r in results),
    }


# ---------------------------------------------------------------------- driver
def bench_server(url: str, model: str, args, api_key: str | None = None) -> list[dict]:
    rows = []
    warm = shared_prefix_chats(1, 16, seed=99)
    asyncio.run(run_level(url, model, warm, 1, 2, api_key))  # first-request costs
    # one constrained request: a plait server builds its grammar backend in the background
    # once it idles (~2 s of a core on SmolLM2); built now, not beside the first level
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Reply in JSON."}],
        "max_tokens": 4, "response_format": {"type": "json_object"}})
    for c in args.concurrency:
        n = args.requests or max(16, 4 * c)
        chats = shared_prefix_chats(n, args.prefix_words, seed=c)
        httpx.post(url + "/flush_cache", headers=headers, timeout=60)
        row = asyncio.run(run_level(url, model, chats, c, args.max_tokens, api_key))
        print(
            f"  concurrency {c:3d}: {row['req_s']:.2f} req/s, {row['out_tok_s']:.0f} tok/s, "
            f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, hit {row['cache_hit_rate']:.0%}",
            flush=True,
        )
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    lines = [
        "| radix cache | clients | req/s | out tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| TPOT p50 (ms) | TPOT p99 (ms) | prompt cache hit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, rows in results.items():
        for r in rows:
            tpot50 = "—" if r["tpot_p50_ms"] is None else f"{r['tpot_p50_ms']:.1f}"
            tpot99 = "—" if r["tpot_p99_ms"] is None else f"{r['tpot_p99_ms']:.1f}"
            lines.append(
                f"| {mode} | {r['concurrency']} | {r['req_s']:.2f} | {r['out_tok_s']:.0f} "
                f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {tpot50} | {tpot99} "
                f"| {r['cache_hit_rate']:.0%} |"
            )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: plait's plait-tiny)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    ap.add_argument(
        "--requests", type=int, default=0, help="requests per level (default: max(16, 4 x clients))"
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument(
        "--prefix-words", type=int, default=400, help="words in the shared system prompt"
    )
    ap.add_argument("--cache", default="on,off", help="radix cache modes to run: on, off or both")
    ap.add_argument(
        "--url",
        default=None,
        help="benchmark this running server instead of starting one (one cache mode)",
    )
    ap.add_argument("--api-key", default=None, help="for --url")
    ap.add_argument(
        "--server-args",
        default="{}",
        help='extra ServerArgs for the started servers, as JSON (e.g. \'{"device": "cuda"}\')',
    )
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a quick check: clients 1,4, 8 requests, 8 tokens, short prefix",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests, args.max_tokens, args.prefix_words = "1,4", 8, 8, 60
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.cache = [m.strip() for m in args.cache.split(",")]
    if not set(args.cache) <= {"on", "off"}:
        ap.error("--cache: on, off or on,off")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    results: dict[str, list[dict]] = {}
    meta = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
    }
    if args.url:
        info = httpx.get(
            args.url + "/get_model_info",
            timeout=30,
            headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
        ).json()
        print(f"server {args.url} ({info['served_model_name']})", flush=True)
        results["server"] = bench_server(args.url, info["served_model_name"], args, args.api_key)
        meta["model"] = info["model_path"]
    else:
        from plait.launch import ServerProcess

        extra = json.loads(args.server_args)
        for mode in args.cache:
            print(f"radix cache {mode}: starting plait serve", flush=True)
            with ServerProcess(
                args.model,
                disable_radix_cache=mode == "off",
                log_level="warning",
                served_model_name="bench",
                **extra,
            ) as rt:
                info = httpx.get(rt.url + "/get_server_info", timeout=30).json()
                meta.update(
                    model=info["model_path"],
                    device=info["device"],
                    dtype=info["dtype"],
                    attention_backend=info.get("attention_backend"),
                    max_total_tokens=info["max_total_tokens"],
                )
                results[mode] = bench_server(rt.url, "bench", args)
    table = markdown(results)
    print()
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"meta": meta, "results": results, "markdown": table}, indent=2) + "\n"
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
