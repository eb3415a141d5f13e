"""ModelRunner: loads the model and owns the KV memory; runs one Batch to logits."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from plait.args import ServerArgs
from plait.kernels.base import (
    AttentionMetadata,
    create_attention_backend,
    resolve_backend_name,
)
from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool
from plait.runtime.core import Batch
from plait.runtime.cpu_tuning import pack_layer_linears, pack_linear, tune_allocator
from plait.models.config import ModelConfig
from plait.models.weights import load_model, resolve_dtype

logger = logging.getLogger(__name__)

MAX_DEFAULT_POOL_TOKENS = 1 << 19


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_rows, vocab] float32, rows in `logit_rows` order
    logit_rows: list[int]  # flattened token rows whose logits were computed
    shared_kv_tokens: int = 0  # KV rows read once for requests sharing them (per layer)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str) -> None:
        self.args = args
        self.device = _resolve_device(args.device)
        self.config = ModelConfig.from_dir(model_path)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        cfg = self.config
        self.context_length = args.context_length or cfg.max_position_embeddings
        if cfg.sliding_window and cfg.sliding_window < self.context_length:
            # no sliding-window attention kernel: cap the context where full attention is exact
            self.context_length = cfg.sliding_window
        self.attn_backend_name = resolve_backend_name(args.attention_backend, self.device)
        attn = create_attention_backend(
            self.attn_backend_name,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
        )
        if self.device.type == "cpu":
            tune_allocator()
        self.model = load_model(model_path, cfg, attn, self.dtype, self.device)
        if self.device.type == "cpu" and not args.disable_cpu_prepack:
            # a copy: tied embeddings still need the plain weight for the input lookup
            self.model.packed_lm_head = pack_linear(self.model.lm_head_weight)
            pack_layer_linears(self.model.model)  # the decoder layers (not lm_head)
        self.attn_backend = attn
        pool_tokens = self._pool_size()
        self.kv_pool = KVPool(
            pool_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
            self.dtype, self.device,
        )
        self.req_to_token_pool = ReqToTokenPool(
            2 * args.max_running_requests + 8, self.context_length + 8, self.device
        )
        logger.info(
            "model %s (%s, %s) on %s; KV pool %d tokens, attention %s",
            model_path, cfg.architecture, self.dtype, self.device, pool_tokens,
            self.attn_backend_name,
        )

    def _pool_size(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        cfg = self.config
        per_token = KVPool.bytes_per_token(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.dtype
        )
        free = _free_memory(self.device)
        tokens = int(free * self.args.mem_fraction_static) // per_token
        return max(1024, min(tokens, MAX_DEFAULT_POOL_TOKENS))

    # ------------------------------------------------------------------ forward
    def build_metadata(self, batch: Batch) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """Attention metadata, input ids [T] and positions [T] for one batch."""
        ids, positions, out_loc = [], [], []
        starts, seq_lens, prefix_lens = [], [], []
        offset = 0
        for req, ext in zip(batch.reqs, batch.extend_lens):
            all_ids = req.all_ids
            start = req.kv_len
            ids.extend(all_ids[start : start + ext])
            positions.extend(range(start, start + ext))
            starts.append(offset)
            prefix_lens.append(start)
            seq_lens.append(start + ext)
            offset += ext
        pool_indices = [r.req_pool_idx for r in batch.reqs]
        dev = self.device
        for req, ext in zip(batch.reqs, batch.extend_lens):
            out_loc.append(self.req_to_token_pool.read(req.req_pool_idx, req.kv_len + ext, req.kv_len))
        meta = AttentionMetadata(
            mode=batch.mode,
            req_to_token=self.req_to_token_pool.req_to_token,
            req_pool_indices=torch.tensor(pool_indices, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=dev),
            extend_lens=torch.tensor(batch.extend_lens, dtype=torch.int32, device=dev),
            extend_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            out_cache_loc=torch.cat(out_loc).to(dev),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=list(batch.extend_lens),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return meta, input_ids, pos

    def forward(self, batch: Batch, logit_rows: list[int]) -> ForwardOutput:
        """Run the batch (its KV slots already written to req_to_token) and return the
        logits of the flattened token rows in logit_rows."""
        meta, input_ids, positions = self.build_metadata(batch)
        self.attn_backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_pool, meta)  # [T, hidden]
        # gather unless the rows are exactly 0..T-1 in order (a full set can come reordered:
        # sampling rows first, then prompt rows for input logprobs)
        if logit_rows != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(logit_rows, dtype=torch.long, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        return ForwardOutput(
            logits.cpu() if logits.device.type != "cpu" else logits,
            logit_rows,
            self.attn_backend.shared_kv_tokens(meta),
        )


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


