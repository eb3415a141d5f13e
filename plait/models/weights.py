"""Safetensors weight loading: checkpoint tensors by Hugging Face name into the model's
parameters, HF's separate q/k/v and gate/up projections into their rows of the fused ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from plait.models.config import ModelConfig
from plait.models.llama import RotaryEmbedding
from plait.models.registry import get_model_entry


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
    cls = get_model_entry(cfg.architecture).cls
    with torch.device("meta"):
        model = cls(cfg, attn_backend)
        if sharding is not None:
            sharding.parallelize(model, cls.tp_plan)
    _materialize(model, device)
    shard = None if sharding is None else (lambda n, t: sharding.shard_tensor(n, t, cls.tp_plan))
    load_weights(model, Path(path), dtype, device, shard)
    model = model.to(dtype=dtype).eval()
    # the rotary table is computed, not loaded: build it for real after the meta-device init
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    return model


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Module.to_empty without torch's Python reference ops: its first empty_like from a meta
    tensor loads them, ~0.4 s of a start-up for nothing else. Parameters and buffers get
    uninitialised storage on `device`, each shared tensor once (still shared)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    for sub in model.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = empty(t)


def load_weights(
    model: torch.nn.Module, path: Path, dtype: torch.dtype, device: torch.device, shard=None
):
    """Copy checkpoint tensors into the model, writing HF's separate q/k/v and gate/up
    projections into their rows of the fused parameters. shard(name, tensor) -> the part this
    tensor-parallel rank holds."""
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())
    expected = _expected_checkpoint_names(model, params)
    loaded: set[str] = set()
    for file in _safetensor_files(path):
        try:
            opened = safe_open(str(file), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"model_path: {file} is not a readable safetensors file ({e})"
            ) from None
        with opened as f:
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
