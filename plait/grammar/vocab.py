"""What each token id spells, as bytes, for grammar engines that walk text.

Special tokens (chat markers, EOS) spell nothing: a grammar must never allow them as text,
because the detokenizer drops them (`skip_special_tokens`) and the output would differ from what
the grammar accepted. EOS is handled by the matchers separately.
"""

from __future__ import annotations

import functools


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def special_token_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def token_bytes(tokenizer) -> list[bytes | None]:
    """Bytes of every token id below the tokenizer's size; None for special or unused ids."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    size = max(vocab.values()) + 1 if vocab else 0
    specials = special_token_ids(tokenizer)
    decode = _decoder_for(vocab)
    out: list[bytes | None] = [None] * size
    for token, token_id in vocab.items():
        if token_id not in specials:
            out[token_id] = decode(token)
    return out


def _decoder_for(vocab: dict[str, int]):
    byte_pieces = sum(f"<0x{b:02X}>" in vocab for b in range(256))
    if byte_pieces >= 128:
        return _decode_byte_fallback
    alphabet = _byte_level_decoder()
    in_alphabet = sum(all(c in alphabet for c in token) for token in vocab)
    if in_alphabet >= 0.99 * len(vocab):
        return _decode_byte_level
    return lambda token: token.encode("utf-8")


def _decode_byte_level(token: str) -> bytes | None:
    alphabet = _byte_level_decoder()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:  # an added non-special token written in plain text
        return token.encode("utf-8")


def _decode_byte_fallback(token: str) -> bytes:
    """SentencePiece: '<0x0A>' is a raw byte, '▁' a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")
