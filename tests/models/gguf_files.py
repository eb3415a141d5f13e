"""Write small GGUF files the way llama.cpp's converter does, for the GGUF tests.

The weights and tokenizer come from a tiny random Hugging Face checkpoint built by
plait.models.embedded; this module plays llama.cpp's `convert_hf_to_gguf.py`: renames the
tensors, permutes the q/k rows of llama models into llama.cpp's rope order, quantizes with the
`gguf` package, and writes the model and tokenizer metadata with `gguf.GGUFWriter`.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from plait.models.embedded import CHATML_TEMPLATE, CheckpointSpec, build_checkpoint

# a small Llama with a real (cl100k, truncated) byte-level BPE vocabulary: 2048 ranks + 3 specials
TEST_SPEC = CheckpointSpec(
    architecture="LlamaForCausalLM",
    vocab=2048,
    vocab_size=2051,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
    rope_theta=50000.0,
    max_position_embeddings=1024,
    seed=99,
)

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def build_hf_checkpoint(out_dir: Path, *, tied: bool = False) -> Path:
    spec = TEST_SPEC.__class__(**{**TEST_SPEC.__dict__, "tie_word_embeddings": tied})
    build_checkpoint(spec, out_dir)
    return out_dir


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's rotate-half halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def gguf_tensors(hf_dir: Path, arch: str = "llama") -> dict[str, np.ndarray]:
    """The checkpoint's float32 tensors under llama.cpp names, q/k permuted for llama."""
    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = {}
    for name, value in sorted(load_file(hf_dir / "model.safetensors").items()):
        value = value.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, kv_heads)
        out[gguf_name(name)] = value
    return out


def write_gguf(
    hf_dir: Path,
    path: Path,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    arch: str = "llama",
    pre: str = "llama-bpe",
    tokenizer: tuple[list[str], list[str], list[int]] | None = None,
) -> Path:
    """`hf_dir`'s model as a GGUF file: matrices in `qtype`, norms in F32."""
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    write_tokenizer_metadata(writer, *(tokenizer or hf_tokenizer(hf_dir)), pre=pre)
    for name, value in gguf_tensors(hf_dir, arch).items():
        if value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    _finish(writer)
    return path


def hf_tokenizer(hf_dir: Path) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges as "a b", llama.cpp token types) of a tokenizer.json."""
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    types = {i: 1 for i in vocab.values()}  # 1: NORMAL
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
        types[added["id"]] = 3 if added["special"] else 4  # CONTROL / USER_DEFINED
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges, [types[i] for i in range(len(tokens))]


def without_digit_merges(
    tokens: list[str], merges: list[str], types: list[int]
) -> tuple[list[str], list[str], list[int]]:
    """A vocabulary with no token joining a digit to anything (as SmolLM's, whose merges were
    learned on single digits), so GPT-2 splitting and digit-by-digit splitting agree."""

    def joins_digit(token: str) -> bool:
        return len(token) > 1 and any(c.isdigit() for c in token)

    keep = [i for i, t in enumerate(tokens) if types[i] != 1 or not joins_digit(t)]
    return (
        [tokens[i] for i in keep],
        [m for m in merges if not joins_digit(m.replace(" ", ""))],
        [types[i] for i in keep],
    )


def write_tokenizer_metadata(
    writer: gguf.GGUFWriter, tokens: list[str], merges: list[str], types: list[int], *, pre: str
) -> None:
    eos = tokens.index("<|endoftext|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tokenizer_only_gguf(
    path: Path, tokens: list[str], merges: list[str], types: list[int], *, pre: str
) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    write_tokenizer_metadata(writer, tokens, merges, types, pre=pre)
    _finish(writer)
    return path


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
