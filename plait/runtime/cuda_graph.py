"""CUDA graphs for decode forwards.

A decode step of a small model on a GPU is launch-bound: each layer is a dozen kernels of a few
microseconds, and Python plus the launches cost more than the work. `DecodeGraphRunner`
captures the whole decode forward (the KV-slot lookup, every layer, the logits GEMM) once per
batch size of a ladder (1, 2, 4, 8, 16, 24, 32, ...) and replays it: a batch of B requests runs
the graph of the smallest captured size >= B, its extra rows padding.

What the graphs read is three rows of int64 in one static device buffer (token ids, request
rows of the req->token table, KV lengths after the step), filled by one host-to-device copy per
step. Everything else is derived inside the graph: positions (length - 1), the new tokens' KV
slots (read from the req->token table, where the scheduler wrote them) and the attention
metadata. A padding row decodes token 0 at position 0 of the req->token table's padding row,
which maps every position to the KV pool's reserved slot 0: it writes and reads only that slot,
never a request's KV.

The Triton decode kernel's split count is fixed per graph (planned for the context length, not
the batch's longest request), so the launch grid does not depend on the batch's lengths; the
kernel skips the empty splits of short requests. Graphs need an attention backend whose decode
reads lengths from device tensors only (triton); the others decode eagerly.

`emulate=True` runs the same static buffers, padding and derived metadata without capturing
(every replay calls the forward): the CPU test suite checks the padding and the metadata this
way under TRITON_INTERPRET=1; the capture itself needs a CUDA device (tests marked gpu).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from plait.kernels.base import AttentionBackend, AttentionMetadata, ForwardMode

if TYPE_CHECKING:
    from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

# backends whose decode forward reads the batch's lengths from device tensors only
GRAPH_BACKENDS = ("triton",)


def capture_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to max_bs (max_bs itself last)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs: must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sizes + [max_bs]


class DecodeGraphRunner:
    """Captured decode forwards for batches of up to `max_bs` requests (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        context_length: int,
        max_bs: int,
        *,
        emulate: bool = False,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_pool = kv_pool
        self.table = req_to_token_pool.req_to_token
        self.padding_row = req_to_token_pool.padding_row
        self.context_length = context_length
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.emulate = emulate
        device = self.table.device
        if not emulate and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        # rows: token ids, req->token rows, KV lengths after the step
        self._inputs = torch.zeros((3, self.max_bs), dtype=torch.int64, device=device)
        self._ones = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        self._starts = torch.arange(self.max_bs, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.capture_seconds = 0.0
        self._capture()

    # ------------------------------------------------------------------ capture
    def _forward(self, bs: int) -> torch.Tensor:
        """The decode forward of the first bs rows of the static inputs: logits [bs, vocab]."""
        ids, rows, lens = self._inputs[0, :bs], self._inputs[1, :bs], self._inputs[2, :bs]
        positions = lens - 1
        ctx = self.context_length
        meta = AttentionMetadata(
            mode=ForwardMode.DECODE,
            req_to_token=self.table,
            req_pool_indices=rows,
            seq_lens=lens.to(torch.int32),
            prefix_lens=positions.to(torch.int32),
            extend_lens=self._ones[:bs],
            extend_start_loc=self._starts[:bs],
            out_cache_loc=self.table[rows, positions].to(torch.int64),
            # the host-side lengths plan the kernel launches (the split count): the graph
            # must serve any length up to the context, so plan for the longest
            seq_lens_cpu=[ctx] * bs,
            prefix_lens_cpu=[ctx - 1] * bs,
            extend_lens_cpu=[1] * bs,
        )
        self.attn_backend.prepare(meta)
        hidden = self.model(ids, positions, self.kv_pool, meta)
        return self.model.compute_logits(hidden).float()

    def _pad(self, bs: int, start: int = 0) -> None:
        self._inputs[0, start:bs] = 0
        self._inputs[1, start:bs] = self.padding_row
        self._inputs[2, start:bs] = 1

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        if self.emulate:
            self._pad(self.max_bs)
            self.capture_seconds = time.perf_counter() - t0
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # largest first: the smaller graphs reuse its memory from the shared pool
        for bs in reversed(self.sizes):
            self._pad(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels, settles the allocator
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the process's other threads (grammar compiles, ZMQ) may touch CUDA
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                self._outputs[bs] = self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info(
            "CUDA graphs: decode batch sizes %s captured in %.1f s",
            ",".join(map(str, self.sizes)), self.capture_seconds,
        )

    # ------------------------------------------------------------------ replay
    def can_run(self, batch_size: int) -> bool:
        return 1 <= batch_size <= self.max_bs

    def graph_size(self, batch_size: int) -> int:
        """The captured size a batch of batch_size requests replays (padded up to)."""
        for size in self.sizes:
            if size >= batch_size:
                return size
        raise ValueError(f"a decode batch of {batch_size} exceeds cuda_graph_max_bs {self.max_bs}")

    @torch.inference_mode()
    def run(
        self, input_ids: Sequence[int], req_rows: Sequence[int], seq_lens: Sequence[int]
    ) -> torch.Tensor:
        """Logits [B, vocab] float32 of one decode step: request i decodes input_ids[i] at
        position seq_lens[i] - 1, its KV slot already in row req_rows[i] of the req->token
        table. The tensor is the graph's output buffer: read it before the next run."""
        batch = len(input_ids)
        if not (len(req_rows) == len(seq_lens) == batch):
            raise ValueError("input_ids, req_rows and seq_lens need one entry per request")
        bs = self.graph_size(batch)
        pad = bs - batch
        host = torch.tensor(
            [
                list(input_ids) + [0] * pad,
                list(req_rows) + [self.padding_row] * pad,
                list(seq_lens) + [1] * pad,
            ],
            dtype=torch.int64,
        )
        self._inputs[:, :bs].copy_(host)
        if self.emulate:
            self._outputs[bs] = self._forward(bs)
        else:
            self._graphs[bs].replay()
        self.replays += 1
        return self._outputs[bs][:batch]

    def stats(self) -> dict:
        return {
            "sizes": list(self.sizes),
            "replays": self.replays,
            "capture_seconds": round(self.capture_seconds, 3),
            "emulated": self.emulate,
        }
