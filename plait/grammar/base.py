"""The constraint interface: GrammarBackend.compile(kind, spec) -> CompiledGrammar -> Matcher.

Kinds: "json_schema" (canonical JSON text), "json_object" (spec ""), "regex", "ebnf",
"choices" (JSON list of strings), "structural_tag" (xgrammar's structural tag, JSON text: free
text with tagged, constrained parts; xgrammar backend only). A constraint the backend cannot
enforce exactly raises GrammarError naming the unsupported feature; nothing is ever silently
weakened.

Token masks are int32 bitmasks [batch, ceil(vocab_size / 32)], bit j of word w allowing
token 32 * w + j; `apply_token_bitmask` applies a whole batch's masks in one call.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch

from plait.registry import GRAMMAR_BACKENDS

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "choices", "structural_tag")


class GrammarError(ValueError):
    """A constraint that cannot be compiled or is not supported (HTTP 400 for that request)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Matcher(ABC):
    """State of one request's constraint while it decodes."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed."""

    def accept_prefix(self, tokens: list[int]) -> int:
        """Advance by `tokens` up to the first one not allowed; how many were taken (they stay
        taken). The closing planner checks a whole plan after each sampled token."""
        n = 0
        for tok in tokens:
            if not self.accept_token(tok):
                break
            n += 1
        return n

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token mask into bitmask[row], overwriting the whole row (EOS
        allowed iff can terminate). Callers reuse rows (constraints.py's one-row scratch)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the constraint has accepted EOS (the output is complete)."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True if the output so far is a complete match (EOS would be accepted now)."""

    @abstractmethod
    def find_jump_forward_string(self) -> str:
        """The text every valid continuation must start with ('' if none is forced)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def copy(self) -> Matcher:
        """An independent matcher in the same state (for n > 1 and forks)."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> Matcher: ...


# longest run of whitespace allowed between JSON tokens when any_whitespace is on
DEFAULT_MAX_WHITESPACE = 12


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer/vocabulary."""

    name: str

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        any_whitespace: bool = False,
        max_whitespace: int = DEFAULT_MAX_WHITESPACE,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.any_whitespace = any_whitespace
        self.max_whitespace = max_whitespace

    @abstractmethod
    def compile(self, kind: str, spec: str) -> CompiledGrammar: ...

    @classmethod
    @abstractmethod
    def supported_features(cls) -> dict:
        """What this backend enforces, for /get_server_info (kinds, JSON-schema keywords, ...)."""

    # Optional persistence, used by GrammarManager's cache_dir. A backend that cannot serialize
    # keeps these defaults (serialize -> None: nothing is written).
    def serialize(self, grammar: CompiledGrammar) -> bytes | None:
        return None

    def deserialize(self, data: bytes) -> CompiledGrammar:
        raise NotImplementedError(f"{type(self).__name__} does not deserialize grammars")

    def fingerprint(self) -> str:
        """Names the engine version and options: cached grammars of another fingerprint are
        never loaded."""
        return self.name


def create_grammar_backend(
    name: str, tokenizer, vocab_size: int, eos_token_ids: list[int], **options
) -> GrammarBackend:
    """The backend registered as `name` (plait.registry.GRAMMAR_BACKENDS), built for this
    vocabulary; ValueError naming the known backends for an unknown name."""
    backend_cls = GRAMMAR_BACKENDS.load(name)
    return backend_cls(tokenizer, vocab_size, list(eos_token_ids), **options)


def check_satisfiable(grammar: CompiledGrammar, kind: str, vocab_size: int) -> None:
    """GrammarError (naming the constraint's field) if the constraint accepts no string at all
    (`{"$ref": "#"}`, a `$ref` cycle without a base case, `root ::= root "a"`): its first
    mask allows no token and it is not already complete. Emptiness that appears only after
    some tokens is caught when sampling (the request fails: no continuation)."""
    matcher = grammar.matcher()
    if matcher.is_terminated() or matcher.can_terminate():
        return
    mask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    if not bool((mask != 0).any()):
        raise GrammarError(f"{kind}: the constraint accepts no string (nothing can be generated)",
                           kind)


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] (in place): tokens whose bit is 0 get -inf. One call for the whole batch.

    Tokens beyond the bitmask's coverage (V > 32 * W, e.g. padded embedding rows) are never
    allowed. Rows whose mask allows everything (unconstrained requests) are left alone."""
    bsz, vocab = logits.shape
    covered = min(vocab, bitmask.shape[1] * 32)
    if covered < vocab:
        logits[:, covered:] = float("-inf")
    constrained = (bitmask[:, : (covered + 31) // 32] != -1).any(dim=1)  # [B]
    if not bool(constrained.any()):
        return
    if logits.device.type == "cpu" and _cpu_kernel_fits(logits, bitmask):
        rows = constrained.nonzero().flatten().tolist()
        _xgrammar_cpu_kernel()(logits, bitmask, vocab_size=covered, indices=rows)
        return
    _apply_torch(logits, bitmask.to(logits.device), covered)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [..., W] (int32 words) -> bool [..., vocab]: the tokens each row allows."""
    bits = torch.ones(32, dtype=torch.int32, device=bitmask.device) << torch.arange(
        32, dtype=torch.int32, device=bitmask.device
    )
    return (bitmask.unsqueeze(-1) & bits).ne(0).flatten(-2)[..., :vocab]


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, covered: int) -> None:
    banned = ~allowed_tokens(bitmask, covered)  # [B, covered]
    logits[:, :covered].masked_fill_(banned, float("-inf"))


def _cpu_kernel_fits(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    return (
        logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and bitmask.device.type == "cpu"
        and bitmask.dtype == torch.int32
        and bitmask.shape[0] == logits.shape[0]
        and _xgrammar_cpu_kernel() is not None
    )


@functools.cache
def _xgrammar_cpu_kernel():
    """xgrammar's C++ CPU kernel (about 2x the torch path), or None without xgrammar."""
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
            apply_token_bitmask_inplace_cpu,
        )
    except ImportError:
        return None
    return apply_token_bitmask_inplace_cpu
