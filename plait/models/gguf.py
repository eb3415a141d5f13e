"""GGUF files (llama.cpp's format) -> Hugging Face checkpoint directories.

A GGUF file carries the weights (often block-quantized), the model's hyperparameters and its
tokenizer as metadata. `gguf_checkpoint(path)` converts one into the directory layout the rest
of plait reads (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), caches it under plait's cache directory keyed by the file's sha256, and
returns the directory; a second start only hashes the file and loads safetensors.

What the conversion undoes or rebuilds:
- tensor names: llama.cpp's (`blk.N.attn_q.weight`) -> Hugging Face's
  (`model.layers.N.self_attn.q_proj.weight`);
- quantization: each tensor dequantized with the `gguf` package, stored as float32 (float16
  tensors stay float16);
- llama.cpp's converter reorders the rows of attn_q/attn_k of llama-architecture models, within
  each head, from rotate-half (HF) to interleaved pairs (llama.cpp's rope); the rows are put back;
- config.json from `<arch>.*` metadata; tied embeddings when there is no `output.weight`;
- the tokenizer from `tokenizer.ggml.*` as a `tokenizers` fast tokenizer, with
  `tokenizer.chat_template`: byte-level BPE (vocabulary + merges, the pre-tokenizer named by
  `tokenizer.ggml.pre`) or SentencePiece BPE (pieces + scores, byte fallback); control tokens
  as special tokens.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.models.cache import build_atomically, cache_root, file_sha256

logger = logging.getLogger(__name__)

# Bump when the conversion changes what it writes: old cache entries are then not reused.
_CONVERT_VERSION = 1

# general.architecture -> (HF architecture, HF model_type, rows of q/k permuted by llama.cpp)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4
_SPM_SPACE = "\u2581"  # how a SentencePiece vocabulary spells a space

# Pre-tokenizer split patterns, by tokenizer.ggml.pre. (A pattern with `None` uses the GPT-2
# regex built into ByteLevel.) The names are those llama.cpp's converter writes.
_GPT2 = None
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (split regex or _GPT2, digits split one by one first, a whole-word vocab hit skips merges)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "default": (_GPT2, False, False),
    "gpt2": (_GPT2, False, False),
    # SmolLM / StarCoder vocabularies were trained on single digits, then the GPT-2 regex
    "smollm": (_GPT2, True, False),
    "starcoder": (_GPT2, True, False),
    "refact": (_GPT2, True, False),
    "llama-bpe": (_LLAMA3, False, True),
    "llama3": (_LLAMA3, False, True),
    "llama-v3": (_LLAMA3, False, True),
    "smaug-bpe": (_LLAMA3, False, True),
    "qwen2": (_QWEN2, False, False),
    "deepseek-r1-qwen": (_QWEN2, False, False),
}


@dataclass(frozen=True)
class GGUFContents:
    """What a GGUF file says, read once: metadata values and tensors."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[Any]  # gguf.ReaderTensor


# ----------------------------------------------------------------------------- entry point


