"""ModelConfig: a checkpoint's config.json (plus generation_config.json's EOS ids), normalised
across the spellings of the transformers versions that wrote it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from plait.models.registry import get_model_entry


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
        """The checkpoint's config; a missing, unreadable or incomplete config.json is a
        ValueError naming the file."""
        file = Path(path) / "config.json"
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"model_path: {path} has no config.json") from None
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError included
            raise ValueError(f"model_path: {file} is not a readable JSON file ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"model_path: {file} is not a JSON object")  # noqa: TRY004
        try:
            return cls._from_raw(path, raw)
        except KeyError as e:
            raise ValueError(f"model_path: {file} lacks {e.args[0]!r}") from None

    @classmethod
    def _from_raw(cls, path: str | Path, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        defaults = get_model_entry(arch).defaults
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
