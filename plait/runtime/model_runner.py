"""ModelRunner: loads the model and owns the KV memory; runs one Batch to logits."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from plait.args import ServerArgs
from plait.kernels.base import (
    AttentionMetadata,
    ForwardMode,
    create_attention_backend,
    resolve_backend_name,
)
from plait.kernels.cpu_attention import start_decode_kernel
from plait.kernels.cpu_extend import start_extend_kernel
from plait.kernels.fused_ops import start_fused_ops
from plait.kernels.woq import (
    GateUpPanelLinear,
    PanelLinear,
    available_isas,
    quantize_linears,
    set_fp32_amx_rows,
    start_linear_kernels,
)
from plait.models.config import ModelConfig
from plait.models.weights import load_model, resolve_dtype
from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool
from plait.registry import QUANTIZATION_METHODS
from plait.runtime.core import Batch
from plait.runtime.cpu_tuning import pack_layer_linears, pack_linear, tune_allocator
from plait.runtime.cuda_graph import GRAPH_BACKENDS, DecodeGraphRunner
from plait.runtime.hugepages import move_buffers_to_huge_pages
from plait.runtime.logit_screen import LogitScreen, ScreenedRows, has_bf16_units
from plait.runtime.parallel import ModelSharding, TPGroup, pack_row_parallel
from plait.runtime.thread_tuner import (
    DECODE,
    EXTEND,
    HostLoad,
    ThreadTuner,
    attention_work,
    pair_cost,
)

logger = logging.getLogger(__name__)

MAX_DEFAULT_POOL_TOKENS = 1 << 19
# CPU: bytes of the KV pool's never-used slots kept faulted in ahead of the allocator
# (radix_cache/kv_pool.py Prefaulter): a few prefills' worth, at most an eighth of the pool
KV_PREFAULT_BYTES = 256 << 20


@dataclass
class ForwardOutput:
    # [num_rows, vocab] float32, in the order of forward()'s logit_rows (or their greedy picks)
    logits: torch.Tensor | ScreenedRows
    shared_kv_tokens: int = 0  # KV rows read once for requests sharing them (per layer)


@dataclass
class ForwardInputs:
    """One forward's inputs as plain integers (what rank 0 sends the other TP ranks); with the
    req->token table they determine the forward."""

    mode: ForwardMode
    input_ids: list[int]  # [T], request after request
    req_pool_indices: list[int]  # [B]
    prefix_lens: list[int]  # [B] KV length before this forward
    extend_lens: list[int]  # [B] new tokens

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]


class ModelRunner:
    """Runs forwards on this process's model. With tensor parallelism (tp.size > 1) the model,
    the attention heads and the KV pool are this rank's shard, and the logits are gathered on
    rank 0 (other ranks get None)."""

    def __init__(self, args: ServerArgs, model_path: str, tp: TPGroup | None = None) -> None:
        self.args = args
        self.tp = tp or TPGroup()
        if self.tp.size != args.tp_size:
            raise ValueError(
                f"tp_size: {args.tp_size} ranks need the processes plait's launcher starts "
                f"(plait.Engine, plait serve); this runner is one of {self.tp.size}"
            )
        self.device = self.tp.device if self.tp.size > 1 else _resolve_device(args.device)
        self.config = ModelConfig.from_dir(model_path)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype, self.device)
        # rank 0 of a TP group: hands each forward's inputs to the other ranks before running
        self.forward_hook: Callable[[ForwardInputs, list[int]], None] | None = None
        self.sharding = ModelSharding(self.config, self.tp) if self.tp.size > 1 else None
        # the model as this rank builds it: its heads, MLP columns and vocabulary rows
        local = self.sharding.local_config() if self.sharding else self.config
        cfg = self.config
        self.context_length = args.context_length or cfg.max_position_embeddings
        if cfg.sliding_window and cfg.sliding_window < self.context_length:
            # no sliding-window attention kernel: cap the context where full attention is exact
            self.context_length = cfg.sliding_window
        self.attn_backend_name = resolve_backend_name(args.attention_backend, self.device)
        if self.kv_dtype != self.dtype and self.attn_backend_name != "torch":
            raise ValueError(
                f"kv_cache_dtype: {args.kv_cache_dtype} beside {self.dtype} weights needs the "
                f"torch attention backend (got {self.attn_backend_name})"
            )
        attn = create_attention_backend(
            self.attn_backend_name,
            local.num_attention_heads,
            local.num_key_value_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
        )
        if self.device.type == "cpu":
            tune_allocator()
        self.model = load_model(model_path, local, attn, self.dtype, self.device, self.sharding)
        if args.quantization != "none":
            self._quantize(args)
        if self.device.type == "cpu" and not args.disable_cpu_prepack:
            self._prepack_linears(args)
        elif args.cpu_bf16_linear_rows:
            raise ValueError("cpu_bf16_linear_rows: runs on the CPU's prepacked linears (not "
                             f"on {self.device.type}, not with --disable-cpu-prepack)")
        self.logit_screen = self._logit_screen(args)
        if self.device.type == "cpu" and not args.disable_huge_pages:
            move_buffers_to_huge_pages(self.model)  # the weight panels (before any forward)
        self.attn_backend = attn
        if self.device.type == "cpu" and self.dtype == torch.float32:
            self._start_cpu_kernels(args, attn)
        pool_tokens = self._pool_size()
        self.kv_pool = KVPool(
            pool_tokens, cfg.num_hidden_layers, local.num_key_value_heads, cfg.head_dim,
            self.kv_dtype, self.device,
            prefault_bytes=min(KV_PREFAULT_BYTES, pool_tokens * self._kv_bytes_per_token() // 8),
            huge_pages=not args.disable_huge_pages,
        )
        self.req_to_token_pool = ReqToTokenPool(
            2 * args.max_running_requests + 8, self.context_length + 8, self.device
        )
        self.decode_graphs = self._capture_decode_graphs(args)
        self.thread_tuner = _thread_tuner(args, self.device, self.tp)
        # one query-key pair of attention in tokens' worth of the linears (thread_tuner's
        # attention_work: the tuner's and the scheduler's measure of a forward's work)
        self.pair_cost = pair_cost(cfg.hidden_size, cfg.intermediate_size,
                                    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.host_load = HostLoad()  # the tuner's load level: other processes' cores
        self.perf_clock: Callable[[], float] = time.perf_counter  # times the tuned forwards
        logger.info(
            "model %s (%s, %s) on %s; KV pool %d tokens%s, attention %s%s",
            model_path, cfg.architecture, self.dtype, self.device, pool_tokens,
            f" ({self.kv_dtype})" if self.kv_dtype != self.dtype else "",
            self.attn_backend_name,
            f", tensor parallel rank {self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else "",
        )

    def _capture_decode_graphs(self, args: ServerArgs) -> DecodeGraphRunner | None:
        """CUDA graphs of the decode forward (plait/runtime/cuda_graph.py): on CUDA, one
        process (tensor-parallel ranks meet at collectives), an attention backend that plans
        its decode launches from device tensors alone."""
        if self.device.type != "cuda" or args.disable_cuda_graph or self.tp.size > 1:
            return None
        if self.attn_backend_name not in GRAPH_BACKENDS:
            logger.info(
                "CUDA graphs: the %s attention backend decodes eagerly (graphs need %s)",
                self.attn_backend_name, " or ".join(GRAPH_BACKENDS),
            )
            return None
        return DecodeGraphRunner(
            self.model, self.attn_backend, self.kv_pool, self.req_to_token_pool,
            self.context_length, args.cuda_graph_max_bs or args.max_running_requests,
        )

    def _start_cpu_kernels(self, args: ServerArgs, attn) -> None:
        """plait's C++ kernels for the fp32 CPU path, each built (first start) or loaded in a
        background thread; torch's operators run until each one is ready."""
        if hasattr(attn, "use_cpu_kernel"):  # the torch backend
            if not args.disable_cpu_attention_kernel:
                attn.use_cpu_kernel = True
                start_decode_kernel()
            if not args.disable_cpu_extend_kernel:
                attn.use_cpu_extend_kernel = True
                start_extend_kernel()
        if not args.disable_cpu_fused_ops:
            self.model.use_fused_cpu_ops = True
            start_fused_ops()

    def _prepack_linears(self, args: ServerArgs) -> None:
        """The CPU linears in a prepacked layout: plait's panel kernels (fp32, an AVX2 CPU, one
        process), else oneDNN's blocked layout for the large ones. The logits GEMM gets a copy:
        tied embeddings still need the plain weight for the input lookup."""
        model = self.model
        panels = (
            self.dtype == torch.float32
            and not self.sharding
            and not args.disable_cpu_linear_kernel
            and bool(available_isas())
        )
        if panels:
            with torch.inference_mode():
                if getattr(model, "packed_lm_head", None) is None:
                    model.packed_lm_head = PanelLinear(model.lm_head_weight)
                quantize_linears(model.model, PanelLinear)  # those not quantized already
                if not args.disable_fused_silu:
                    self._fuse_gate_up_silu()
                self._bf16_linears(args)
            rows = set_fp32_amx_rows(args.cpu_amx_linear_rows)
            if rows:
                logger.info("fp32 linears of %d rows or more on AMX tiles", rows)
            start_linear_kernels()
            return
        if args.cpu_bf16_linear_rows:
            raise ValueError(
                "cpu_bf16_linear_rows: needs plait's fp32 panel linears (a float32 model in one "
                "process, without --disable-cpu-linear-kernel)"
            )
        if getattr(model, "packed_lm_head", None) is None:
            model.packed_lm_head = pack_linear(model.lm_head_weight)
        pack_layer_linears(model.model)  # the decoder layers (not lm_head)
        if self.sharding:
            pack_row_parallel(model.model)

    def _bf16_linears(self, args: ServerArgs) -> None:
        """--cpu-bf16-linear-rows N: the decoder layers' panel linears multiply forwards of N
        rows or more in bf16 (the logits GEMM keeps fp32: the logit screen picks exactly)."""
        rows = args.cpu_bf16_linear_rows
        if not rows:
            return
        if not has_bf16_units():
            raise ValueError(
                "cpu_bf16_linear_rows: this CPU has no bf16 units (AMX or AVX512-BF16), where "
                "bf16 linears would be slower than fp32's"
            )
        for module in self.model.model.modules():
            if isinstance(module, PanelLinear):
                module.use_bf16_from(rows)
        self.model.bf16_linear_rows = rows
        logger.info("decoder linears in bf16 from %d rows on", rows)

    def _fuse_gate_up_silu(self) -> None:
        """Each MLP's fp32 gate_up in the panel order whose kernel applies silu * up as it
        writes (woq.GateUpPanelLinear: the same results, one pass less a layer)."""
        for layer in getattr(self.model.model, "layers", []):
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and GateUpPanelLinear.applies(getattr(mlp, "gate_up_proj", None)):
                mlp.gate_up_proj = GateUpPanelLinear.from_panel_linear(mlp.gate_up_proj)

    def _logit_screen(self, args: ServerArgs) -> LogitScreen | None:
        """Greedy picks through a bf16 screen of the logits (logit_screen.py): on the CPU in
        fp32, one process, with the fp32 logits GEMM (not a quantized one: the screen is
        exact against fp32)."""
        if (
            args.disable_logit_screen
            or self.device.type != "cpu"
            or self.dtype != torch.float32
            or self.sharding
            or args.lm_head_quantization != "none"
            or args.quantize_lm_head
        ):
            return None
        screen = LogitScreen.build(self.model.lm_head_weight, kernel=not args.disable_screen_kernel,
                                   huge_pages=not args.disable_huge_pages)
        logger.info("logit screen: %s", "bf16, exact picks" if screen else "off (full logits)")
        return screen

    def _quantize(self, args: ServerArgs) -> None:
        """Weight-only quantized decoder-layer linears (and the logits GEMM if asked): the
        layers' fp32 weights are dropped; the output embedding keeps its fp32 weight (the
        input lookup of tied embeddings reads it)."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(
                f"quantization: {args.quantization} runs on the CPU with float32 activations "
                f"(got device {self.device}, dtype {self.dtype})"
            )
        linear_cls = QUANTIZATION_METHODS.load(args.quantization)
        replaced = quantize_linears(self.model.model, linear_cls)
        head = args.lm_head_quantization
        if head == "none" and args.quantize_lm_head:
            head = args.quantization
        if head != "none":
            with torch.inference_mode():
                self.model.packed_lm_head = QUANTIZATION_METHODS.load(head)(self.model.lm_head_weight)
        logger.info(
            "quantization %s: %d decoder linears%s", args.quantization, replaced,
            f", the logits GEMM {head}" if head != "none" else "",
        )

    def _kv_bytes_per_token(self) -> int:
        cfg = self.config
        kv_heads = self.sharding.num_kv_heads if self.sharding else cfg.num_key_value_heads
        return KVPool.bytes_per_token(cfg.num_hidden_layers, kv_heads, cfg.head_dim,
                                      self.kv_dtype)

    def _pool_size(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        per_token = self._kv_bytes_per_token()
        free = _free_memory(self.device)
        if self.device.type == "cpu":
            free //= self.tp.size  # the ranks share the host's memory
        tokens = int(free * self.args.mem_fraction_static) // per_token
        # every rank's pool must have the same slots: rank 0 allocates them for all
        return self.tp.min_int(max(1024, min(tokens, MAX_DEFAULT_POOL_TOKENS)))

    # ------------------------------------------------------------------ forward
    def prepare_inputs(self, batch: Batch) -> ForwardInputs:
        ids: list[int] = []
        for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens)):
            ids.extend(req.all_ids[req.kv_len : req.kv_len + ext])
            if batch.draft_ids is not None:  # speculative: the draft follows the pending token
                ids.extend(batch.draft_ids[i])
        return ForwardInputs(
            mode=batch.mode,
            input_ids=ids,
            req_pool_indices=[r.req_pool_idx for r in batch.reqs],
            prefix_lens=[r.kv_len for r in batch.reqs],
            extend_lens=list(batch.extend_lens),
        )

    def build_metadata(
        self, inputs: ForwardInputs
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """Attention metadata, input ids [T] and positions [T] for one forward (its new KV
        slots already written to req_to_token)."""
        positions, out_loc, starts = [], [], []
        seq_lens = inputs.seq_lens
        table = self.req_to_token_pool.req_to_token
        dev = self.device
        pool_indices = torch.tensor(inputs.req_pool_indices, dtype=torch.int64, device=dev)
        if all(end - start == 1 for start, end in zip(inputs.prefix_lens, seq_lens)):
            # one new token a request (decode): its slot is one entry per row, one gather for
            # the batch instead of a slice per request and a cat (~1 ms at batch 32 on the CPU)
            positions = list(inputs.prefix_lens)
            starts = list(range(len(seq_lens)))
            last = torch.tensor(positions, dtype=torch.int64, device=dev)
            out_cache_loc = table[pool_indices, last].to(torch.int64)  # (table is on dev)
        else:
            offset = 0
            for idx, start, end in zip(inputs.req_pool_indices, inputs.prefix_lens, seq_lens):
                positions.extend(range(start, end))
                starts.append(offset)
                offset += end - start
                out_loc.append(self.req_to_token_pool.read(idx, end, start))
            out_cache_loc = torch.cat(out_loc)
        meta = AttentionMetadata(
            mode=inputs.mode,
            req_to_token=table,
            req_pool_indices=pool_indices,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            prefix_lens=torch.tensor(inputs.prefix_lens, dtype=torch.int32, device=dev),
            extend_lens=torch.tensor(inputs.extend_lens, dtype=torch.int32, device=dev),
            extend_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            out_cache_loc=out_cache_loc.to(dev),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(inputs.prefix_lens),
            extend_lens_cpu=list(inputs.extend_lens),
        )
        input_ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return meta, input_ids, pos

    def forward(
        self, batch: Batch, logit_rows: list[int], argmax_vocab: int | None = None
    ) -> ForwardOutput:
        """Run the batch (its KV slots already written to req_to_token) and return the
        logits of the flattened token rows in logit_rows. With argmax_vocab (every row only
        needs its greedy pick among the tokens below it), the logits may come as ScreenedRows
        (the logit screen's: picked when the sampler has the grammar masks)."""
        inputs = self.prepare_inputs(batch)
        if self.forward_hook is not None:
            self.forward_hook(inputs, logit_rows)
        elif self.tp.size > 1:
            raise RuntimeError("tensor parallel rank 0 has no forward_hook to reach the others")
        with self._tuned_threads(inputs):
            logits, meta = self.run(inputs, logit_rows, argmax_vocab)
        return ForwardOutput(
            logits.cpu() if isinstance(logits, torch.Tensor) and logits.device.type != "cpu"
            else logits,
            self.attn_backend.shared_kv_tokens(meta) if meta is not None else 0,
        )

    @contextmanager
    def _tuned_threads(self, inputs: ForwardInputs) -> Iterator[None]:
        """Run the forward on the thread count the tuner picks and report its time (a
        forward that raises reports nothing)."""
        tuner = self.thread_tuner
        if tuner is None:
            yield
            return
        kind = DECODE if inputs.mode is ForwardMode.DECODE else EXTEND
        tokens = len(inputs.input_ids)
        load = self.host_load.level(tuner.max_threads)
        threads = tuner.choose(kind, tokens, load, self.host_load.stale)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # ~0.1 us: OpenMP resizes its team lazily
        start = self.perf_clock()
        yield
        # an extend's attention grows with the context before it (a long prompt's chunks);
        # a decode step's is bound by reading the KV and grows slowly, step by step
        work = None if kind == DECODE else attention_work(
            inputs.prefix_lens, inputs.extend_lens, self.pair_cost)
        tuner.record(kind, tokens, threads, self.perf_clock() - start, load, work)

    def thread_stats(self) -> dict:
        """The forward's thread count: the tuner's statistics, or the fixed count."""
        if self.thread_tuner is not None:
            return self.thread_tuner.stats()
        return {"mode": "fixed", "threads": torch.get_num_threads()}

    def run(
        self, inputs: ForwardInputs, logit_rows: list[int], argmax_vocab: int | None = None
    ) -> tuple[torch.Tensor | ScreenedRows | None, AttentionMetadata | None]:
        """The forward on this rank: logits [len(logit_rows), vocab] float32 (None on a TP
        rank other than 0; ScreenedRows through the logit screen when argmax_vocab is given),
        and the metadata it ran with (None for a CUDA graph's replay)."""
        graphs = self.decode_graphs
        if (
            graphs is not None
            and inputs.mode is ForwardMode.DECODE
            and len(inputs.input_ids) == len(inputs.req_pool_indices)
            and graphs.can_run(len(inputs.input_ids))
        ):
            logits = graphs.run(inputs.input_ids, inputs.req_pool_indices, inputs.seq_lens)
            return _select_rows(logits, logit_rows), None  # (the graph's rows are the batch's)
        meta, input_ids, positions = self.build_metadata(inputs)
        self.attn_backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_pool, meta)  # [T, hidden]
        rows = _select_rows(hidden, logit_rows)
        if argmax_vocab is not None and self.logit_screen is not None and logit_rows:
            picks = self.logit_screen(rows, argmax_vocab)
            if picks is not None:
                return picks, meta
        logits = self.model.compute_logits(rows)  # [N, vocab]
        return self.tp.gather_vocab(logits, self.config.vocab_size), meta  # (TP: this rank's)


