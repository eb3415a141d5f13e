"""Tensor parallelism: the ranks' process group, how a checkpoint is split over them, and the
layers whose forward needs a collective.

Rank r of N holds attention heads [r H/N, (r+1) H/N) of every layer and their KV heads (in its
own KV pool), MLP columns [r I/N, (r+1) I/N), and rows [r S, (r+1) S) of the vocabulary padded
to N S. Column-parallel projections (fused qkv, gate_up) need no communication; the
row-parallel ones (o_proj, down_proj) and the vocabulary-parallel embedding end with an
all-reduce; the logits shards are gathered on rank 0, which alone schedules, samples and keeps
the radix cache (the other ranks run the forwards rank 0 sends them: plait.runtime.tp_worker).

Which checkpoint module is split how is the model class's `tp_plan`: {module name: style}.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

# A forward's collective that waits longer than this raises: a rank that hangs fails the
# request instead of hanging the server (a rank that dies fails at once: its socket closes).
TP_TIMEOUT_S = 120.0
# The other ranks wait for rank 0's next batch on this group, for as long as the server idles.
_IDLE_TIMEOUT = datetime.timedelta(days=365)

# tp_plan styles
COLUMN = "column"  # output rows split evenly (q_proj, gate_proj, up_proj; their biases too)
KV_HEADS = "kv_heads"  # output rows by KV head; replicated when there are fewer KV heads than ranks
ROW = "row"  # input columns split evenly, all-reduce after; the bias is whole, added once
VOCAB = "vocab"  # vocabulary rows split evenly after padding to a multiple of the ranks


@dataclass
class TPGroup:
    """This process's place among the tensor-parallel ranks (size 1: no communication)."""

    rank: int = 0
    size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    group: Any = None  # the forward's collectives (gloo on CPU, NCCL across CUDA devices)
    control: Any = None  # gloo on CPU tensors: batch broadcasts and start-up agreement

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group) if self.size > 1 else "none"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (so that sizes chosen per rank agree)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[N, S] logits shard of every rank -> [N, vocab_size] on rank 0 (None elsewhere)."""
        if self.size == 1:
            return local if local.shape[1] == vocab_size else local[:, :vocab_size]
        if self.backend == "gloo" and local.device.type != "cpu":
            local = local.cpu()  # gloo gathers CPU tensors only
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def broadcast_ints(self, values: torch.Tensor | None, length: int) -> torch.Tensor:
        """Rank 0's int64 [length] tensor, on every rank (others pass None)."""
        buf = values if self.rank == 0 else torch.empty(length, dtype=torch.int64)
        dist.broadcast(buf, src=0, group=self.control)
        return buf


