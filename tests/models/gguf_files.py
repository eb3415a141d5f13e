"""Write small GGUF files the way llama.cpp's converter does, for the GGUF tests.

The weights and tokenizer come from a tiny random Hugging Face checkpoint built by
plait.models.embedded; this module plays llama.cpp's `convert_hf_to_gguf.py`: renames the
tensors, permutes the q/k rows of llama models into llama.cpp's rope order, quantizes with the
`gguf` package, and writes the model and tokenizer metadata with `gguf.GGUFWriter`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from plait.models.embedded import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    CheckpointSpec,
    build_checkpoint,
)

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


def build_hf_checkpoint(
    out_dir: Path, *, tied: bool = False, vocab_size: int | None = None
) -> Path:
    """The test model; `vocab_size` resizes its embeddings for another GGUF vocabulary (the
    checkpoint's own tokenizer files are then not used)."""
    spec = dataclasses.replace(TEST_SPEC, tie_word_embeddings=tied)
    if vocab_size is not None:
        # every row random: build_checkpoint zeroes the rows past its tokenizer's vocabulary
        base = vocab_size - len(SPECIAL_TOKENS)
        spec = dataclasses.replace(spec, vocab=base, vocab_size=vocab_size)
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
    tokenizer_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """`hf_dir`'s model as a GGUF file: matrices in `qtype`, norms in F32. The tokenizer is
    `hf_dir`'s (or `tokenizer`) as byte-level BPE, unless `tokenizer_metadata` writes another."""
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
    if tokenizer_metadata is not None:
        tokenizer_metadata(writer)
    else:
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


# ----------------------------------------------------------------------------- SentencePiece

# The text the SentencePiece test vocabulary is learned from: its pieces are what this text
# merges into, so the test strings (English, code, numbers) exercise many merges.
SPM_CORPUS = """
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the forest. There is a house at the end of the road where the people of the town meet
every evening; they talk about the weather, the harvest and the news from the other towns.
In the morning the children walk to the school, reading and writing their lessons, singing
and playing in the garden. I'm sure you'll agree it's a fine place: we've seen it ourselves.
def fibonacci(number): return number if number < 2 else fibonacci(number - 1) + fibonacci(2)
for index in range(100): total = total + values[index] * weights[index]
The year 2024 had 365 days, 12 months and 52 weeks; 3.14159 is close to pi, 1,000,000 is big.
Hello, world! This is a test of the tokenizer: Hello again, testing the tests once more.
Ünïcödé naïve café résumé Straße über
"""

# llama.cpp's tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def spm_vocabulary(
    merges: int = 360, seed: int = 7
) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece BPE vocabulary shaped like Llama 2's:
    <unk>, <s>, </s>, the 256 byte pieces <0x00>..<0xFF>, then pieces learned by BPE on
    SPM_CORPUS (score -k for the k-th merge, below them the single characters), two more control
    tokens and a user-defined one. The learned pieces get ids in a shuffled order, so a tokenizer
    that ranked merges by id instead of score would not pass."""
    words = Counter("\u2581" + w for w in SPM_CORPUS.split())
    segmented = {w: list(w) for w in words}
    chars = sorted({c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyz"))
    # runs of spaces are Llama 2's best merges; whitespace-split words never contain them
    learned = ["\u2581\u2581", "\u2581\u2581\u2581\u2581", "\u2581\u2581\u2581"]
    while len(learned) < merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, pieces in segmented.items():
            for pair in itertools.pairwise(pieces):
                pairs[pair] += words[w]
        if not pairs:
            break
        # most frequent pair, ties to the smallest: deterministic
        best = min(pairs, key=lambda p: (-pairs[p], p))
        learned.append(best[0] + best[1])
        for w, pieces in segmented.items():
            out: list[str] = []
            for piece in pieces:
                if out and (out[-1], piece) == best:
                    out[-1] += piece
                else:
                    out.append(piece)
            segmented[w] = out
    scored = [(p, -float(k)) for k, p in enumerate(learned)]
    scored += [(c, -float(len(learned) + k)) for k, c in enumerate(chars) if c not in learned]
    order = np.random.default_rng(seed).permutation(len(scored))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    scores = [0.0] * len(tokens)
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256]
    for i in order:
        tokens.append(scored[i][0])
        scores.append(scored[i][1])
        types.append(NORMAL)
    for token, kind in (("[INST]", CONTROL), ("[/INST]", CONTROL), ("<|sep|>", USER_DEFINED)):
        tokens.append(token)
        scores.append(0.0)
        types.append(kind)
    assert len(set(tokens)) == len(tokens)
    return tokens, scores, types


def spm_tokenizer_metadata(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    model: str = "llama",
    add_bos: bool | None = True,
    add_eos: bool | None = False,
    add_space_prefix: bool | None = None,
) -> Callable[[gguf.GGUFWriter], None]:
    """Writes the tokenizer metadata llama.cpp's converter writes for a SentencePiece model
    (tokenizer.ggml.model `model`, "llama"); a flag given as None is left out, as older files
    do."""

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(tokens.index("<s>"))
        writer.add_eos_token_id(tokens.index("</s>"))
        writer.add_unk_token_id(tokens.index("<unk>"))
        writer.add_pad_token_id(tokens.index("<unk>"))
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        if add_eos is not None:
            writer.add_add_eos_token(add_eos)
        if add_space_prefix is not None:
            writer.add_add_space_prefix(add_space_prefix)
        writer.add_chat_template(LLAMA2_TEMPLATE)

    return write


# Llama 2's chat template, shortened: [INST] turns between <s> and </s>
LLAMA2_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{ ' ' + message['content'] + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def write_spm_tokenizer_only_gguf(
    path: Path, write: Callable[[gguf.GGUFWriter], None], arch: str = "llama"
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    write(writer)
    _finish(writer)
    return path


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = 16) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids), one prompt at a time."""
    import torch

    out = []
    for ids in prompts:
        gen = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )
        out.append(gen[0, len(ids):].tolist())
    return out