def gguf_checkpoint(path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face checkpoint directory for GGUF file `path`, converted on first use.

    The cache key is the sha256 of the whole file (a renamed or copied file hits the cache; a
    changed one does not) plus the converter's version.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model_path: GGUF file {str(path)!r} does not exist")
    digest = file_sha256(path)
    final = cache_root(cache_dir) / f"gguf-{path.stem}-{digest[:16]}-v{_CONVERT_VERSION}"
    if final.is_dir():
        return final
    print(f"plait: converting {path.name} to a Hugging Face checkpoint in {final}", file=sys.stderr)
    return build_atomically(final, lambda tmp: convert_gguf(path, tmp))


def convert_gguf(path: str | Path, out_dir: str | Path) -> None:
    """Write the Hugging Face checkpoint of GGUF file `path` into `out_dir`."""
    contents = read_gguf(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = _architecture(contents)
    tensors = hf_tensors(contents)
    config = hf_config(contents, tensors)
    from safetensors.numpy import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(contents.metadata))
    write_tokenizer(contents, out_dir, model_max_length=config["max_position_embeddings"])
    logger.info("converted %s (%s) into %s", path, arch, out_dir)


# ----------------------------------------------------------------------------- reading


def read_gguf(path: str | Path) -> GGUFContents:
    """Metadata and tensors of a GGUF file; a ValueError if it is not a complete one."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises whatever its parse hit: truncation, bad magic
        raise ValueError(
            f"model_path: {str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e}); "
            "is it truncated or corrupt?"
        ) from None
    size = path.stat().st_size
    for t in reader.tensors:
        # a truncated file can still parse its header: its tensor data then runs off the end
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"model_path: GGUF file {str(path)!r} is truncated: tensor {t.name} needs bytes "
                f"{t.data_offset}..{t.data_offset + t.n_bytes}, the file has {size}"
            )
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    return GGUFContents(path, metadata, list(reader.tensors))


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a value type this gguf version cannot decode: not one we read
        return None


def _architecture(contents: GGUFContents) -> str:
    arch = contents.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model_path: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _meta(contents: GGUFContents, key: str, default: Any = ...) -> Any:
    value = contents.metadata.get(key)
    if value is None:
        if default is ...:
            raise ValueError(f"model_path: GGUF file {contents.path} lacks metadata {key!r}")
        return default
    return value


# ----------------------------------------------------------------------------- tensors


def hf_tensors(contents: GGUFContents) -> dict[str, np.ndarray]:
    """Every tensor dequantized, under its Hugging Face name, q/k rows un-permuted."""
    arch = _architecture(contents)
    permuted = ARCHITECTURES[arch][2]
    heads = int(_meta(contents, f"{arch}.attention.head_count"))
    kv_heads = int(_meta(contents, f"{arch}.attention.head_count_kv", heads))
    out: dict[str, np.ndarray] = {}
    for t in contents.tensors:
        name = hf_tensor_name(t.name)
        values = dequantize(t)
        if permuted and (".q_proj." in name or ".k_proj." in name):
            values = unpermute_rows(values, heads if ".q_proj." in name else kv_heads)
        out[name] = values
    return out


def hf_tensor_name(name: str) -> str:
    """llama.cpp tensor name -> Hugging Face parameter name (ValueError if it has none)."""
    base, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        raise ValueError(f"model_path: unexpected GGUF tensor {name!r}")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if base == "rope_freqs":  # Llama 3.1's rope scaling, stored as a tensor of factors
        raise ValueError(
            f"model_path: GGUF tensor {name!r} (rope frequency factors) is not supported"
        )
    raise ValueError(f"model_path: unexpected GGUF tensor {name!r}")


def dequantize(tensor: Any) -> np.ndarray:
    """One GGUF tensor as a float array in numpy (row-major, HF) order.

    Float16 stays float16 (no precision to gain); every other type becomes float32.
    """
    import gguf

    qtype = tensor.tensor_type
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(tensor.data, dtype=np.float16)
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(tensor.data, dtype=np.float32)
    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ValueError(
            f"model_path: GGUF tensor {tensor.name} has quantization type {qtype.name}, which "
            "the installed `gguf` package cannot dequantize"
        ) from None
    return np.ascontiguousarray(values, dtype=np.float32)


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head llama.cpp keeps rows as interleaved
    (even, odd) rotary pairs; Hugging Face's rotate-half wants the even rows, then the odd."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    # [heads, half, 2, ...] (llama.cpp) -> [heads, 2, half, ...] (HF)
    return np.ascontiguousarray(
        w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# ----------------------------------------------------------------------------- config


def hf_config(contents: GGUFContents, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    arch = _architecture(contents)
    hf_arch, model_type, _ = ARCHITECTURES[arch]
    m = contents.metadata

    def key(name: str, default: Any = ...) -> Any:
        return _meta(contents, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or 0)
    head_dim = head_dim or hidden // heads
    embed = tensors["model.embed_tokens.weight"]
    dtype = _config_dtype(tensors)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(embed.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 4096)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(contents, arch),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": False,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
    }
    if model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    elif model_type == "mistral":
        config["sliding_window"] = key("attention.sliding_window", None)
    return config


def _rope_scaling(contents: GGUFContents, arch: str) -> dict[str, Any] | None:
    kind = contents.metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(contents.metadata.get(f"{arch}.rope.scaling.factor") or 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(f"model_path: GGUF rope scaling {kind!r} is not supported (supported: linear)")


def _config_dtype(tensors: dict[str, np.ndarray]) -> str:
    matrices = [t for t in tensors.values() if t.ndim == 2]
    return "float16" if all(t.dtype == np.float16 for t in matrices) else "float32"


def _generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    eos = [metadata.get("tokenizer.ggml.eos_token_id")]
    # llama.cpp also stops on end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>)
    eos += [
        metadata.get("tokenizer.ggml.eot_token_id"),
        metadata.get("tokenizer.ggml.eom_token_id"),
    ]
    ids = list(dict.fromkeys(int(t) for t in eos if t is not None))
    config: dict[str, Any] = {"eos_token_id": ids[0] if len(ids) == 1 else ids}
    for name in ("bos", "padding"):
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config["bos_token_id" if name == "bos" else "pad_token_id"] = int(value)
    return config


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(contents: GGUFContents):  # -> tokenizers.Tokenizer
    """The fast tokenizer the metadata describes: byte-level BPE ("gpt2") or SentencePiece
    ("llama")."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    m = contents.metadata
    kind = m.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_tokenizer(contents)
    if kind != "gpt2":
        raise ValueError(
            f"model_path: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, the "
            "byte-level BPE of Llama 3, Qwen2, SmolLM...; llama, the SentencePiece BPE of "
            "Llama 2, Mistral 7B v0.1, TinyLlama...)"
        )
    pre = m.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"model_path: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    split, digits, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens: list[str] = list(_meta(contents, "tokenizer.ggml.tokens"))
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = [tuple(merge.split(" ", 1)) for merge in _meta(contents, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    types = list(m.get("tokenizer.ggml.token_type") or [])
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types)
        if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    added = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(types)
        if kind == _TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(added)
    bos_id = m.get("tokenizer.ggml.bos_token_id")
    if m.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece_tokenizer(contents: GGUFContents):  # -> tokenizers.Tokenizer
    """SentencePiece BPE ("llama"), built as transformers builds it from the same file (the
    oracle the tests hold it to): a BPE whose merges are ranked by the merged piece's score,
    byte fallback to <0xNN> pieces, spaces written as '▁' with one prepended to the text.

    Where transformers and llama.cpp differ, this follows transformers: '▁' is prepended
    only at the start of the text (llama.cpp also prepends one after each special token) and
    not when the text already starts with a space (llama.cpp's "  hi" is '▁▁▁hi', this
    '▁▁hi'). It departs from transformers, following llama.cpp, where the file says
    `add_space_prefix` false (transformers ignores the flag) and for a character a vocabulary
    without byte pieces cannot spell (transformers drops it; this gives the unknown token).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    m = contents.metadata
    tokens: list[str] = list(_meta(contents, "tokenizer.ggml.tokens"))
    vocab = {token: i for i, token in enumerate(tokens)}  # a repeated piece: its last id
    merges = m.get("tokenizer.ggml.merges")
    if merges is not None:  # a file converted from a tokenizer.json may carry them
        merges = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        # no scores: all equal, as llama.cpp reads such a file (transformers cannot load it)
        scores = m.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_by_score(vocab, dict(zip(tokens, scores)))
    named = _named_token_ids(m, len(tokens))
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
        unk_token=tokens[named["unknown"]] if "unknown" in named else None,
    ))
    prefix = bool(m.get("tokenizer.ggml.add_space_prefix", True))
    # split=False: the whole text between special tokens is one word, as SentencePiece sees it
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # the space the encoder prepended
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    types = list(m.get("tokenizer.ggml.token_type") or [])
    special = {i for i, kind in enumerate(types) if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)}
    # bos/eos/unk/pad are special (matched whole in text) whatever their type, as in transformers
    special |= set(named.values())
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    tokenizer.add_tokens([
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(types)
        if kind == _TOKEN_USER_DEFINED and i not in special
    ])
    tokenizer.post_processor = _bos_eos_processor(m, tokens, named)
    return tokenizer


def _merges_by_score(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's choice (merge the adjacent pair whose union is
    the best-scored piece): every cut of a piece into two vocabulary pieces is a merge, ranked
    by the piece's score. Equal scores are ordered as transformers orders them (longer left
    part first, then longer right part, then vocabulary order), for the same ids."""
    ranked = []
    for piece, score in scores.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), left, right))
    # a stable sort on the first three keys: ties keep vocabulary order
    ranked.sort(key=lambda r: r[:3])
    return [(left, right) for *_, left, right in ranked]


