"""Scale-out benchmark: 2 plait replicas behind sglang-router (cache_aware vs round_robin) and
one replica alone, on shared-prefix workloads.

    python -m benchmarks.scaleout                       # plait-tiny (+ /tmp/smol/hf if present)
    python -m benchmarks.scaleout --model /tmp/smol/hf --rubrics 8 --items 64
    python -m benchmarks.scaleout --quick               # a minute: 4 rubrics x 4 items

Workloads (text prompts, greedy, `ignore_eos`, so every request generates --max-tokens):
- judge: R distinct rubrics x I items, interleaved in a seeded random order, through the
  native /generate;
- chat: multi-turn conversations over S shared system prompts (conversation c uses system
  c % S), each turn sending the whole history, through /v1/chat/completions.

Modes: `single` (requests straight to replica 0; replica 1 idle), `cache_aware` and
`round_robin` (a fresh router per run in front of both replicas). Every run starts from
flushed caches. Reported per run: wall time, requests/s, output tokens/s, and from the
replicas' own counters (/get_server_info deltas): prompt tokens, cached tokens, tokens
prefilled (prompt - cached), hit rate (cached / prompt) and requests per replica. Hit rate
and tokens prefilled do not depend on the machine's load; throughput does.

Two KV pool regimes per replica: `ample` (the pool holds every prefix) and `tight` (it holds
about 60% of the judge rubrics plus the running requests): when one replica cannot hold the
whole working set, cache-aware routing splits the prefixes between the replicas' caches while
round robin makes both replicas hold all of them.

Targets (issue 15, judge workload): cache_aware's hit rate within 5 points of single's, and
cache_aware's prefilled-token savings (cached tokens) >= 1.5x round_robin's.
Results: benchmarks/results/scaleout-<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.serving import WORDS
from plait.args import ServerArgs
from plait.launch import free_port
from plait.server.replicas import free_port_block, router_command

RESULTS = Path(__file__).parent / "results"
SMOL = "/tmp/smol/hf"
MODES = ("single", "cache_aware", "round_robin")
START_TIMEOUT_S = 900.0


def log(msg: str) -> None:
    print(f"[scaleout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- workloads
def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Judge:
    rubrics: list[str]
    items: int
    max_tokens: int

    @classmethod
    def make(cls, num_rubrics: int, items: int, rubric_words: int, max_tokens: int) -> Judge:
        rng = random.Random(15)
        rubrics = [
            f"Rubric {r}. You grade answers. {_words(rng, rubric_words)}\n"
            for r in range(num_rubrics)
        ]
        return cls(rubrics, items, max_tokens)

    def requests(self) -> list[dict]:
        """Every (rubric, item) pair in a seeded random order: interleaved, but without a
        period that round robin over 2 replicas could align with (r0 r1 ... r7 r0 ... would
        send each rubric to the same replica every time)."""
        rng = random.Random(16)
        pairs = [(r, i) for r in range(len(self.rubrics)) for i in range(self.items)]
        rng.shuffle(pairs)
        return [
            {
                "text": f"{self.rubrics[r]}Item {i}: {_words(rng, 15)}\nGrade:",
                "sampling_params": {
                    "max_new_tokens": self.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            for r, i in pairs
        ]

    async def run(self, client: httpx.AsyncClient, concurrency: int) -> tuple[int, int]:
        queue = list(reversed(self.requests()))
        done = [0, 0]  # requests, output tokens

        async def worker() -> None:
            while queue:
                body = queue.pop()
                r = await client.post("/generate", json=body)
                r.raise_for_status()
                done[0] += 1
                done[1] += r.json()["meta_info"]["completion_tokens"]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done[0], done[1]


@dataclass
class Chat:
    systems: list[str]
    conversations: int
    turns: int
    max_tokens: int

    @classmethod
    def make(
        cls, num_systems: int, conversations: int, turns: int, system_words: int, max_tokens: int
    ) -> Chat:
        rng = random.Random(17)
        systems = [
            f"System {s}: you are a support assistant. {_words(rng, system_words)}"
            for s in range(num_systems)
        ]
        return cls(systems, conversations, turns, max_tokens)

    async def run(self, client: httpx.AsyncClient, concurrency: int) -> tuple[int, int]:
        rng = random.Random(18)
        questions = [
            [_words(rng, 10) for _ in range(self.turns)] for _ in range(self.conversations)
        ]
        queue = list(reversed(range(self.conversations)))
        done = [0, 0]

        async def conversation(c: int) -> None:
            messages = [{"role": "system", "content": self.systems[c % len(self.systems)]}]
            for t in range(self.turns):
                messages.append({"role": "user", "content": f"Q{c}.{t}: {questions[c][t]}"})
                body = {
                    "messages": messages,
                    "max_tokens": self.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                out = r.json()
                messages.append(
                    {"role": "assistant", "content": out["choices"][0]["message"]["content"]}
                )
                done[0] += 1
                done[1] += out["usage"]["completion_tokens"]

        async def worker() -> None:
            while queue:
                await conversation(queue.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done[0], done[1]


# ---------------------------------------------------------------------- processes
class Replicas:
    """`plait serve --dp 2` (no router): replicas on port+1, port+2."""

    def __init__(self, model: str, max_total_tokens: int | None, log_path: Path) -> None:
        self.port = free_port_block(3)
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in (1, 2)]
        cmd = [
            sys.executable,
            "-m",
            "plait",
            "serve",
            "--dp",
            "2",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        cmd += ["--model", model]
        if max_total_tokens:
            cmd += ["--max-total-tokens", str(max_total_tokens)]
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_ok(u + "/health") for u in self.urls):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"replicas did not start; see {log_path}")
            time.sleep(1.0)

    def stats(self) -> list[dict]:
        return [httpx.get(u + "/get_server_info", timeout=60).json() for u in self.urls]

    def flush(self) -> None:
        for u in self.urls:
            for _ in range(60):  # refused while requests are still finishing
                if httpx.post(u + "/flush_cache", timeout=60).status_code == 200:
                    break
                time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Router:
    def __init__(self, policy: str, urls: list[str], log_path: Path) -> None:
        args = ServerArgs(port=free_port(), router_policy=policy, log_level="warning")
        self.url = args.url
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = router_command(args, urls, prometheus_port=free_port())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                body = httpx.get(self.url + "/readiness", timeout=5).json()
                if body.get("healthy_workers") == len(urls):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router did not start; see {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------- one run
COUNTERS = ("prompt_tokens", "cached_tokens", "finished_requests")


def run_mode(mode: str, workload, replicas: Replicas, concurrency: int, log_path: Path) -> dict:
    replicas.flush()
    router = None if mode == "single" else Router(mode, replicas.urls, log_path)
    url = replicas.urls[0] if router is None else router.url
    before = replicas.stats()
    try:

        async def go():
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                return await workload.run(client, concurrency)

        t0 = time.perf_counter()
        requests, out_tokens = asyncio.run(go())
        wall = time.perf_counter() - t0
    finally:
        if router is not None:
            router.stop()
    after = replicas.stats()
    per = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    prompt = sum(p["prompt_tokens"] for p in per)
    cached = sum(p["cached_tokens"] for p in per)
    return {
        "requests": requests,
        "wall_s": round(wall, 3),
        "req_per_s": round(requests / wall, 3),
        "out_tok_per_s": round(out_tokens / wall, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "hit_rate": round(cached / max(1, prompt), 4),
        "requests_per_replica": [p["finished_requests"] for p in per],
    }


def targets(judge: dict) -> dict:
    """The issue's targets, and the two readings of "1.5x round_robin's prefilled-token
    savings": cached tokens (tokens not prefilled) cache_aware / round_robin, and tokens
    prefilled round_robin / cache_aware."""
    single, ca, rr = judge["single"], judge["cache_aware"], judge["round_robin"]
    cached_ratio = ca["cached_tokens"] / max(1, rr["cached_tokens"])
    prefill_ratio = rr["prefilled_tokens"] / max(1, ca["prefilled_tokens"])
    return {
        "hit_rate_gap_points": round(100 * (single["hit_rate"] - ca["hit_rate"]), 2),
        "hit_rate_within_5_points": ca["hit_rate"] >= single["hit_rate"] - 0.05,
        "savings_vs_round_robin": round(cached_ratio, 3),
        "savings_at_least_1_5x": cached_ratio >= 1.5,
        "round_robin_prefill_vs_cache_aware": round(prefill_ratio, 3),
        # prefill beyond what one replica needs (0 when routing loses no sharing)
        "excess_prefill_cache_aware": ca["prefilled_tokens"] - single["prefilled_tokens"],
        "excess_prefill_round_robin": rr["prefilled_tokens"] - single["prefilled_tokens"],
    }


def bench_model(model: str, a: argparse.Namespace, logs: Path, save) -> dict:
    """Both regimes for one model; `save(result)` after each, so a run cut short keeps what
    it measured."""
    judge = Judge.make(a.rubrics, a.items, a.rubric_words, a.max_tokens)
    chat = Chat.make(a.systems, a.conversations, a.turns, a.system_words, a.max_tokens)
    log_path = logs / f"scaleout-{_tag(model)}.log"
    out: dict = {"model": model, "regimes": {}}
    replicas = Replicas(model, None, log_path)
    try:
        # the rubric's length in this model's tokens sizes the tight pool
        replicas.flush()
        before = replicas.stats()[0]["prompt_tokens"]
        r = httpx.post(
            replicas.urls[0] + "/generate",
            timeout=600,
            json={"text": judge.rubrics[0], "sampling_params": {"max_new_tokens": 1}},
        )
        r.raise_for_status()
        rubric_tokens = replicas.stats()[0]["prompt_tokens"] - before
        out["rubric_tokens"] = rubric_tokens
        out["regimes"]["ample"] = _regime(replicas, None, judge, chat, a, log_path)
        save(out)
    finally:
        replicas.stop()
    if not a.no_tight:
        held = math.ceil(0.6 * a.rubrics)
        size = held * rubric_tokens + a.concurrency * (rubric_tokens // 4 + 64 + a.max_tokens)
        log(f"{model}: tight regime, {size} KV tokens per replica ({held} of {a.rubrics} rubrics)")
        replicas = Replicas(model, size, log_path)
        try:
            out["regimes"]["tight"] = _regime(replicas, size, judge, chat, a, log_path)
            save(out)
        finally:
            replicas.stop()
    return out


def _regime(replicas: Replicas, size, judge: Judge, chat: Chat, a, log_path: Path) -> dict:
    res: dict = {"max_total_tokens": size or replicas.stats()[0]["max_total_tokens"]}
    for wname, workload in (("judge", judge), ("chat", chat)):
        res[wname] = {}
        for mode in MODES:
            log(f"{wname} / {mode}")
            res[wname][mode] = run_mode(mode, workload, replicas, a.concurrency, log_path)
            log(f"  {res[wname][mode]}")
    res["targets"] = targets(res["judge"])
    res["targets_chat"] = targets(res["chat"])
    return res


def _tag(model: str) -> str:
    return "smollm2" if model.rstrip("/") == SMOL else Path(model).name or "model"


# ---------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    w = result["workload"]
    lines = [
        f"# Scale-out: 2 replicas behind sglang-router — {result['model']}",
        "",
        (
            f"judge: {w['rubrics']} rubrics x {w['items']} items interleaved "
            f"({result.get('rubric_tokens')} tokens per rubric); chat: {w['conversations']} "
            f"conversations x {w['turns']} turns over {w['systems']} system prompts; "
            f"{w['max_tokens']} output tokens each, {w['concurrency']} concurrent clients."
        ),
        (
            f"Machine: {result['machine']} (throughput is load-dependent; hit rate and tokens "
            "prefilled are not)."
        ),
        "",
    ]
    for regime, res in result["regimes"].items():
        lines += [f"## KV pool: {regime} ({res['max_total_tokens']} tokens per replica)", ""]
        for wname in ("judge", "chat"):
            lines += [
                f"**{wname}**",
                "",
                "| mode | hit rate | prompt tok | cached tok | prefilled tok | req/replica | req/s "
                + "| out tok/s |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for mode, r in res[wname].items():
                lines.append(
                    f"| {mode} | {100 * r['hit_rate']:.1f}% | {r['prompt_tokens']} | "
                    f"{r['cached_tokens']} | {r['prefilled_tokens']} | "
                    f"{'/'.join(map(str, r['requests_per_replica']))} | {r['req_per_s']} | "
                    f"{r['out_tok_per_s']} |"
                )
            t = targets(res[wname])
            lines += [
                "",
                (
                    f"cache_aware's hit rate minus single's: {-t['hit_rate_gap_points']:+.1f} "
                    f"points ({'meets' if t['hit_rate_within_5_points'] else 'misses'} "
                    "'within 5 points'); "
                    f"cached tokens vs round_robin: {t['savings_vs_round_robin']}x "
                    f"({'meets' if t['savings_at_least_1_5x'] else 'below'} 1.5x); "
                    f"tokens prefilled, round_robin / cache_aware: "
                    f"{t['round_robin_prefill_vs_cache_aware']}x; prefill beyond one replica's: "
                    f"cache_aware {t['excess_prefill_cache_aware']:+d}, "
                    f"round_robin {t['excess_prefill_round_robin']:+d} tokens"
                ),
                "",
            ]
    return "\n".join(lines)


def _save(result: dict, a: argparse.Namespace, stem: Path) -> None:
    result["workload"] = {
        k: getattr(a, k)
        for k in (
            "rubrics",
            "items",
            "rubric_words",
            "systems",
            "conversations",
            "turns",
            "system_words",
            "max_tokens",
            "concurrency",
        )
    }
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["quick"] = a.quick
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result) + "\n")
    log(f"wrote {stem}.json/.md")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        action="append",
        help=f"repeatable (default: plait-tiny, and {SMOL} when that directory exists)",
    )
    p.add_argument("--rubrics", type=int, default=8)
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--rubric-words", type=int, default=300)
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--no-tight", action="store_true", help="skip the tight-KV-pool regime")
    p.add_argument("--quick", action="store_true", help="4 rubrics x 4 items, 4 chats x 2 turns")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    if a.quick:
        a.rubrics, a.items, a.rubric_words = 4, 4, 60
        a.systems, a.conversations, a.turns, a.system_words = 2, 4, 2, 40
        a.concurrency = 4
    if not a.model:
        a.model = ["plait-tiny"] + ([SMOL] if os.path.isdir(SMOL) else [])
    return a


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render":
        # re-render a result's markdown: python -m benchmarks.scaleout --render RESULT.json
        path = Path(sys.argv[2])
        result = json.loads(path.read_text())
        for res in result["regimes"].values():
            res["targets"], res["targets_chat"] = targets(res["judge"]), targets(res["chat"])
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(markdown(result) + "\n")
        return 0
    a = parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for model in a.model:
        log(f"model {model}")
        stem = out_dir / f"scaleout-{_tag(model)}{'-quick' if a.quick else ''}"
        logs = Path(tempfile.gettempdir())  # the servers' and routers' output
        result = bench_model(model, a, logs, lambda r, stem=stem: _save(r, a, stem))
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
