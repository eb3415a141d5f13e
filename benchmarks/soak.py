"""Soak benchmark: N minutes of mixed traffic, hostile requests included, against a
`plait serve` on loopback; reports whether memory and KV usage end where they started.

    python -m benchmarks.soak [--minutes 10] [--model PATH] [--concurrency 8] [--url URL]
    python -m benchmarks.soak --seconds 20          # a quick check of the harness

Traffic (closed-loop clients, each picking a request kind at random): native /generate
(plain, batched, n > 1, logprobs, regex-constrained), streams (some dropped mid-way: client
disconnects), OpenAI completions and chat (incl. json_object), and hostile requests (the
classes of issue 14: non-finite floats, huge integers, malformed JSON, deep nesting, oversized
bodies, strict booleans), which must all be 4xx. Every --sample-interval seconds it records
the RSS of the server and each child process (psutil) and the scheduler's KV usage.

Flat means: after the traffic stops and the server drains, each process's RSS is within
--tolerance (5%) of its level at the end of the warm-up (measured the same way: traffic
paused, drained), and the KV slots held by requests are back to their warm-up level (the
radix cache may keep evictable prefixes; those are reported, not counted as a leak).
Prints a summary and writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

RESULTS = Path(__file__).parent / "results"
HUGE = 2**64 + 7


# ---------------------------------------------------------------------- traffic
def _gen(rng: random.Random, **extra) -> dict:
    return {
        "text": f"Request {rng.randrange(10**6)}: tell me about tides.",
        "sampling_params": {"max_new_tokens": rng.choice((4, 8, 16)), "temperature": 0.7},
        **extra,
    }


HOSTILE_BODIES: list[Any] = [
    {"text": "x", "sampling_params": {"temperature": 1e39}},
    {"text": "x", "sampling_params": {"repetition_penalty": 1e-300}},
    {"text": "x", "sampling_params": {"seed": HUGE}},
    {"text": "x", "sampling_params": {"top_k": HUGE}},
    {"text": "x", "sampling_params": {"min_new_tokens": 2, "stop_token_ids": [10**7]}},
    {"input_ids": [[1, 2], 3]},
    {"input_ids": [1, HUGE]},
    {"text": "x", "stream": "false"},
    {"text": "x", "return_logprob": True, "top_logprobs_num": 10**6},
    {"text": "x", "sampling_params": {"stop": ["a"] * 1000}},
    {"text": "x", "sampling_params": {"n": 10**5}},
    b"[" * 20000 + b"]" * 20000,
    b'{"text": "x", "sampling_params": {"temperature": Infinity}}',
    b'{"text": "x"',
]


async def one_request(c: httpx.AsyncClient, rng: random.Random, stats: dict) -> None:
    kinds = [
        "generate",
        "batch",
        "n",
        "logprobs",
        "regex",
        "stream",
        "drop",
        "completion",
        "chat",
        "json",
        "hostile",
        "oversized",
    ]
    kind = rng.choices(kinds, weights=[6, 2, 2, 2, 2, 4, 2, 3, 3, 1, 6, 1])[0]
    stats["sent"][kind] = stats["sent"].get(kind, 0) + 1
    expect_4xx = kind in ("hostile", "oversized")
    if kind == "generate":
        resp = await c.post("/generate", json=_gen(rng))
    elif kind == "batch":
        body = _gen(rng)
        body["text"] = [body["text"], body["text"] + " And waves."]
        resp = await c.post("/generate", json=body)
    elif kind == "n":
        body = _gen(rng)
        body["sampling_params"]["n"] = 3
        resp = await c.post("/generate", json=body)
    elif kind == "logprobs":
        resp = await c.post(
            "/generate",
            json=_gen(rng, return_logprob=True, top_logprobs_num=5, logprob_start_len=0),
        )
    elif kind == "regex":
        body = _gen(rng)
        body["sampling_params"]["regex"] = "(yes|no), [0-9]{1,3}"
        resp = await c.post("/generate", json=body)
    elif kind in ("stream", "drop"):
        body = _gen(rng, stream=True)
        body["sampling_params"]["max_new_tokens"] = 32
        async with c.stream("POST", "/generate", json=body) as r:
            status = r.status_code
            async for i, _ in _enumerate(r.aiter_lines()):
                if kind == "drop" and i >= 2:
                    break  # the client goes away mid-stream
        _count(stats, kind, status, expect_4xx)
        return
    elif kind == "completion":
        resp = await c.post(
            "/v1/completions", json={"prompt": "Once upon", "max_tokens": 8, "n": 2}
        )
    elif kind == "chat":
        resp = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        )
    elif kind == "json":
        resp = await c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "json please"}],
                "max_tokens": 16,
                "response_format": {"type": "json_object"},
            },
        )
    elif kind == "hostile":
        body = rng.choice(HOSTILE_BODIES)
        if isinstance(body, bytes):
            resp = await c.post(
                "/generate", content=body, headers={"Content-Type": "application/json"}
            )
        else:
            resp = await c.post("/generate", json=body)
    else:  # oversized: over the default 16 MiB --max-request-bytes
        resp = await c.post("/generate", content=b" " * ((16 << 20) + 1))
    _count(stats, kind, resp.status_code, expect_4xx)


async def _enumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1


def _count(stats: dict, kind: str, status: int, expect_4xx: bool) -> None:
    stats["status"][str(status)] = stats["status"].get(str(status), 0) + 1
    ok = (400 <= status < 500) if expect_4xx else status == 200
    if not ok:
        stats["unexpected"].append((kind, status))


async def traffic(url: str, seconds: float, concurrency: int, headers: dict, stats: dict) -> None:
    stop = time.monotonic() + seconds

    async def client(i: int) -> None:
        rng = random.Random(i * 7919 + int(time.time()))
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as c:
            while time.monotonic() < stop:
                try:
                    await one_request(c, rng, stats)
                except httpx.HTTPError as e:
                    stats["errors"].append(f"{type(e).__name__}: {e}")

    await asyncio.gather(*(client(i) for i in range(concurrency)))


# ---------------------------------------------------------------------- sampling
def rss_by_process(pid: int) -> dict[str, int]:
    proc = psutil.Process(pid)
    out = {"server": proc.memory_info().rss}
    for child in proc.children(recursive=True):
        try:
            out[f"{child.pid}:{_role(child)}"] = child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def _role(proc: psutil.Process) -> str:
    cmd = proc.cmdline()
    return cmd[3] if len(cmd) > 3 and cmd[2] == "plait.launch" else proc.name()


def kv_stats(url: str, headers: dict) -> dict[str, Any]:
    info = httpx.get(url + "/get_server_info", headers=headers, timeout=30).json()
    return {
        k: info.get(k)
        for k in (
            "kv_used",
            "kv_usage",
            "kv_evictable",
            "max_total_tokens",
            "num_running",
            "num_waiting",
        )
    }


async def sampler(url: str, pid: int, headers: dict, interval: float, samples: list, stop) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        samples.append(
            {
                "t": round(time.monotonic() - t0, 1),
                "rss": rss_by_process(pid),
                **await asyncio.to_thread(kv_stats, url, headers),
            }
        )
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def drained(url: str, headers: dict, pid: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until nothing runs or waits, let memory settle, then sample."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = kv_stats(url, headers)
        if not kv["num_running"] and not kv["num_waiting"]:
            break
        time.sleep(0.5)
    time.sleep(2.0)
    return {"rss": rss_by_process(pid), **kv_stats(url, headers)}


# ---------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict[str, Any]:
    from plait.launch import ServerProcess

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rt = None
    if args.url:
        url = args.url.rstrip("/")
        pid = args.pid
        if pid is None:
            raise SystemExit("soak: --url needs --pid (the server's process id) for RSS")
    else:
        rt = ServerProcess(args.model, max_running_requests=args.concurrency, log_level="warning")
        url, pid = rt.url, rt.proc.pid
    stats: dict[str, Any] = {"sent": {}, "status": {}, "unexpected": [], "errors": []}
    try:
        total = args.seconds if args.seconds else args.minutes * 60
        warmup = min(args.warmup, total / 4)
        asyncio.run(traffic(url, warmup, args.concurrency, headers, stats))
        base = drained(url, headers, pid)

        async def main_phase() -> list:
            samples: list = []
            stop = asyncio.Event()
            task = asyncio.create_task(
                sampler(url, pid, headers, args.sample_interval, samples, stop)
            )
            await traffic(url, total - warmup, args.concurrency, headers, stats)
            stop.set()
            await task
            return samples

        samples = asyncio.run(main_phase())
        end = drained(url, headers, pid)
        healthy = httpx.get(url + "/health", headers=headers, timeout=10).status_code == 200
    finally:
        if rt is not None:
            rt.shutdown()
    growth = {
        name: (end["rss"].get(name, 0) - rss) / rss for name, rss in base["rss"].items() if rss
    }
    rss_flat = all(g <= args.tolerance for g in growth.values())
    kv_flat = end["kv_used"] <= base["kv_used"] + args.tolerance * base["max_total_tokens"]
    result = {
        "seconds": total,
        "warmup_s": warmup,
        "concurrency": args.concurrency,
        "requests": sum(stats["sent"].values()),
        "sent": stats["sent"],
        "status": stats["status"],
        "unexpected": stats["unexpected"][:50],
        "client_errors": stats["errors"][:20],
        "baseline": base,
        "end": end,
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "rss_peak": {name: max(s["rss"].get(name, 0) for s in samples) for name in base["rss"]}
        if samples
        else {},
        "kv_used_peak": max((s["kv_used"] for s in samples), default=0),
        "samples": samples,
        "rss_flat": rss_flat,
        "kv_flat": kv_flat,
        "healthy_after": healthy,
        "no_5xx": not any(k.startswith("5") for k in stats["status"]),
        "flat": rss_flat and kv_flat and healthy and not stats["unexpected"],
    }
    return result


def summary(r: dict[str, Any]) -> str:
    lines = [
        f"soak: {r['seconds']:.0f} s ({r['warmup_s']:.0f} s warm-up), "
        f"{r['concurrency']} clients, {r['requests']} requests",
        f"  status codes: {r['status']}",
        f"  unexpected statuses: {len(r['unexpected'])}   client errors: {len(r['client_errors'])}",
    ]
    for name, g in r["rss_growth"].items():
        base = r["baseline"]["rss"][name] / 2**20
        end = r["end"]["rss"].get(name, 0) / 2**20
        peak = r["rss_peak"].get(name, 0) / 2**20
        lines.append(
            f"  RSS {name:>24}: {base:8.1f} MiB -> {end:8.1f} MiB ({g:+.1%}), peak {peak:.1f}"
        )
    lines.append(
        f"  KV held by requests: {r['baseline']['kv_used']} -> {r['end']['kv_used']} slots "
        f"(peak {r['kv_used_peak']} of {r['end']['max_total_tokens']}); evictable cache "
        f"{r['baseline']['kv_evictable']} -> {r['end']['kv_evictable']}"
    )
    lines.append(
        f"  flat: {r['flat']} (rss {r['rss_flat']}, kv {r['kv_flat']}, "
        f"healthy after {r['healthy_after']}, no 5xx {r['no_5xx']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of warm-up traffic")
    p.add_argument("--model", default=None, help="model path (default: the embedded model)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-interval", type=float, default=5.0)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="that server's pid (for RSS)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = p.parse_args(argv)
    result = run(args)
    print(summary(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
