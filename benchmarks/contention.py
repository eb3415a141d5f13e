"""Throughput under CPU contention: quiet vs with a CPU-heavy competitor process beside the
measured engine, and the ratio (issue 13: plait must keep >= 0.5x of its quiet throughput).

    python -m benchmarks.contention [--model plait-tiny|smollm2] [--engines plait,plait-t2,vllm,...]
        [--competitor matmul|plait] [--workload judge] [--repeats 3] [--quick]
        [--spin plait|bounded|default] [--num-threads N] [--competitor-threads N]
    python -m benchmarks.run --contention ...   (the same, from the suite's entry point)

Competitors (started once, kept busy for the whole contended phase, then stopped):
  matmul  a PyTorch process multiplying 512x512 fp32 matrices in a loop on all cores with
          torch's default threads and OpenMP settings (an ordinary CPU training/inference job)
  plait   a second plait Engine on the same model generating the decode workload in a loop
          (a second server under load on a shared host)

Each repetition runs the workload quiet, then contended (the order reversed every other
repetition); figures are medians. `--spin` sets how the measured plait's children's OpenMP
threads wait (an A/B of plait/runtime/child_env.py's choice; competitors keep their own
settings): `plait` leaves plait's own setting,
`bounded` spins briefly (GOMP_SPINCOUNT=20000, KMP_BLOCKTIME=1), `default` as OpenMP does by
default (GOMP_SPINCOUNT=300000, KMP_BLOCKTIME=200). `--num-threads N` fixes plait's torch
threads at N (the measured engine and the plait competitor), as before the adaptive thread
count (plait/runtime/thread_tuner.py); without it plait adapts, and the result records its
thread statistics at the end.

Writes benchmarks/results/contention.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import workloads as wl
from benchmarks.engine import build_cpu_kernels

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SPIN = {
    "plait": {},
    "bounded": {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "1"},
    "default": {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"},
}

_MATMUL = """
import torch, time
a = torch.randn(512, 512); b = torch.randn(512, 512)
while True:
    for _ in range(50):
        a = torch.mm(a, b); a = a / a.norm()
"""

_PLAIT = """
import sys
import plait
from benchmarks import workloads as wl
from benchmarks.engine import build_cpu_kernels
from plait.models.config import ModelConfig
model, threads = sys.argv[1], int(sys.argv[2]) or None
w = wl.decode(ModelConfig.from_dir(model).vocab_size, n=16, prompt_len=128, out=64)
with plait.Engine(model, log_level="warning", num_threads=threads) as eng:
    print("ready", flush=True)
    while True:
        eng.flush_cache()
        eng.generate(input_ids=w.prompts, sampling_params={
            "max_new_tokens": w.max_new_tokens, "temperature": 0.0, "ignore_eos": True})
