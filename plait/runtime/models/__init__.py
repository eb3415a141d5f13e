"""Model registry (keyed by config.json `architectures[0]`), config normalisation and the
safetensors weight loader."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.runtime.models.llama import LlamaForCausalLM, RotaryEmbedding

# architecture name -> (model class, per-architecture config defaults)
MODEL_REGISTRY: dict[str, tuple[type, dict[str, Any]]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, {}),
    "MistralForCausalLM": (LlamaForCausalLM, {}),
    "Qwen2ForCausalLM": (LlamaForCausalLM, {"attention_bias": True}),
    "Qwen3ForCausalLM": (LlamaForCausalLM, {"qk_norm": True}),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            raw = json.load(f)
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in MODEL_REGISTRY:
            raise ValueError(
                f"model architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(MODEL_REGISTRY))})"
            )
        defaults = MODEL_REGISTRY[arch][1]
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", defaults.get("attention_bias", False)),
            o_bias=raw.get("attention_bias", False) and arch == "LlamaForCausalLM",
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=defaults.get("qk_norm", False),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_eos_ids(path, raw),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
        )


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> dict | None:
    scaling = raw.get("rope_scaling")
    if scaling is None:
        params = raw.get("rope_parameters") or {}
        if params.get("rope_type", "default") != "default":
            scaling = params
    return scaling


def _eos_ids(path: str | Path, raw: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw, _read_json(Path(path) / "generation_config.json")):
        eos = source.get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def resolve_model_path(name_or_path: str) -> str:
    """A local directory as is; anything else through huggingface_hub (needs a network)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except Exception as e:  # offline, unknown repo, auth...
        raise ValueError(
            f"model_path: {name_or_path!r} is not a local directory and could not be fetched "
            f"from the Hugging Face hub ({type(e).__name__}: {e})"
        ) from None


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if cfg.torch_dtype == "float16" else torch.bfloat16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def load_model(
    path: str, cfg: ModelConfig, attn_backend, dtype: torch.dtype, device: torch.device,
    sharding=None,
):
    """sharding (plait.runtime.parallel.ModelSharding): load this tensor-parallel rank's part;
    cfg is then the rank's local config (sharding.local_config())."""
    cls = MODEL_REGISTRY[cfg.architecture][0]
    with torch.device("meta"):
        model = cls(cfg, attn_backend)
        if sharding is not None:
            sharding.parallelize(model, cls.tp_plan)
    model = model.to_empty(device=device)
    shard = None if sharding is None else (lambda n, t: sharding.shard_tensor(n, t, cls.tp_plan))
    load_weights(model, Path(path), dtype, device, shard)
    model = model.to(dtype=dtype).eval()
    # the rotary table is computed, not loaded: build it for real after the meta-device init
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    return model


def load_weights(
    model: torch.nn.Module, path: Path, dtype: torch.dtype, device: torch.device, shard=None
):
    """Copy checkpoint tensors into the model, writing HF's separate q/k/v and gate/up
    projections into their rows of the fused parameters. shard(name, tensor) -> the part this
    tensor-parallel rank holds."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    expected = _expected_checkpoint_names(model, params)
    loaded: set[str] = set()
    for file in _safetensor_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in expected:
                    if "rotary_emb" in name or (name == "lm_head.weight" and model.lm_head is None):
                        continue
                    raise ValueError(f"checkpoint {path}: unexpected weight {name!r}")
                target, rows = expected[name]
                tensor = f.get_tensor(name)
                if shard is not None:
                    tensor = shard(name, tensor)
                dest = params[target] if rows is None else params[target][rows[0] : rows[1]]
                if tensor.shape != dest.shape:
                    raise ValueError(
                        f"checkpoint {path}: weight {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                with torch.no_grad():
                    dest.copy_(tensor.to(device=device, dtype=dtype))
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path}: missing weights {missing[:5]}")


def _expected_checkpoint_names(model, params) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """checkpoint tensor name -> (model parameter, (first row, end row) or None for all)."""
    out: dict[str, tuple[str, tuple[int, int] | None]] = {}
    stacked = getattr(model, "stacked_params", {})
    for pname in params:
        parts = pname.split(".")
        fused = parts[-2] if len(parts) >= 2 else ""
        shards = [(ck, idx) for ck, (fp, idx) in stacked.items() if fp == fused]
        if not shards:
            out[pname] = (pname, None)
            continue
        sizes = model.shard_sizes(fused)
        for ck, idx in shards:
            start = sum(sizes[:idx])
            out[".".join(parts[:-2] + [ck, parts[-1]])] = (pname, (start, start + sizes[idx]))
    return out


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return [path / name for name in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path: no *.safetensors weights in {path}")
    return files
