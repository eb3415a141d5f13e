"""Core scheduler state: Req (one request) and Batch (the requests of one forward)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from plait.kernels.base import ForwardMode
from plait.sampling import SamplingParams

_EMPTY = torch.empty((0,), dtype=torch.int64)


class ClosingPlan(NamedTuple):
    """The grammar-closing planner's last result, so it re-plans only when the budget tightens."""

    remaining_then: int = 0  # the request's remaining new tokens when it was planned
    tokens: tuple[int, ...] | None = None  # the plan (before its EOS), when one was found
    at: int = -1  # len(output_ids) it was planned from (-1: never planned)
    failures: int = 0  # searches in a row that found no closing (this one included)

    @property
    def length(self) -> int | None:
        """Tokens of the last plan (-1: none was found; None: never planned)."""
        if self.at < 0:
            return None
        return -1 if self.tokens is None else len(self.tokens)


class RequestFailed(Exception):
    """Serving one request failed. status 400 when the request itself is the cause (an
    unsatisfiable constraint, parameters that make the logits non-finite), 500 otherwise;
    param names the request field when one is to blame."""

    def __init__(self, message: str, status: int = 500, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(eq=False)  # requests are compared by identity (queue membership)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned (-1: none)
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int = 0  # higher is served sooner (see schedule_policy for the aging bound)
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    # KV state: positions [0, kv_len) of all_ids have KV in req_to_token[req_pool_idx];
    # the first prefix_len of them are shared from the radix tree (locked at last_node).
    req_pool_idx: int | None = None
    kv_len: int = 0
    # positions [kv_len, alloc_len) have slots allocated for the forward being run; a forward
    # that fails leaves them uncomputed, and release() returns them to the pool
    alloc_len: int = 0
    # positions [alloc_len, reserved_len) have slots set aside for the request's next tokens
    # (KVManager's runs: a request's tokens in adjacent slots); none when reserved_len <= alloc_len
    reserved_len: int = 0
    prefix_indices: torch.Tensor = _EMPTY
    last_node: Any = None
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    admitted: bool = False
    queue_time: float = 0.0  # seconds from arrival to first admission

    grammar: Any = None  # Matcher, once compiled
    forced_ids: list[int] = field(default_factory=list)  # grammar-forced tokens not yet emitted
    num_forced_tokens: int = 0
    closing_plan: ClosingPlan = field(default_factory=ClosingPlan)
    finished_reason: dict[str, Any] | None = None
    # speculative decoding (plait.runtime.ngram): the request's n-gram index, and how many
    # proposed tokens the model accepted (each one a forward saved)
    ngram_index: Any = None
    spec_accepted_tokens: int = 0
    sent_output_len: int = 0  # output tokens already sent to the detokenizer

    # logprobs accumulated since the last send
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]]] | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        assert self.input_ids, "empty input_ids"
        if self.return_logprob and self.logprob_start_len >= 0:
            self.input_token_logprobs = []
            self.input_top_logprobs = []

    # ------------------------------------------------------------------ derived
    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def pending_len(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return self.seq_len - self.kv_len

    @property
    def prefix_len(self) -> int:
        return int(self.prefix_indices.numel())

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))

    @property
    def missing_output_logprobs(self) -> int:
        """Output tokens emitted ahead of the forward that computes the rows predicting them
        (a request that returns logprobs: its jump-forward text); that forward records their
        logprobs, and the output waits for them."""
        if not self.return_logprob:
            return 0
        return len(self.output_ids) - self.sent_output_len - len(self.output_token_logprobs)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.input_token_logprobs is not None

    def input_logprob_limit(self) -> int:
        """Longest prompt prefix that may come from the cache: input logprobs need the logits
        at position logprob_start_len - 1 to be computed."""
        if not self.wants_input_logprobs:
            return len(self.input_ids) - 1
        return max(0, min(self.logprob_start_len - 1, len(self.input_ids) - 1))

    def finish(self, kind: str, **extra: Any) -> None:
        if self.finished_reason is None:
            self.finished_reason = {"type": kind, **extra}


@dataclass
class Batch:
    """The requests of one forward and the slice of each one's tokens it computes."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens of each request in this forward
    # whether each request samples a token after this forward (False for a non-final chunk)
    samples_token: list[bool]
    # a speculative decode step (EXTEND mode): each request's draft tokens, verified after its
    # pending token (extend_lens[i] == 1 + len(draft_ids[i])); None for any other batch
    draft_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        assert len(self.reqs) == len(self.extend_lens) == len(self.samples_token)
        if self.draft_ids is not None:
            assert all(n == 1 + len(d) for n, d in zip(self.extend_lens, self.draft_ids))
        assert all(n > 0 for n in self.extend_lens)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)
