"""The attention-backend interface: what a model layer calls, and the per-forward metadata.

Models never see the KV layout: each attention layer hands its new q/k/v to
`AttentionBackend.forward`, which stores k/v into the pool at the batch's slots and attends
over the request's cached tokens (found through the req->token table). Backends are chosen
by name from a registry; implementations are imported lazily so that a missing optional
dependency (triton, flash-attn) fails only when that backend is selected.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from plait.registry import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from plait.radix_cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of each request's uncached suffix (possibly one chunk of it)
    DECODE = "decode"  # one new token per request


@dataclass
class AttentionMetadata:
    """Everything attention needs about one forward, built once and shared by all layers.

    Tokens of the batch are flattened request after request: request i owns the rows
    extend_start_loc[i] : extend_start_loc[i] + extend_lens[i] of q/k/v. Its KV after this
    forward is req_to_token[req_pool_indices[i], :seq_lens[i]], of which the first
    prefix_lens[i] slots were already cached and the rest are out_cache_loc's rows.
    """

    mode: ForwardMode
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32: KV slot of each position
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32, KV length after this forward
    prefix_lens: torch.Tensor  # [B] int32, KV length before this forward
    extend_lens: torch.Tensor  # [B] int32, new tokens (1 each in DECODE)
    extend_start_loc: torch.Tensor  # [B] int32, first row of each request in q
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # backend-private precomputed tensors (e.g. padded gather indices), filled by prepare()
    cache: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu) if self.seq_lens_cpu else 0


class AttentionBackend(ABC):
    """Stores new K/V into the pool and computes attention for one layer.

    Contract for `forward`:
      q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] for the T new tokens;
      writes k/v to kv_pool at meta.out_cache_loc (layer `layer_id`), then returns
      [T, num_heads, head_dim]: for each new token, softmax(q k^T * scaling) v over its
      request's KV positions 0..(its own position) (causal), grouped-query heads mapped as
      head h -> kv head h // (num_heads // num_kv_heads).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-forward precomputation shared by every layer (optional)."""

    def shared_kv_tokens(self, meta: AttentionMetadata) -> int:
        """KV rows per layer this forward read once for a group of requests sharing them
        instead of once per request (0 for backends that do not share reads)."""
        return 0

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


def register_attention_backend(name: str, target: str) -> None:
    """Make `target` ("module:Class", an AttentionBackend) selectable as --attention-backend."""
    ATTENTION_BACKENDS.register(name, target)


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def create_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float
) -> AttentionBackend:
    module_name, cls_name = ATTENTION_BACKENDS.target(name)  # ValueError for an unknown name
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"attention_backend {name!r} is not available: {e}") from e
    return getattr(module, cls_name)(num_heads, num_kv_heads, head_dim, scaling)