def tp_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r when there are enough devices (ranks share one otherwise)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def init_tp(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the process group of `size` ranks (blocks until all have joined)."""
    device = tp_device(device, rank)
    # NCCL needs one device per rank; ranks sharing a device (tests) fall back to gloo
    nccl = device.type == "cuda" and torch.cuda.device_count() >= size
    timeout = datetime.timedelta(seconds=TP_TIMEOUT_S)
    dist.init_process_group(
        "nccl" if nccl else "gloo", init_method=init_method, rank=rank, world_size=size,
        timeout=timeout,
    )
    control = dist.new_group(list(range(size)), timeout=_IDLE_TIMEOUT, backend="gloo")
    logger.info("tensor parallel rank %d/%d on %s (%s)", rank, size, device,
                dist.get_backend())
    return TPGroup(rank, size, device, dist.group.WORLD, control)


def default_cpu_threads(tp_size: int) -> int:
    """Torch threads per rank when the ranks share one host's cores."""
    return max(1, (os.cpu_count() or 1) // tp_size)


# ----------------------------------------------------------------------------- sharding
def check_tp_divisible(cfg: Any, tp_size: int) -> None:
    """A ValueError naming the dimension that cannot be split over tp_size ranks."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp_size:
        raise ValueError(
            f"tp_size: the model's {heads} attention heads do not divide by tp_size {tp_size}"
        )
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tp_size: the model's {kv} KV heads neither divide by tp_size {tp_size} nor divide it "
            "(fewer KV heads than ranks are replicated, which needs tp_size a multiple of them)"
        )
    if cfg.intermediate_size % tp_size:
        raise ValueError(
            f"tp_size: the model's MLP width {cfg.intermediate_size} does not divide by "
            f"tp_size {tp_size}"
        )


@dataclass(frozen=True)
class ModelSharding:
    """Rank `rank` of `size`'s share of a model with config `cfg` (the whole model's)."""

    cfg: Any
    tp: TPGroup

    def __post_init__(self) -> None:
        check_tp_divisible(self.cfg, self.tp.size)

    @property
    def num_heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.cfg.num_key_value_heads // self.tp.size)

    @property
    def kv_head_start(self) -> int:
        kv, size, rank = self.cfg.num_key_value_heads, self.tp.size, self.tp.rank
        if kv >= size:
            return rank * (kv // size)
        return rank // (size // kv)  # the KV head of this rank's query heads (replicated)

    @property
    def vocab_shard(self) -> int:
        return -(-self.cfg.vocab_size // self.tp.size)  # ceil: the last shard is padded

    def local_config(self) -> Any:
        """The config the model class is built from on this rank: its heads, columns, rows."""
        return dataclasses.replace(
            self.cfg,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.cfg.intermediate_size // self.tp.size,
            vocab_size=self.vocab_shard,
        )

    def shard_tensor(self, name: str, tensor: torch.Tensor, plan: dict[str, str]) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (e.g. model.layers.0.mlp.up_proj.weight)."""
        parts = name.split(".")
        style = plan.get(parts[-2]) if len(parts) >= 2 else None
        rank, size = self.tp.rank, self.tp.size
        if style == COLUMN:
            return tensor.chunk(size, dim=0)[rank]
        if style == KV_HEADS:
            hd = self.cfg.head_dim
            start = self.kv_head_start * hd
            return tensor[start : start + self.num_kv_heads * hd]
        if style == ROW:
            return tensor.chunk(size, dim=1)[rank] if parts[-1] == "weight" else tensor
        if style == VOCAB:
            n = self.vocab_shard
            rows = tensor[rank * n : (rank + 1) * n]
            if rows.shape[0] < n:  # the padded tail of the last shard
                pad = rows.new_zeros((n - rows.shape[0], *rows.shape[1:]))
                rows = torch.cat([rows, pad])
            return rows
        return tensor

    def parallelize(self, model: nn.Module, plan: dict[str, str]) -> None:
        """Swap the modules whose forward communicates for their parallel versions (call on
        the meta device, before the weights are loaded: parameter names stay the same)."""
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                style = plan.get(name)
                if style == ROW and type(child) is nn.Linear:
                    setattr(parent, name, RowParallelLinear(
                        child.in_features, child.out_features, child.bias is not None, self.tp
                    ))
                elif style == VOCAB and type(child) is nn.Embedding:
                    setattr(parent, name, VocabParallelEmbedding(
                        child.num_embeddings, child.embedding_dim,
                        self.tp.rank * self.vocab_shard, self.tp,
                    ))


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r W_r^T, + b: each rank holds in_features of the input columns;
    the bias (whole on every rank) is added once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.packed: nn.Module | None = None  # a oneDNN-prepacked copy (CPU, see cpu_tuning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed(x) if self.packed is not None else nn.functional.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def pack_row_parallel(model: nn.Module) -> int:
    """Prepack the large row-parallel projections as cpu_tuning.pack_layer_linears does the
    plain ones (which it skips: these must all-reduce before their bias)."""
    from plait.runtime.cpu_tuning import MIN_PACKED_LINEAR, pack_linear

    packed = 0
    for module in model.modules():
        if isinstance(module, RowParallelLinear) and module.weight.numel() >= MIN_PACKED_LINEAR:
            module.packed = pack_linear(module.weight)
            packed += module.packed is not None
    return packed


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the embedding; ids outside give zeros, and the
    all-reduce sums every rank's lookup into the full one."""

    def __init__(self, num_embeddings: int, dim: int, start: int, tp: TPGroup) -> None:
        super().__init__(num_embeddings, dim)
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)  # [T]
        out = nn.functional.embedding(torch.where(inside, local, 0), self.weight)  # [T, hidden]
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)