def _named_token_ids(metadata: dict[str, Any], vocab_size: int) -> dict[str, int]:
    """bos/eos/unknown/padding -> token id, for those the file names within its vocabulary."""
    ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None and int(value) < vocab_size:
            ids[name] = int(value)
    return ids


def _adds_bos(metadata: dict[str, Any]) -> bool:
    flag = metadata.get("tokenizer.ggml.add_bos_token")
    if flag is None:  # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary
        return metadata.get("tokenizer.ggml.model") == "llama"
    return bool(flag)


def _bos_eos_processor(m: dict[str, Any], tokens: list[str], named: dict[str, int]):
    """BOS/EOS around each sequence, as the file's add_bos_token/add_eos_token say (named:
    _named_token_ids)."""
    from tokenizers import processors

    bos = tokens[named["bos"]] if "bos" in named and _adds_bos(m) else None
    add_eos = m.get("tokenizer.ggml.add_eos_token")
    eos = tokens[named["eos"]] if "eos" in named and add_eos else None
    ids = {token: named[name] for name, token in (("bos", bos), ("eos", eos)) if token is not None}

    def sequence(part: str, type_id: int) -> list[str]:
        return [f"{word}:{type_id}" for word in (bos, f"${part}", eos) if word is not None]

    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=list(ids.items()),
    )


def write_tokenizer(contents: GGUFContents, out_dir: Path, *, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`."""
    m = contents.metadata
    build_tokenizer(contents).save(str(out_dir / "tokenizer.json"), pretty=False)
    tokens = m["tokenizer.ggml.tokens"]

    def token(name: str) -> str | None:
        value = m.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(value)] if value is not None and int(value) < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": _adds_bos(m),
        "add_eos_token": bool(m.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    template = m.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", config)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def find_gguf_in_dir(path: str | Path) -> Path | None:
    """The one .gguf file of a directory that is not itself a checkpoint, else None.

    A ValueError when there are several (which one is meant is not guessable)."""
    path = Path(path)
    if (path / "config.json").exists():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(
            f"model_path: {str(path)!r} holds several GGUF files ({names}); pass one of them"
        )
    return files[0] if files else None
