"""ServerArgs: the one frozen dataclass of runtime options.

Resolved once at launch and passed down; CLI flags (`plait serve --help`) and the keyword
arguments of `plait.Engine` / `plait.Runtime` derive from its fields (SGLang's names).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from plait.models.resolve import DEFAULT_MODEL
from plait.registry import (
    ATTENTION_BACKENDS,
    GRAMMAR_BACKENDS,
    QUANTIZATION_METHODS,
    SCHEDULE_POLICIES,
    Registry,
)

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16")  # bf16: SGLang's spelling
LOG_LEVELS = ("debug", "info", "warning", "error")
GRAMMAR_ISOLATIONS = ("thread", "process")
# `plait serve` reads the API key from here when --api-key is not given (plait.Runtime uses it)
API_KEY_ENV = "PLAIT_API_KEY"
# sglang-router's --policy choices that need nothing but worker URLs (plait/server/replicas.py)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def _choices(registry_: Registry, *extra: str):
    """Choices read from a registry when asked (parts registered later are included)."""
    return lambda: (*extra, *registry_.names())


def _choice_names(choices: Any) -> tuple[str, ...]:
    return tuple(choices()) if callable(choices) else tuple(choices)


def _opt(
    default: Any, help: str, choices: Any = None, flag: str | None = None,
    aliases: tuple[str, ...] = (), serve_only: bool = False,
):
    """A field of ServerArgs: its CLI help, choices, flag name; `serve_only`: an option of the
    HTTP server alone (`plait generate` and the Engine run none, so its CLI leaves it out)."""
    meta: dict[str, Any] = {"help": help}
    if serve_only:
        meta["serve_only"] = True
    if choices:
        meta["choices"] = choices
    if flag:
        meta["flag"] = flag
    if aliases:
        meta["aliases"] = aliases
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _opt(
        None,
        "a Hugging Face checkpoint directory, a .gguf file, a named model (smollm2-135m-instruct, "
        "alias smollm2; fetched once), an embedded test model (plait-tiny, tiny-llama...) or a "
        f"hub name; default: {DEFAULT_MODEL}",
        flag="--model",
    )
    tokenizer_path: str | None = _opt(None, "tokenizer directory (default: the model's)")
    served_model_name: str | None = _opt(
        None, "model name reported by the API (default: path)", serve_only=True
    )
    host: str = _opt("127.0.0.1", "HTTP host to bind", serve_only=True)
    port: int = _opt(30000, "HTTP port to bind", serve_only=True)
    api_key: str | None = _opt(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
        f"{API_KEY_ENV} environment variable, which keeps the key out of `ps`)", serve_only=True,
    )
    api_key_file: str | None = _opt(
        None,
        "JSON file of API keys: {KEY: {name, rpm, tpm, priority}} (requests and tokens per "
        "minute, token buckets, 429 with Retry-After; priority: the key's default and highest "
        "request priority); every endpoint but /health then needs one of them (or --api-key)",
        serve_only=True,
    )
    dtype: str = _opt("auto", "weight/activation dtype (auto: float32 on CPU, bfloat16 on CUDA)", DTYPES)
    kv_cache_dtype: str = _opt(
        "auto", "the KV cache's dtype. auto: the model's (--dtype). bfloat16 (or bf16) beside "
        "float32 weights on the CPU: half the KV bytes, so twice the tokens in the same memory "
        "and half the bytes each decode step's attention reads; q, the attention arithmetic "
        "and its output stay float32 (K and V are rounded to bf16 as they are stored: outputs "
        "can differ from float32 KV's in later tokens)", KV_CACHE_DTYPES,
    )
    device: str = _opt("auto", "cpu, cuda (or cuda:N), or auto")
    context_length: int | None = _opt(None, "maximum context length (default: from the model config)")
    max_running_requests: int = _opt(64, "maximum requests decoded together")
    max_queued_requests: int = _opt(
        4096, "waiting requests beyond this get HTTP 429", serve_only=True
    )
    queue_reserve_fraction: float = _opt(
        0.25,
        "share of --max-queued-requests that batch-tier requests (priority < 0) may not take: "
        "kept for default and interactive requests", serve_only=True,
    )
    request_timeout: float = _opt(
        300.0,
        "seconds a request waits while the scheduler makes no progress at all (no output for "
        "any request) before it is aborted and answered 504 (0: never); a request queued "
        "behind others in a busy server is not aborted",
    )
    shutdown_grace: float = _opt(
        5.0,
        "seconds requests still running at SIGINT/SIGTERM get to finish; past them each ends "
        "with a 503 error (streams with an error event) and the server exits", serve_only=True,
    )
    max_request_bytes: int = _opt(
        16 << 20, "largest HTTP request body accepted; larger ones get 413", serve_only=True
    )
    tool_call_parser: str = _opt(
        "none", "how /v1/chat/completions reads the calls of a model answering tool_choice "
        "'auto' (OpenAI's default with tools): 'hermes', the <tool_call>{\"name\": ..., "
        "\"arguments\": ...}</tool_call> blocks Qwen 2.5 and Hermes models write; 'llama3_json', "
        "the {\"name\": ..., \"parameters\": ...} objects Llama 3.1-3.3 answer with; "
        "'pythonic', the [name(key=value, ...), ...] lists of Llama 3.2 and 4 (vLLM's parsers "
        "of those names); 'none': 'auto' is a 400 ('required' and a named function need no "
        "parser)", ("none", "hermes", "llama3_json", "pythonic"), serve_only=True,
    )
    max_prompt_chars: int | None = _opt(
        None,
        "longest text prompt tokenized; longer ones get 400 untokenized "
        "(default: 32 x the context length)",
    )
    max_total_tokens: int | None = _opt(
        None, "KV pool size in tokens (default: derived from --mem-fraction-static)"
    )
    mem_fraction_static: float = _opt(
        0.25, "fraction of free memory (RAM on CPU, GPU memory on CUDA) given to the KV pool"
    )
    chunked_prefill_size: int = _opt(2048, "maximum tokens prefilled in one step (chunked prefill)")
    disable_chunk_work_cap: bool = _opt(
        False, "every chunk of a long prompt takes --chunked-prefill-size tokens (by default a "
        "chunk after a long context is cut so that its work, its attention over the context "
        "included, is at most what that many tokens cost with no context before them: each "
        "forward, and the wait of every request beside it, stays as long as the first chunk's)",
    )
    chunked_prefill_beside_size: int = _opt(
        512, "while other requests run or wait, a prompt longer than --chunked-prefill-size "
        "prefills in chunks of at most this many tokens' work (the work cap then cuts them as "
        "the context grows), so that the streams riding along and the requests starting beside "
        "it wait for a short forward, not a whole budget's (0: the whole budget, as SGLang and "
        "vLLM do); a long prompt alone takes whole-budget chunks",
    )
    chunked_prefill_new_share: float = _opt(
        0.5, "while a prompt longer than --chunked-prefill-size prefills chunk by chunk, this "
        "share of each step's budget is kept for waiting requests whose prompts fit in it whole: "
        "a short request starts beside the long prompt's next chunk instead of after its last "
        "(0: the long prompt's chunks take the whole budget, as SGLang does)",
    )
    kv_run_tokens: int = _opt(
        16, "KV slots a request sets aside for its next tokens when it allocates (taken only "
        "from free slots, given back before any allocation would fail), so that its decode "
        "tokens sit in adjacent slots that the CPU attention kernel reads as one stream; 0: off "
        "(a decode step then hands the batch's requests consecutive slots in turn)",
    )
    disable_radix_cache: bool = _opt(False, "turn off prefix reuse (same interface, no sharing)")
    schedule_policy: str = _opt(
        "lpm", "lpm: longest prefix match first; fcfs (both by priority first)",
        _choices(SCHEDULE_POLICIES),
    )
    attention_backend: str = _opt(
        "auto", "attention kernels (auto: triton on CUDA, torch on CPU)",
        _choices(ATTENTION_BACKENDS, "auto"),
    )
    grammar_backend: str = _opt(
        "xgrammar", "constrained-decoding backend", _choices(GRAMMAR_BACKENDS)
    )
    grammar_compile_timeout: float = _opt(5.0, "seconds before a constraint compile fails the request")
    grammar_cache_dir: str | None = _opt(None, "persist compiled grammars here (survives restarts)")
    grammar_isolation: str = _opt(
        "thread", "run compiles on threads, or in child processes killed at the timeout",
        GRAMMAR_ISOLATIONS,
    )
    grammar_any_whitespace: bool = _opt(
        False, "JSON constraints allow free whitespace between tokens (at most 12 in a run), as "
        "vLLM's default does; off: one fixed layout, ', ' and ': ' separators",
    )
    lazy_grammar_backend: bool = _opt(
        False, "build the grammar backend (its vocabulary tables, ~70 MB and ~2 s of one core "
        "on SmolLM2) for the first constrained request, which then waits for it, instead of "
        "in the background once the server first idles",
    )
    disable_jump_forward: bool = _opt(
        False, "no grammar jump-forward: the model decodes text the grammar forces, token by "
        "token under the mask, instead of the forced text's own tokenization",
    )
    speculative_ngram: int | None = _opt(
        None, "n-gram (prompt-lookup) speculative decoding: propose up to K tokens that followed "
        "the latest earlier match of the sequence's last n-gram and verify them in one forward "
        "(greedy requests without penalties, constrained ones too; output unchanged; only in "
        "forwards of at most --speculative-ngram-max-rows rows); 0: off. Default: 8, but 0 where decode "
        "steps replay CUDA graphs (verify forwards run eagerly: a 1B model on an H200 decoded "
        "one request at 100 tok/s with drafts, 375 without)",
    )
    speculative_ngram_max_tokens: int = _opt(
        16, "most draft tokens verified per forward, summed over its requests (drafts widen "
        "the forward; requests whose drafts were accepted most get them first)",
    )
    speculative_ngram_max_rows: int = _opt(
        24, "speculate only in forwards this narrow: the decoding requests plus their draft "
        "tokens (on a CPU a forward of a few rows reads the same weights as one row and costs "
        "little more; wider, it turns compute-bound and a rejected draft token costs time); a "
        "batch of this many requests decodes without drafts",
    )
    speculative_ngram_narrow_rows: int = _opt(
        8, "forwards up to this many rows take any request's draft; past it (up to "
        "--speculative-ngram-max-rows) only draft tokens that the request's recent acceptance "
        "makes at least even odds to be kept (SmolLM2 on the 2-core AVX2 VM, 600 tokens of "
        "context: a row past the 12 of a 12-request decode cost 3.4 ms, about half of a "
        "decoded token's 6.2 ms)",
    )
    speculative_ngram_max_match: int = _opt(3, "longest n-gram matched for --speculative-ngram")
    speculative_ngram_min_match: int = _opt(1, "shortest n-gram matched for --speculative-ngram")
    random_seed: int = _opt(0, "seed for sampling of requests that give no seed")
    num_threads: int | None = _opt(
        None, "torch CPU threads in the scheduler, N for every forward (default: adaptive: each "
        "CPU forward runs on 1, 2, 4, ... up to all cores, whichever its measured forward times "
        "favour, re-measured every few seconds since other processes' load comes and goes; "
        "under tensor parallelism all cores split between the ranks)"
    )
    tp_size: int = _opt(
        1, "tensor parallelism: split the model's heads, MLP and vocabulary over N processes "
        "(rank 0 schedules; gloo on CPU, NCCL on CUDA)", flag="--tp", aliases=("--tp-size",),
    )
    disable_cpu_prepack: bool = _opt(
        False, "on CPU, run the logits and the layers' projections on torch's plain weights "
        "instead of prepacked ones (plait's panel kernels, or oneDNN's; the logits copy costs "
        "one extra output embedding of memory)",
    )
    disable_huge_pages: bool = _opt(
        False, "on CPU, leave the weight panels and the KV pool on the allocator's pages "
        "instead of memory advised for 2 MB transparent huge pages (where the host's THP is "
        "madvise or always)",
    )
    disable_cuda_graph: bool = _opt(
        False, "on CUDA, run decode steps eagerly instead of replaying CUDA graphs captured at "
        "start for batch sizes 1, 2, 4, then every 8 up to --cuda-graph-max-bs (graphs need the "
        "triton attention backend; others always decode eagerly)",
    )
    cuda_graph_max_bs: int | None = _opt(
        None, "largest decode batch replayed as a CUDA graph; larger ones run eagerly "
        "(default: --max-running-requests)",
    )
    disable_cpu_linear_kernel: bool = _opt(
        False, "on CPU (float32), prepack the logits and large projections for oneDNN instead "
        "of running every linear on plait's panel kernels (built in the background on first "
        "use, under a minute once, then cached by torch; torch's matmul over the same panels "
        "meanwhile)",
    )
    cpu_bf16_linear_rows: int = _opt(
        0, "on CPU with float32 weights and a CPU with bf16 units (AMX or AVX512-BF16): "
        "forwards of at least N rows (prefill chunks; decode batches of N requests) run the "
        "decoder layers' linears in bf16 through oneDNN, on a bf16 copy of their weights "
        "(SmolLM2's linears: 1.2x at 32 rows, 1.6x at 64, 2.1x at 512). Activations are "
        "rounded to "
        "bf16 for those linears, so outputs can differ from fp32's; norms, attention, the KV "
        "cache and the logits stay as they are. 0 (default): fp32 linears throughout",
    )
    cpu_amx_linear_rows: int = _opt(
        0, "on a CPU with AMX (Intel Xeon 4th generation and later), float32 weights: "
        "forwards of at least N rows (prefill chunks) run plait's fp32 linears on the AMX "
        "tiles, each fp32 value split exactly into three bf16 pieces and multiplied as six "
        "tile products: fp32's accuracy (the error against float64 about half the FMA "
        "kernels'), not bf16's. Off by default: on this project's 2-core VM the tiles ran at "
        "half their rate most of the time and the path measured 0.7-1.4x the FMA kernels at "
        "256-1024 rows (README). 0 (default): never; ignored without AMX",
    )
    disable_cpu_attention_kernel: bool = _opt(
        False, "on CPU, run decode attention as torch's gather + fused attention instead of "
        "plait's AVX2 kernel that reads the KV pool in place (built in the background on first "
        "use, ~1 minute once, then cached by torch)",
    )
    disable_cpu_fused_ops: bool = _opt(
        False, "on CPU (float32), run each decoder layer's small operators (RMSNorm with the "
        "residual add, rotary with the KV store, SiLU * up) as torch's operators instead of "
        "plait's fused kernels (same results bit for bit; built in the background on first "
        "use, under a minute once, then cached by torch)",
    )
    disable_logit_screen: bool = _opt(
        False, "on CPU (float32, a CPU with AMX or AVX512-BF16), compute every greedy step's "
        "full fp32 logits instead of screening them in bf16 and computing only the few "
        "candidate tokens exactly (the same tokens; plait/runtime/logit_screen.py)",
    )
    disable_fused_silu: bool = _opt(
        False, "CPU float32: write each MLP's gate_up product and apply silu(gate) * up in a "
        "second pass, instead of in the linear's epilogue (the same results; "
        "plait/kernels/woq.py GateUpPanelLinear)",
    )
    disable_screen_kernel: bool = _opt(
        False, "on a CPU with AMX-BF16 or AVX512-BF16, run the logit screen's bf16 GEMM through "
        "oneDNN instead of plait's kernel (plait/kernels/screen_kernel.cpp; the same tokens)",
    )
    quantization: str = _opt(
        "none", "CPU: weight-only quantized decoder-layer linears, quantized at load time from "
        "the checkpoint's weights (int8: per-output-row scales; int4: scale and min per 32 "
        "inputs, GGUF Q4_1's form); activations stay fp32. Fewer weight bytes per decode step",
        _choices(QUANTIZATION_METHODS, "none"),
    )
    quantize_lm_head: bool = _opt(
        False, "with --quantization: also quantize the logits GEMM (the output embedding; a "
        "tied input embedding keeps its fp32 copy for the lookup) with the layers' method",
    )
    lm_head_quantization: str = _opt(
        "none", "with --quantization: the logits GEMM's own method (int8 beside int4 layers: "
        "a GGUF's output embedding is usually Q8_0 or Q6_K, which int4 would round off); "
        "none: fp32, or the layers' method with --quantize-lm-head",
        _choices(QUANTIZATION_METHODS, "none"),
    )
    disable_cpu_extend_kernel: bool = _opt(
        False, "on CPU, run prefill (extend) attention as torch's per-request gather + fused "
        "attention instead of plait's kernel that reads the KV pool in place (built in the "
        "background on first use, then cached by torch)",
    )
    stream_interval: int = _opt(1, "send streamed tokens every N decode steps")
    log_level: str = _opt("info", "logging level", LOG_LEVELS)
    ipc_dir: str | None = _opt(None, "directory for the ZMQ ipc:// sockets (default: a private "
                               "temp dir, removed at shutdown; those of killed launches are "
                               "removed by the next)")
    # data parallelism (plait/server/replicas.py): `plait serve` only
    dp_size: int = _opt(
        1, "serve N independent replicas on ports PORT+1..PORT+N (each its own process, KV "
        "pool and radix cache) and print the sglang-router command that fronts them",
        flag="--dp", serve_only=True,
    )
    router: bool = _opt(
        False, "with --dp: also run sglang-router on --host/--port in front of the replicas "
        "(pip install sglang-router)", serve_only=True,
    )
    router_policy: str = _opt(
        "cache_aware", "sglang-router's policy for --dp (cache_aware sends a request to the "
        "replica whose cache most likely holds its prefix)", ROUTER_POLICIES, serve_only=True,
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if "choices" not in f.metadata:
                continue
            allowed = _choice_names(f.metadata["choices"])
            if getattr(self, f.name) not in allowed:
                raise ValueError(
                    f"{f.name}: must be one of {', '.join(allowed)}, got {getattr(self, f.name)!r}"
                )
        for name in ("max_running_requests", "max_queued_requests", "chunked_prefill_size",
                     "stream_interval", "tp_size", "dp_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or self.num_threads < 1
        ):
            raise ValueError(f"num_threads: must be a positive integer, got {self.num_threads!r}")
        if self.speculative_ngram is not None and (
            not isinstance(self.speculative_ngram, int) or self.speculative_ngram < 0
        ):
            raise ValueError(f"speculative_ngram: must be >= 0, got {self.speculative_ngram!r}")
        for name in ("speculative_ngram_max_tokens", "speculative_ngram_max_rows",
                     "speculative_ngram_narrow_rows", "kv_run_tokens", "cpu_bf16_linear_rows",
                     "cpu_amx_linear_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {getattr(self, name)!r}")
        if not 1 <= self.speculative_ngram_min_match <= self.speculative_ngram_max_match:
            raise ValueError(
                "speculative_ngram_min_match, speculative_ngram_max_match: need "
                "1 <= min <= max"
            )
        if self.cuda_graph_max_bs is not None and (
            not isinstance(self.cuda_graph_max_bs, int) or self.cuda_graph_max_bs < 1
        ):
            raise ValueError(
                f"cuda_graph_max_bs: must be a positive integer, got {self.cuda_graph_max_bs!r}"
            )
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device: must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"port: must be in 1..65535, got {self.port!r}")
        if self.context_length is not None and (
            not isinstance(self.context_length, int) or self.context_length < 1
        ):
            raise ValueError(
                f"context_length: must be a positive integer, got {self.context_length!r}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens: must be >= 16, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction_static <= 0.95:
            raise ValueError(f"mem_fraction_static: must be in (0, 0.95], got {self.mem_fraction_static}")
        if not 0.0 <= self.queue_reserve_fraction < 1.0:
            raise ValueError("queue_reserve_fraction: must be in [0, 1)")
        if not isinstance(self.chunked_prefill_beside_size, int) or isinstance(
            self.chunked_prefill_beside_size, bool
        ) or self.chunked_prefill_beside_size < 0:
            raise ValueError("chunked_prefill_beside_size: must be an integer >= 0, got "
                             f"{self.chunked_prefill_beside_size!r}")
        if not (isinstance(self.chunked_prefill_new_share, (int, float))
                and 0.0 <= self.chunked_prefill_new_share < 1.0):
            raise ValueError("chunked_prefill_new_share: must be in [0, 1), got "
                             f"{self.chunked_prefill_new_share!r}")
        if self.request_timeout < 0:
            raise ValueError("request_timeout: must be >= 0 (0: no deadline)")
        if self.shutdown_grace < 0:
            raise ValueError("shutdown_grace: must be >= 0")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes: must be >= 1024")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars: must be >= 1")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout: must be > 0")
        if self.quantization != "none" and self.tp_size > 1:
            raise ValueError("quantization: not supported with tensor parallelism (--tp > 1)")
        if self.cpu_bf16_linear_rows and self.quantization != "none":
            raise ValueError("cpu_bf16_linear_rows: needs float32 linears (not --quantization)")
        if self.quantize_lm_head and self.quantization == "none":
            raise ValueError("quantize_lm_head: needs --quantization int8 or int4")
        if self.lm_head_quantization != "none":
            if self.quantization == "none":
                raise ValueError("lm_head_quantization: needs --quantization int8 or int4")
            if self.quantize_lm_head and self.lm_head_quantization != self.quantization:
                raise ValueError(
                    "lm_head_quantization: --quantize-lm-head means the layers' method "
                    f"({self.quantization}); give one of the two"
                )
        if self.dp_size > 1 and not 0 < self.port <= 65535 - self.dp_size:
            raise ValueError(f"dp_size: ports {self.port}+1..+{self.dp_size} are out of range")

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Keyword arguments as `plait.Engine(...)` takes them; an unknown name is a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown server argument {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        return cls(**kwargs)

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @property
    def resolved_model_path(self) -> str:
        """The model as named (the default model when none is); plait.models.resolve turns it
        into a checkpoint directory."""
        return self.model_path or DEFAULT_MODEL

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model_path or DEFAULT_MODEL

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ----------------------------------------------------------------- CLI
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, serve: bool = True, **defaults: Any
    ) -> None:
        """The fields as flags; serve=False leaves out the HTTP server's own (`plait
        generate`); `defaults` overrides a field's default for this command."""
        for f in dataclasses.fields(cls):
            if not serve and f.metadata.get("serve_only"):
                continue
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "")}
            if f.type in ("bool", bool):
                kwargs["action"] = "store_true"
                kwargs["default"] = default
            else:
                kwargs["type"] = _cli_type(f.type)
                kwargs["default"] = default
                if "choices" in f.metadata:
                    kwargs["choices"] = _choice_names(f.metadata["choices"])
                if "default:" not in kwargs["help"]:
                    kwargs["help"] += f" (default: {default})"
            names = [flag, *f.metadata.get("aliases", ())]
            if flag == "--model":
                names.append("--model-path")
            parser.add_argument(*names, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(ns).items() if k in names}
        if values.get("api_key") is None and os.environ.get(API_KEY_ENV):
            values["api_key"] = os.environ[API_KEY_ENV]
        return cls(**values)


def _cli_type(annotation: str) -> Any:
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def default_torch_threads() -> int:
    return max(1, os.cpu_count() or 1)