def _select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows in `rows` order; t itself when they are exactly 0..T-1 (a full set can come
    reordered: sampling rows first, then prompt rows for input logprobs)."""
    if rows == list(range(t.shape[0])):
        return t
    return t[torch.tensor(rows, dtype=torch.long, device=t.device)]


def _thread_tuner(args: ServerArgs, device: torch.device, tp: TPGroup) -> ThreadTuner | None:
    """Adaptive threads for a single CPU process with no --num-threads (plait/runtime/
    thread_tuner.py says why). Not on CUDA (torch's CPU threads do not run the forward), nor
    for tensor-parallel ranks: they meet at a collective in every layer, so one rank's count
    cannot be tuned alone."""
    cores = available_cores()
    if device.type != "cpu" or tp.size > 1 or args.num_threads or cores < 2:
        return None
    return ThreadTuner(cores)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a cgroup
    cpuset), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype for `--kv-cache-dtype name` beside weights of `dtype`: the model's
    (auto), or bf16, which beside other weights than bf16 the CPU's attention paths alone read
    (each converts K and V to q's dtype as it loads them)."""
    if name == "auto":
        return dtype
    kv = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[name]
    if kv != dtype and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"kv_cache_dtype: {name} beside {str(dtype).removeprefix('torch.')} weights runs on "
            f"the CPU with float32 weights only (got device {device.type}); on a GPU, "
            "--dtype bfloat16 gives a bf16 KV cache"
        )
    return kv


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: CUDA was requested but torch sees no CUDA device")
    return torch.device(name)


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