"""


class Competitor:
    """A CPU-heavy process beside the measured engine, in its own process group."""

    def __init__(self, kind: str, model: str, num_threads: int | None = None) -> None:
        code = {"matmul": _MATMUL, "plait": _PLAIT}[kind]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
        self.kind = kind
        argv = [sys.executable, "-c", code, model, str(num_threads or 0)]
        self.proc = subprocess.Popen(argv, env=env,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        if kind == "plait":  # busy once its engine is up
            line = self.proc.stdout.readline()
            if "ready" not in line:
                self.close()
                raise RuntimeError(f"the plait competitor did not start (code {self.proc.poll()})")
        time.sleep(2.0)  # let it reach its steady load

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def plait_variant(name: str, threads: int | None, spin: str) -> tuple[int | None, str]:
    """(threads, spin) of plait or a variant for an A/B within one run: plait-t2 (2 fixed
    threads), plait-spin:default (its children wait as OpenMP does by default),
    plait-t2-spin:bounded; plain `plait` keeps the defaults given."""
    for part in name.split("-")[1:]:
        if part[:1] == "t" and part[1:].isdigit():
            threads = int(part[1:])
        elif part.startswith("spin:") and part[5:] in SPIN:
            spin = part[5:]
        else:
            raise SystemExit(f"contention: unknown plait variant {part!r} in {name!r}")
    return threads, spin


def _plait_engine(name: str, model: str, args):
    from benchmarks.engine import PlaitEngine

    threads, spin = plait_variant(name, args.num_threads, args.spin)
    saved = dict(os.environ)
    os.environ.update(SPIN[spin])  # the children read it when they start
    try:
        return PlaitEngine(name, model, log_level="warning", num_threads=threads)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _engines(names: set[str], model: str, workload: wl.SuiteWorkload, args) -> list:
    engines: list = []
    for name in sorted(n for n in names if n == "plait" or n.startswith("plait-")):
        engines.append(_plait_engine(name, model, args))
    if "vllm" in names:
        from benchmarks.run import LOGS, PeerWorker

        LOGS.mkdir(parents=True, exist_ok=True)
        worker = PeerWorker(model, {workload.name: workload}, args.vllm_kv_gib, args.peers_venv,
                            LOGS / "vllm-contention.log")
        vllm = next(e for e in worker.engines() if "prefix cache on" in e.name)
        vllm.close = worker.close  # the worker holds the engine
        engines.append(vllm)
    if "llamacpp" in names:
        from benchmarks import peers
        from benchmarks.roofline import default_ggufs
        from benchmarks.run import LOGS, PeerWorker

        ggufs = args.gguf or default_ggufs(args.model, model)[:1]  # the Q4_1 file
        if not ggufs:
            raise SystemExit("contention: llamacpp needs --gguf for this model")
        LOGS.mkdir(parents=True, exist_ok=True)
        worker = PeerWorker(model, {workload.name: workload}, args.vllm_kv_gib, args.peers_venv,
                            LOGS / "llamacpp-contention.log",
                            ["--engines", peers.llamacpp_name(ggufs[0]), "--gguf", ggufs[0]],
                            iomp=False)
        llama = worker.engines()[0]
        llama.close = worker.close
        engines.append(llama)
    return engines


def measure(args) -> dict:
    from plait.models.config import ModelConfig
    from plait.models.resolve import resolve_model_path

    model = resolve_model_path(args.model)
    w = wl.suite(ModelConfig.from_dir(model).vocab_size, quick=args.quick)[args.workload]
    build_cpu_kernels()
    engines = _engines(set(args.engines.split(",")), model, w, args)
    runs: dict = {e.name: {"quiet": [], "contended": []} for e in engines}
    try:
        for e in engines:
            if hasattr(e, "warm_up"):  # plait: kernels loaded, thread tuner trained
                e.warm_up()
            e.run_suite(w.head(2))  # warm-up
        for rep in range(args.repeats):
            phases = ("quiet", "contended") if rep % 2 == 0 else ("contended", "quiet")
            for phase in phases:
                comp_threads = args.competitor_threads or args.num_threads
                comp = (Competitor(args.competitor, model, comp_threads)
                        if phase == "contended" else None)
                try:
                    for e in engines if rep % 2 == 0 else engines[::-1]:  # A/B alternately
                        secs, _ = e.run_suite(w)
                        runs[e.name][phase].append(secs)
                        print(f"  rep {rep} {phase:9s} {e.name:12s} {secs:8.2f} s", flush=True)
                finally:
                    if comp is not None:
                        comp.close()
        threads = {e.name: e.engine.get_server_info()["threads"]
                   for e in engines if hasattr(e, "engine")}
    finally:
        for e in engines:
            e.close()
    out = {}
    for name, r in runs.items():
        quiet, contended = statistics.median(r["quiet"]), statistics.median(r["contended"])
        out[name] = {
            "quiet_req_s": w.num_requests / quiet, "contended_req_s": w.num_requests / contended,
            "contended_vs_quiet": quiet / contended, "runs_s": r,
        }
    for name, stats in threads.items():
        out[name]["threads"] = stats
    from benchmarks.run import _git

    return {"model": args.model, "git": _git(), "workload": w.description,
            "competitor": args.competitor,
            "spin": args.spin, "num_threads": args.num_threads or "adaptive",
            "competitor_threads": args.competitor_threads or args.num_threads or "adaptive",
            "repeats": args.repeats, "cpus": os.cpu_count(), "engines": out}


def markdown(res: dict) -> str:
    lines = [f"## Throughput under contention — {res['model']}, {res['workload']}", "",
             f"competitor: {res['competitor']}; OpenMP spin: {res['spin']}; plait threads: "
             f"{res['num_threads']}; medians of {res['repeats']}", "",
             "| engine | quiet req/s | contended req/s | contended / quiet |", "|---|---|---|---|"]
    for name, r in res["engines"].items():
        lines.append(f"| {name} | {r['quiet_req_s']:.2f} | {r['contended_req_s']:.2f} | "
                     f"{r['contended_vs_quiet']:.2f}x |")
    return "\n".join(lines) + "\n"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--competitor", choices=("matmul", "plait"), default="matmul")
    ap.add_argument("--workload", default="judge", choices=("judge", "decode", "json", "tree"))
    ap.add_argument("--spin", choices=tuple(SPIN), default="plait",
                    help="plait children's OpenMP waiting: plait's choice, a bounded spin, or "
                         "OpenMP's default (an A/B of plait/runtime/child_env.py's choice)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="fix plait's torch threads at N (default: plait's adaptive count)")
    ap.add_argument("--competitor-threads", type=int, default=None,
                    help="the plait competitor's fixed threads (default: as --num-threads)")


def main(argv=None) -> int:
    from benchmarks import peers

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="plait-tiny")
    ap.add_argument("--engines", default="plait",
                    help="subset of plait,vllm,llamacpp, and plait variants: plait-tN (N fixed "
                         "threads), plait-spin:default|bounded (its children's OpenMP wait), "
                         "e.g. plait,plait-t2 compares the adaptive and the fixed count in one run")
    ap.add_argument("--gguf", action="append", default=None,
                    help="GGUF for llamacpp (default for smollm2: its Q4_1 file)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the suite's tiny workload sizes")
    ap.add_argument("--vllm-kv-gib", type=float, default=2)
    ap.add_argument("--peers-venv", type=Path, default=peers.DEFAULT_VENV)
    ap.add_argument("--out", type=Path, default=RESULTS / "contention.json")
    add_args(ap)
    res = measure(ap.parse_args(argv))
    args_out = ap.parse_args(argv).out
    args_out.parent.mkdir(parents=True, exist_ok=True)
    args_out.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
