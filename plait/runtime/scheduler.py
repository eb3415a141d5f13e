"""The scheduler: receive -> schedule -> run -> sample -> emit -> free, in a loop.

One object owns the waiting/running queues and composes the parts: ModelRunner (forward),
KVManager (+ RadixCache), the admission policy, Sampler, grammar constraints (ReqGrammar),
and a SchedulerIO that carries messages (ZMQ in a process, or in-memory for tests).

Failure isolation: whatever goes wrong while serving one request (its grammar, its sampling
parameters, its logprobs, its stop checks) fails that request alone with a RequestErrorOut
naming the cause, and frees its KV, request slot, radix locks and grammar; a forward that
raises fails the requests of its batch. The loop itself keeps serving.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from plait.args import ServerArgs
from plait.errors import RequestError
from plait.kernels.base import ForwardMode
from plait.messages import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    RequestErrorOut,
    StatsOut,
    TokenizedGenerateReq,
)
from plait.models.tokenizer import DeferredTokenizer
from plait.radix_cache.radix_cache import RadixCache
from plait.runtime import logprobs
from plait.runtime import schedule_policy as policy
from plait.runtime.constraints import ConstraintTracker
from plait.runtime.core import Batch, Req, RequestFailed
from plait.runtime.kv_manager import KVManager
from plait.runtime.model_runner import ModelRunner
from plait.runtime.ngram import NgramIndex, accepted_prefix, likely_tokens
from plait.runtime.output import OutputCollector, StopChecker
from plait.runtime.parallel import TPGroup
from plait.runtime.sampler import Sampler
from plait.runtime.step_timer import StepTimer
from plait.runtime.thread_tuner import attention_work
from plait.sampling import SamplingParams

logger = logging.getLogger(__name__)

# picks a row may take again when its grammar's matcher refuses one its mask allowed
REPICK_LIMIT = 64

TOKENIZER_IDLE_S = 0.5  # idle this long before a DeferredTokenizer starts loading
# with nothing to run but grammars compiling, the loop waits on its socket this long between
# checks of the compiles (a message still wakes it at once): polling without a wait held the
# GIL from the compile threads, and the first constrained request on a fresh server (whose
# thread imports xgrammar, ~3.4 s alone) took 35-44 s
GRAMMAR_WAIT_S = 0.005


class SchedulerIO(Protocol):
    def recv(self, timeout_s: float) -> list[Any]: ...
    def send(self, msg: Any) -> None: ...


class Scheduler:
    def __init__(
        self, args: ServerArgs, model_path: str, io: SchedulerIO, tokenizer, tp: TPGroup | None = None
    ) -> None:
        self.args = args
        self.io = io
        self.tokenizer = tokenizer
        self.runner = ModelRunner(args, model_path, tp)  # tp: rank 0 of a tensor-parallel group
        # n-gram draft length: off by default where decode replays CUDA graphs (the verify
        # forward would run eagerly, far slower than the replayed steps it saves); else 8
        # (SmolLM2 on the Intel Xeon VM against 4: batch 1 decode 2.75x -> 4.37x of no
        # drafts, extract 1.51x -> 1.61x; batch 4 and 12 even: the acceptance-scaled draft
        # length and the row budget hold drafts back where they are rejected)
        self.speculative_ngram = args.speculative_ngram
        if self.speculative_ngram is None:
            self.speculative_ngram = 0 if self.runner.decode_graphs is not None else 8
        cache = RadixCache(self.runner.kv_pool, disable=args.disable_radix_cache)
        self.kv = KVManager(self.runner.kv_pool, self.runner.req_to_token_pool, cache,
                            run=args.kv_run_tokens)
        cfg = self.runner.config
        self.eos_ids = tuple(cfg.eos_token_ids)
        self.valid_vocab_size = len(tokenizer)  # ids past it have no token: never sampled
        self.sampler = Sampler(self.valid_vocab_size, self.eos_ids, args.random_seed)
        self.constraints = ConstraintTracker(args, tokenizer, cfg.vocab_size, self.eos_ids)
        self.stop_checker = StopChecker(tokenizer, self.eos_ids)
        # a DeferredTokenizer (plait/models/tokenizer.py) loads transformers' tokenizer once
        # the loop has been idle for TOKENIZER_IDLE_S, not beside the first requests' steps
        # (the import holds the GIL for ~0.8 s); a constrained request before then loads it
        self._tokenizer_to_start = (
            tokenizer.start if isinstance(tokenizer, DeferredTokenizer) else None
        )
        # the grammar backend is built in the background once the loop first idles too
        # (ConstraintTracker.prepare_in_background), unless --lazy-grammar-backend
        self._grammar_to_prepare = not args.lazy_grammar_backend
        self._idle_since: float | None = None
        self.outputs = OutputCollector(args.stream_interval)
        self.ratio = policy.NewTokenRatio()
        self.timer = StepTimer()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.requests_by_priority: Counter[int] = Counter()
        self.counters = {
            "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
            "extend_forwards": 0, "decode_forwards": 0, "retractions": 0, "forced_tokens": 0,
            "finished_requests": 0, "aborted_requests": 0, "failed_requests": 0,
            "request_forwards": 0,  # forwards summed over the requests in them
            # decode KV rows read once for a group sharing a cached prefix, not once per member
            "decode_shared_kv_tokens": 0,
            # n-gram speculation: decode steps run as a verifying extend, tokens proposed, and
            # proposed tokens the model agreed with (each one a decode forward saved)
            "spec_forwards": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
            # picks a grammar's mask allowed and its matcher refused, picked again
            "refused_mask_picks": 0,
        }
        self._handlers = {
            TokenizedGenerateReq: self.handle_generate,
            AbortReq: self.handle_abort,
            FlushCacheReq: self.handle_flush,
            GetStatsReq: self.handle_stats,
        }

    # ------------------------------------------------------------------ loop
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def run_forever(self) -> None:
        while True:
            self.step_safely(idle_wait_s=0.05)

    def step_safely(self, idle_wait_s: float = 0.0) -> None:
        """step(); an error outside any one request's step fails the requests in flight
        (their state cannot be trusted) and the loop goes on. Under tensor parallelism it is
        fatal instead: the other ranks may be out of step (the server then exits)."""
        try:
            self.step(idle_wait_s)
        except Exception as e:
            if self.runner.tp.size > 1:
                raise
            logger.exception("scheduler step failed; failing the requests in flight")
            self.fail_all(RequestFailed(f"internal error: {type(e).__name__}: {e}", 500))
            self._flush_outputs()

    def _start_when_idle(self, idle: bool) -> None:
        """Once the loop has idled TOKENIZER_IDLE_S: load the DeferredTokenizer, then prepare
        the grammar backend (both on background threads)."""
        now = time.monotonic()
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= TOKENIZER_IDLE_S:
            if self._tokenizer_to_start is not None:
                self._tokenizer_to_start()
                self._tokenizer_to_start = None
            if self._grammar_to_prepare:
                self.constraints.prepare_in_background()
                self._grammar_to_prepare = False

    def step(self, idle_wait_s: float = 0.0) -> bool:
        """One iteration; returns True if a forward ran."""
        with self.timer("io"):
            idle = not self.has_work and not self.constraints.pending
            if self._tokenizer_to_start is not None or self._grammar_to_prepare:
                self._start_when_idle(idle)
            if idle:
                wait = idle_wait_s
            else:  # only compiles in flight: wait on the socket, not in a Python spin
                wait = min(idle_wait_s, GRAMMAR_WAIT_S) if not self.has_work else 0.0
            msgs = self.io.recv(wait)
        for msg in msgs:
            self._dispatch(msg)
        with self.timer("grammar"):
            self._admit_compiled()
        with self.timer("schedule"):
            batch = self.next_batch()
        if batch is not None:
            self.run_batch(batch)
        self._flush_outputs()
        return batch is not None

    def _flush_outputs(self) -> None:
        with self.timer("io"):  # also aborts, which finish without a forward
            for msg in self.outputs.flush():
                self.io.send(msg)

    def _dispatch(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise TypeError(f"scheduler: no handler for message {type(msg).__name__}")
        handler(msg)

    # ------------------------------------------------------------------ failures
    @contextmanager
    def isolate(self, req: Req) -> Iterator[None]:
        """Run one request's step: an exception fails req alone and is not re-raised."""
        try:
            yield
        except RequestFailed as e:
            self.fail(req, e)
        except Exception as e:
            logger.exception("request %s failed", req.rid)
            self.fail(req, RequestFailed(f"internal error: {type(e).__name__}: {e}", 500))

    def fail(self, req: Req, error: RequestFailed) -> None:
        """Req ends with error (sent to its client) and gives back everything it holds."""
        if self.reqs.get(req.rid) is not req:
            return  # already finished or failed (or never registered)
        req.finish("error", message=str(error))
        self.counters["failed_requests"] += 1
        self.outputs.discard(req)
        self.io.send(RequestErrorOut(req.rid, str(error), error.status, error.param))
        self._free(req)

    def fail_all(self, error: RequestFailed) -> None:
        for req in list(self.reqs.values()):
            self.fail(req, error)
        self.chunked = None

    def _free(self, req: Req) -> None:
        """Take req out of every queue and release its state; safe to call more than once."""
        try:
            self.constraints.cancel(req)
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.running.remove(req)
            if self.chunked is req:
                self.chunked = None
        finally:
            try:
                self.kv.release(req)
            finally:
                self.reqs.pop(req.rid, None)
                req.grammar = None

    # ------------------------------------------------------------------ handlers
    def handle_generate(self, msg: TokenizedGenerateReq) -> None:
        try:
            req = self._make_req(msg)
        except ValueError as e:
            self.io.send(RequestErrorOut(msg.rid, str(e), 400, getattr(e, "param", None)))
            return
        except Exception as e:  # a malformed message must not stop the loop
            logger.exception("request %s could not be created", msg.rid)
            self.io.send(RequestErrorOut(msg.rid, f"internal error: {type(e).__name__}: {e}", 500))
            return
        self.reqs[req.rid] = req
        self.requests_by_priority[req.priority] += 1
        if req.sampling.constraint is not None:
            with self.isolate(req):
                self.constraints.submit(req)
        else:
            self.waiting.append(req)

    def _make_req(self, msg: TokenizedGenerateReq) -> Req:
        if msg.rid in self.reqs:
            raise ValueError(f"rid: request id {msg.rid!r} is already running")
        # The prompt and sampling parameters were validated once, by the tokenizer manager
        # (GenerateInput.normalize, TokenizerManager.validate); what only the scheduler knows
        # is checked here: which requests run, and the KV pool's size.
        sampling = SamplingParams.from_dict(msg.sampling_params)
        need = len(msg.input_ids) + sampling.max_new_tokens
        if need > self.runner.kv_pool.size:
            raise RequestError(
                "max_new_tokens",
                f"the request needs {need} KV slots but the whole pool has "
                f"{self.runner.kv_pool.size}",
            )
        return Req(
            rid=msg.rid, input_ids=list(msg.input_ids), sampling=sampling,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, stream=msg.stream, priority=msg.priority,
        )

    def handle_abort(self, msg: AbortReq) -> None:
        req = self.reqs.get(msg.rid)
        if req is None:
            return
        req.finish("abort")
        self.counters["aborted_requests"] += 1
        self._finish(req)

    def handle_flush(self, msg: FlushCacheReq) -> None:
        if self.has_work:
            self.io.send(FlushCacheOut(False, "requests are running"))
            return
        ok = self.kv.flush()
        if ok:
            self.constraints.flush()  # (its closing plans: what past requests left, too)
        self.io.send(FlushCacheOut(ok, "" if ok else "cache is locked"))

    def handle_stats(self, msg: GetStatsReq) -> None:
        self.io.send(StatsOut(msg.nonce, self.stats()))

    def stats(self) -> dict[str, Any]:
        pool = self.runner.kv_pool
        c = self.counters
        return {
            "max_total_tokens": pool.size,
            "kv_free": pool.free_size,
            "kv_evictable": self.kv.cache.evictable_size(),
            "kv_protected": self.kv.cache.protected_size(),
            "kv_used": self.kv.used,
            "kv_usage": self.kv.used / pool.size,
            "req_slots_free": self.kv.req_to_token.free_size,
            "num_running": len(self.running) + (1 if self.chunked else 0),
            "num_waiting": len(self.waiting) + self.constraints.pending,
            "cache_hit_rate": c["cached_tokens"] / max(1, c["prompt_tokens"]),
            "context_length": self.runner.context_length,
            "step_time": self.timer.summary(),
            "threads": self.runner.thread_stats(),
            "grammar": self.constraints.stats(),
            # requests received per priority, and waiting now per priority (str keys: JSON)
            "requests_by_priority": {
                str(p): n for p, n in sorted(self.requests_by_priority.items())
            },
            "waiting_by_priority": {
                str(p): n for p, n in sorted(Counter(r.priority for r in self.waiting).items())
            },
            **c,
        }

    def _admit_compiled(self) -> None:
        for req, error in self.constraints.poll():
            if error is not None:
                self.fail(req, error)
            elif not req.finished:
                self.waiting.append(req)

    # ------------------------------------------------------------------ scheduling
    def next_batch(self) -> Batch | None:
        batch = self._extend_batch()
        if batch is not None:
            return batch
        return self._decode_batch()

    def _extend_batch(self) -> Batch | None:
        budget = self.args.chunked_prefill_size
        reqs, lens = [], []
        # While a prompt longer than the budget prefills chunk by chunk, the decoding requests
        # ride along in each of its forwards (an extend of 1 each, at most half the budget),
        # as vLLM mixes decodes into its prefill chunks: before, the chunks ran one forward
        # after another and every running stream stopped until the last (a 3,000-token
        # SmolLM2 prompt: 5 s without a token). Their tokens are set aside from the budget
        # first and taken only if a chunk is left pending after this forward.
        decoding = [r for r in self.running if r.pending_len == 1]
        set_aside = min(len(decoding), budget // 2)
        budget -= set_aside
        beside = None  # the chunked prompt when it continues after this forward
        if self.chunked is not None:  # continue the pending chunked prompt first
            req, self.chunked = self.chunked, None
            # part of the budget goes to waiting requests that fit in it whole: a short
            # request starts now, not after the long prompt's last chunk (a 7,000-token
            # SmolLM2 prompt in 2,048-token chunks: "hi" waited 14-22 s)
            n = min(req.pending_len, budget - self._new_share(budget),
                    self._chunk_limit(req, continued=True))
            if self.kv.alloc(req, n):
                reqs.append(req)
                lens.append(n)
                budget -= n
                if n < req.pending_len:
                    self.chunked = beside = req
            else:
                self.chunked = req
                self._retract_one()
                return None
        forced = False
        for req in [r for r in self.running if r.pending_len > 1]:  # jump-forward tokens
            n = req.pending_len
            if budget < n or not self.kv.alloc(req, n):
                continue
            reqs.append(req)
            lens.append(n)
            budget -= n
            forced = True
        if self.waiting and budget > 0:
            room = self.args.max_running_requests - len(self.running) - len(reqs)
            ordered = policy.order_waiting(self.waiting, self.args.schedule_policy, self.kv)
            reserve = policy.decode_reserve(self.running, self.ratio.value)
            adm = policy.admit(ordered, self.kv, budget, room, reserve, beside,
                               self._chunk_limit)
            for req in adm.reqs:
                self.waiting.remove(req)
            reqs += adm.reqs
            lens += adm.extend_lens
            if beside is None:
                self.chunked = adm.chunked
        if forced or (reqs and self.chunked is not None):
            # the requests with one pending token ride along (an extend of 1): with forced
            # tokens, otherwise they waited for a decode forward of their own right after
            # this one, and a batch of JSON requests whose forced text comes at different
            # steps ran two forwards (each reading all the weights) per generated token
            budget += set_aside
            for req in decoding:
                if budget < 1 or not self.kv.alloc(req, 1):
                    break
                reqs.append(req)
                lens.append(1)
                budget -= 1
        if not reqs:
            return None
        samples_token = [self.chunked is not r for r in reqs]
        return Batch(ForwardMode.EXTEND, reqs, lens, samples_token)

    def _company(self) -> bool:
        """Whether a long prompt's chunk has company that a shorter forward serves: requests
        running (they ride along in it) or waiting ones that would start beside it (whole
        prompts within the --chunked-prefill-new-share of the budget). Another long prompt
        waiting is none: it starts after this one's last chunk either way."""
        if self.running:
            return True
        share = int(self.args.chunked_prefill_size * self.args.chunked_prefill_new_share)
        return any(r.seq_len <= share for r in self.waiting)

    def _chunk_limit(self, req: Req, continued: bool = False) -> int:
        """The most tokens of req's pending extend one forward takes: a long prompt (more
        pending tokens than the budget, or `continued` from a chunk) gets
        --chunked-prefill-beside-size tokens' work when it has company (_company, looked at
        only for a long prompt: it scans the waiting queue), else the budget's; cut to its
        work either way (_chunk_cap). A 7,000-token SmolLM2 prompt's 2,048-token chunks took
        ~3 s each, and a stream riding along waited that long for each of its tokens, a short
        request as long to start."""
        size = self.args.chunked_prefill_size
        small = self.args.chunked_prefill_beside_size
        if 0 < small < size and (continued or req.pending_len > size) and self._company():
            size = small
        return self._chunk_cap(req.kv_len, size)

    def _chunk_cap(self, prefix: int, size: int | None = None) -> int:
        """The most tokens one forward extends a request by after `prefix` cached tokens: as
        many as `size` (default --chunked-prefill-size) tokens with no context cost in all (the
        linears and the causal attention over the prefix and the chunk itself:
        thread_tuner.attention_work).
        SmolLM2's 2,048-token chunks of a 7,000-token prompt took 2.9, 4.5 and 6.4 s, each
        forward and each request riding along in it waiting longer the further the prompt
        got; capped, the chunks after 2,048, 4,096 and 6,144 tokens take 1,436, 1,086 and
        870 tokens (--disable-chunk-work-cap: all 2,048)."""
        budget = size or self.args.chunked_prefill_size
        cost = self.runner.pair_cost
        if self.args.disable_chunk_work_cap or cost <= 0:
            return budget
        work = attention_work([0], [budget], cost)
        b = 1 + cost * (prefix + 0.5)  # attention_work([prefix], [n]) = n * b + cost * n^2 / 2
        n = int((math.sqrt(b * b + 2 * cost * work) - b) / cost)
        if attention_work([prefix], [n + 1], cost) <= work:  # (the root's rounding)
            n += 1
        return max(1, min(budget, n))

    def _new_share(self, budget: int) -> int:
        """Tokens of a continuing chunked prompt's step kept for waiting requests: the
        --chunked-prefill-new-share of the budget when a waiting request's whole prompt fits
        in it and a running slot is free, else none."""
        share = int(budget * self.args.chunked_prefill_new_share)
        if share <= 0 or len(self.running) + 1 >= self.args.max_running_requests:
            return 0
        return share if any(r.seq_len <= share for r in self.waiting) else 0

    def _decode_batch(self) -> Batch | None:
        reqs = [r for r in self.running if r.pending_len == 1]
        if not reqs:
            return None
        # retract first, then allocate: a victim must not hold a slot of this step
        while self.kv.available < len(reqs):
            victim = self._retract_one()
            if victim is None:
                raise RuntimeError("KV pool exhausted with nothing left to retract")
            if victim in reqs:
                reqs.remove(victim)
        if not reqs:
            return None
        drafts = self._propose_drafts(reqs)
        for req, draft in zip(reqs, drafts):
            assert self.kv.alloc(req, 1 + len(draft))
        self.ratio.on_decode()
        if any(drafts):  # verify the drafts: an extend of each pending token + its draft
            lens = [1 + len(d) for d in drafts]
            return Batch(ForwardMode.EXTEND, reqs, lens, [True] * len(reqs), drafts)
        return Batch(ForwardMode.DECODE, reqs, [1] * len(reqs), [True] * len(reqs))

    def _propose_drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each decoding request's n-gram draft (empty when it does not speculate), within
        the KV slots left after one slot per request."""
        a = self.args
        drafts: dict[int, list[int]] = {}
        # draft tokens make the forward wider: a narrow forward is bound by reading the
        # weights, so its extra rows come almost free, but past ~8-16 rows (by the machine) a
        # CPU forward is compute-bound and a rejected draft costs real time. So drafts fill a
        # forward up to max_rows rows, within a per-forward budget, going to the requests
        # whose drafts were accepted most
        budget = min(
            self.kv.available - len(reqs), a.speculative_ngram_max_tokens,
            a.speculative_ngram_max_rows - len(reqs),
        ) if self.speculative_ngram else 0
        if budget <= 0:
            return [[] for _ in reqs]
        candidates = [r for r in reqs if _may_speculate(r)]
        for req in candidates:
            if req.ngram_index is None:
                req.ngram_index = NgramIndex(a.speculative_ngram_min_match, a.speculative_ngram_max_match)
        rows = len(reqs)
        for req in sorted(candidates, key=lambda r: -r.ngram_index.acceptance):
            n = min(
                req.ngram_index.draft_len(self.speculative_ngram), budget,
                req.remaining_new_tokens - 1, self.runner.context_length - req.seq_len,
            )
            # past the narrow rows, a row costs about half a decoded token (args.py): only the
            # draft tokens with even odds of being kept
            narrow = max(0, a.speculative_ngram_narrow_rows - rows)
            if n > narrow:
                n = narrow + likely_tokens(req.ngram_index.acceptance, n - narrow)
            if n > 0:
                draft = req.ngram_index.propose(req.all_ids, n)
                if req.grammar is not None:  # a token the grammar rejects is never accepted
                    draft = draft[: self.constraints.valid_prefix(req, draft)]
                drafts[id(req)] = draft
                budget -= len(draft)
                rows += len(draft)
        return [drafts.get(id(r), []) for r in reqs]

    def _retract_one(self) -> Req | None:
        """Send a running request back to the waiting queue: the lowest priority first, then
        the one with the least progress. Its computed KV stays in the cache (unlocked) and is
        recomputed if evicted."""
        if not self.running:
            return None
        victim = policy.retraction_victim(self.running)
        self.running.remove(victim)
        self.kv.release(victim)
        self.waiting.insert(0, victim)
        self.counters["retractions"] += 1
        self.ratio.on_retract()
        return victim

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def run_batch(self, batch: Batch) -> None:
        with self.timer("schedule"):
            plan = logprobs.plan_logit_rows(batch)
        try:
            with self.timer("forward"):
                vocab = self.valid_vocab_size if plan.argmax_only else None
                out = self.runner.forward(batch, plan.rows, vocab)
        except Exception as e:  # the batch's requests fail; the server keeps serving
            if self.runner.tp.size > 1:
                # the other ranks may have run (part of) this forward: they are out of step,
                # so the scheduler process dies and the server exits (children are watched)
                raise
            logger.exception("forward of %d requests failed", batch.batch_size)
            error = RequestFailed(f"internal error in the forward: {type(e).__name__}: {e}", 500)
            for req in batch.reqs:
                self.fail(req, error)
            return
        mode = "extend_forwards" if batch.mode is ForwardMode.EXTEND else "decode_forwards"
        self.counters["spec_forwards" if batch.draft_ids is not None else mode] += 1
        self.counters["request_forwards"] += batch.batch_size
        self.counters["decode_shared_kv_tokens"] += out.shared_kv_tokens
        with self.timer("sample"):
            self._process(batch, out.logits, plan)

    def _process(self, batch: Batch, logits: torch.Tensor, plan: logprobs.LogitRows) -> None:
        """The result step: record input logprobs, commit the computed KV, sample, record
        output logprobs, commit the new tokens (finish checks, jump-forward), emit."""
        # logits rows: the sampling requests' last rows first (batch order), then prompt rows
        row_index = {r: k for k, r in enumerate(plan.rows)}
        self._record_input_logprobs(batch, logits, row_index, plan.input_rows)
        for i, pairs in plan.output_rows.items():  # (before the sampled tokens' own)
            req = batch.reqs[i]
            with self.isolate(req):
                logprobs.record_missing_output_logprobs(req, logits, row_index, pairs)
        self._commit_kv(batch)
        sampling = [r for r, s in zip(batch.reqs, batch.samples_token) if s]
        sample_row = {id(r): k for k, r in enumerate(sampling)}
        drafted = {id(batch.reqs[i]): i for i in plan.draft_rows}
        plain = [r for r in sampling if id(r) not in drafted]
        new_tokens = self._sample(plain, logits, sample_row)
        for req in plain:
            if req.finished:  # failed in a step above
                continue
            with self.isolate(req):
                self._commit_tokens(req, new_tokens.get(id(req)))
        for i, rows in plan.draft_rows.items():
            req = batch.reqs[i]
            if req.finished:
                continue
            with self.isolate(req):
                idx = [row_index[r] for r in rows] + [sample_row[id(req)]]
                self._verify_draft(req, logits[idx], batch.draft_ids[i])

    def _record_input_logprobs(
        self, batch: Batch, logits: torch.Tensor, row_index: dict[int, int], input_rows: dict
    ) -> None:
        for i, pairs in input_rows.items():
            req = batch.reqs[i]
            with self.isolate(req):
                logprobs.record_input_logprobs(req, logits, row_index, pairs)

    def _commit_kv(self, batch: Batch) -> None:
        """The forward computed the batch's KV: advance each request and, after a prefill,
        share its tokens through the radix cache."""
        for req, ext, samples in zip(batch.reqs, batch.extend_lens, batch.samples_token):
            if req.finished:
                continue
            with self.isolate(req):
                if batch.draft_ids is not None:  # decoding: the draft's KV waits for _verify_draft
                    self.kv.commit(req, 1)
                    continue
                self.kv.commit(req, ext)
                # a prompt (or a chunk of it) goes into the tree now; a running request's
                # output (jump-forward text, or one token riding along in an extend) goes in
                # when it finishes, as a decode step's does (~80 us a request a step)
                if batch.mode is ForwardMode.EXTEND and req not in self.running:
                    self.kv.cache_prefilled(req)
                    if samples:
                        self._on_prefilled(req)

    def _sample(
        self, reqs: list[Req], logits: torch.Tensor, sample_row: dict[int, int]
    ) -> dict[int, tuple[int, torch.Tensor | None]]:
        """{id(req): (next token, its row's logprobs when the request returns them)} for the
        requests that sample now (not forced, not done); a request whose row cannot be sampled
        fails here. A request that returns logprobs and emits a forced token now gets that
        token's logprob from its row (the model's, as for a sampled token)."""
        for r in reqs:
            if r.forced_ids and r.return_logprob and not r.finished:
                with self.isolate(r):
                    row = torch.log_softmax(logits[sample_row[id(r)]].float(), dim=-1)
                    logprobs.record_output_logprob(r, row, r.forced_ids[0])
        to_sample = [
            r for r in reqs
            if not r.finished and r.sampling.max_new_tokens > 0 and not r.forced_ids
        ]
        if not to_sample:
            return {}
        idx = [sample_row[id(r)] for r in to_sample]
        # [len(to_sample), V]; a view when the rows are the first ones in order
        sub = logits[: len(idx)] if idx == list(range(len(idx))) else logits[idx]
        bitmask = self.constraints.bitmask(to_sample, sub.shape[1], self.fail)
        alive = [k for k, r in enumerate(to_sample) if not r.finished]
        if len(alive) < len(to_sample):  # a grammar failed while filling its mask
            to_sample = [to_sample[k] for k in alive]
            sub = sub[alive]
            bitmask = bitmask[alive] if bitmask is not None else None
            if not to_sample:
                return {}
        try:
            res = self.sampler(sub, to_sample, bitmask)  # masks in place: logits are fresh
        except Exception as e:  # not attributable to one row (per-row errors come in res)
            logger.exception("sampling a batch of %d failed", len(to_sample))
            error = RequestFailed(f"internal error in sampling: {type(e).__name__}: {e}", 500)
            for req in to_sample:
                self.fail(req, error)
            return {}
        for k, req in enumerate(to_sample):
            if req.grammar is not None and k not in res.errors:
                self._repick_refused(req, k, sub, bitmask, res)
        for k, err in res.errors.items():
            self.fail(to_sample[k], err)
        new_tokens = {}
        for k, req in enumerate(to_sample):
            if k in res.errors:
                continue
            new_tokens[id(req)] = (res.next_ids[k], res.logprobs[k] if req.return_logprob else None)
            if req.return_logprob:
                with self.isolate(req):
                    logprobs.record_output_logprob(req, res.logprobs[k], res.next_ids[k])
        return new_tokens

    def _commit_tokens(self, req: Req, sampled: tuple[int, torch.Tensor | None] | None) -> None:
        """Append req's next token (sampled, or forced by its grammar), then what its grammar
        forces after it; finished requests free their state."""
        if req.sampling.max_new_tokens == 0:
            req.finish("length")
        else:
            if req.forced_ids:
                self._emit(req, [req.forced_ids.pop(0)])
            else:
                assert sampled is not None, "a sampling request got no token"
                if self._emit_sampled(req, *sampled):  # else its closing came in its place
                    self._force_follow(req)
        self.outputs.add(req)
        if req.finished:
            self._finish(req)

    def _verify_draft(self, req: Req, logits: torch.Tensor, draft: list[int]) -> None:
        """Greedy verification: logits [1 + len(draft), V] are the model's next-token rows
        after the pending token and after each draft token. The tokens the model picks up to
        its first disagreement with the draft, plus that one, are exactly what plain decoding
        would emit; the KV of the agreed draft tokens is kept and the rest freed."""
        if req.grammar is not None:
            kept = accepted = self._verify_constrained(req, logits, draft)
            if self.reqs.get(req.rid) is not req:
                return  # failed (its grammar raised): already freed
        else:
            res = self.sampler(logits, [req] * logits.shape[0], None)
            accepted = accepted_prefix(draft, res.next_ids)  # an error row (-1) never agrees
            if accepted in res.errors:
                raise res.errors[accepted]
            before = len(req.output_ids)
            self._emit(req, res.next_ids[: accepted + 1])  # stops at EOS, stop strings, length
            emitted = len(req.output_ids) - before
            if req.return_logprob:
                for k in range(emitted):
                    logprobs.record_output_logprob(req, res.logprobs[k], res.next_ids[k])
            kept = min(accepted, emitted)  # draft tokens now in the output, with their KV computed
        self.kv.commit(req, kept)
        self.kv.free_uncommitted(req)
        req.spec_accepted_tokens += kept
        req.ngram_index.record(len(draft), accepted)
        self.counters["spec_draft_tokens"] += len(draft)
        self.counters["spec_accepted_tokens"] += kept
        self.outputs.add(req)
        if req.finished:
            self._finish(req)

    def _verify_constrained(
        self, req: Req, logits: torch.Tensor, draft: list[int]
    ) -> int:
        """_verify_draft for a request with a grammar, one row at a time in plain decoding's
        order: row j is masked by the matcher's state after the tokens emitted before it, its
        token is emitted (advancing the matcher), and text the grammar forces after it (jump-
        forward, a closing near the budget) is appended as plain decoding would, which ends
        the draft's use: the model would be fed that text next, not the draft. Returns how many
        draft tokens are kept (agreed with, and followed by a row verified after them)."""
        kept = 0
        for j in range(logits.shape[0]):
            row = logits[j : j + 1]  # masked in place: each row is used once
            mask = self.constraints.bitmask([req], row.shape[1], self.fail)
            if req.finished:
                break
            res = self.sampler(row, [req], mask)
            if 0 not in res.errors:
                self._repick_refused(req, 0, row, mask, res)
            if 0 in res.errors:
                raise res.errors[0]
            token = res.next_ids[0]
            if req.return_logprob:
                logprobs.record_output_logprob(req, res.logprobs[0], token)
            if not self._emit_sampled(req, token, res.logprobs[0] if req.return_logprob else None):
                break  # its closing came in its place
            # as after any sampled token, the grammar's forced text comes next; the token
            # then stays pending (its KV recomputed with that text, or fed before it)
            forced = self._force_follow(req)
            if forced or req.finished or j == len(draft) or token != draft[j]:
                break
            kept += 1  # the draft token's KV, computed at this position, is the model's
        return kept

    def _repick_refused(self, req: Req, k: int, logits, bitmask: torch.Tensor, res) -> None:
        """A grammar backend's mask may allow a token its own matcher then refuses (xgrammar
        0.2.8 past a counted repetition of 128: a regex `[^x]{300,}` let tokens with an `x`
        through, and the request failed with an internal error). Row k's pick (res.next_ids[k])
        is checked against req's matcher; a refused one is masked out of the row and the row
        picked again (its argmax, or sampled as the sampler would), up to
        REPICK_LIMIT times before the request fails."""
        token = res.next_ids[k]
        for _ in range(REPICK_LIMIT):
            if self.constraints.takes(req, token):
                res.next_ids[k] = token
                return
            self.counters["refused_mask_picks"] += 1
            if self.counters["refused_mask_picks"] == 1:
                logger.warning("the grammar backend's mask allowed token %d, which its matcher "
                               "refuses (request %s); picking again", token, req.rid)
            if isinstance(logits, torch.Tensor):  # masked in place by the sampler already
                logits[k, token] = float("-inf")
                if not torch.isfinite(logits[k]).any():
                    break
                if req.sampling.is_greedy:
                    token = int(logits[k].argmax())
                else:
                    errors: dict = {}
                    token = int(self.sampler._sample_rows(logits[k : k + 1], [req], [k],
                                                          errors)[0])
                    if errors:
                        break
            else:  # screened rows (greedy): the row's best pick under the narrowed mask
                word, bit = divmod(token, 32)
                value = (int(bitmask[k, word]) & 0xFFFFFFFF) & ~(1 << bit)
                bitmask[k, word] = value - (1 << 32) if value >= 1 << 31 else value
                row_max, ids = logits[k : k + 1].picks(bitmask[k : k + 1])
                if not torch.isfinite(row_max).all():
                    break
                token = int(ids[0])
        res.errors[k] = RequestFailed(
            "constraint: the grammar backend's mask allowed tokens its matcher refuses", 500)
        res.next_ids[k] = -1

    def _emit_sampled(self, req: Req, token: int, row: torch.Tensor | None = None) -> bool:
        """Emit a sampled token, or, near max_new_tokens, the closing its grammar needs in its
        place when the token would leave no room to end the output whole (ConstraintTracker.
        admit): the closing's first token now, the rest as _force_follow's forced text. Whether
        the token itself was emitted. The sampled token's logprob, recorded already from `row`,
        becomes the closing's first token's (the same row predicts it); the rest are fed one a
        step for a request that returns logprobs, each logprob from its own row."""
        closing = self.constraints.admit(req, token)
        if closing is None:
            self._emit(req, [token])  # stops at EOS, stop strings, length
            return True
        if req.return_logprob:
            logprobs.drop_last_output_logprob(req)
            logprobs.record_output_logprob(req, row, closing[0])
        self.counters["forced_tokens"] += len(closing)
        req.num_forced_tokens += len(closing)
        if self.args.disable_jump_forward or self._forced_one_a_step(req):
            self._emit(req, closing[:1])
            if not req.finished:
                req.forced_ids.extend(closing[1:])  # emitted one per decode step
        elif req.return_logprob and len(closing) > 1:
            # the closing's text at once, its EOS fed after it: the forward that computes the
            # text's rows gives their logprobs, and its last row EOS's (a closing of EOS alone
            # is emitted below: its logprob is the sampled token's row's, recorded above)
            self._emit(req, closing[:-1])
            if not req.finished:
                req.forced_ids.append(closing[-1])
        else:
            self._emit(req, closing)
        return False

    def _force_follow(self, req: Req) -> bool:
        """After a sampled token: the tokens its grammar forces next are appended now (one
        extend step computes their KV), or, with jump-forward off, queued to be fed one per
        decode step. Whether there were any."""
        follow = self._grammar_follow(req)
        if follow and self._forced_one_a_step(req):
            req.forced_ids.extend(follow)  # emitted one per decode step
        elif follow:
            self._emit(req, follow)
        return bool(follow)

    @staticmethod
    def _forced_one_a_step(req: Req) -> bool:
        """Forced text is fed one token a decode step, each token's logprob from the row
        before it: a request that returns logprobs and has a stop string or stop token id,
        which might end its output inside the text, before an extend fed all of it had
        computed the rows that predict it."""
        return req.return_logprob and bool(req.sampling.stop or req.sampling.stop_token_ids)

    def _jump_limit(self, req: Req) -> int:
        """How many forced tokens the grammar may give req at once (jump-forward; 0 with it
        off, the model then decodes every token under the mask). A request that returns
        logprobs gets each forced token's from the row that predicts it, computed by the
        extend that feeds the text, so the budget's last token stays for the row after it."""
        if self.args.disable_jump_forward:
            return 0
        if req.return_logprob and not self._forced_one_a_step(req):
            return req.remaining_new_tokens - 1
        return req.remaining_new_tokens

    def _grammar_follow(self, req: Req) -> list[int]:
        """Tokens the grammar forces next (jump-forward); near the budget, the closing plan
        is brought up to date first."""
        if req.finished or req.forced_ids:
            return []
        self.constraints.plan_closing(req)
        follow = self.constraints.jump_forward(req, limit=self._jump_limit(req))
        self.counters["forced_tokens"] += len(follow)
        req.num_forced_tokens += len(follow)
        return follow

    def _emit(self, req: Req, tokens: list[int]) -> None:
        """The one place output tokens are appended: grammar advance and finish checks."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for tok in tokens:
            req.output_ids.append(tok)
            self.counters["generation_tokens"] += 1
            self.constraints.accept(req, tok)
            self.stop_checker.check(req)
            if req.finished:
                return

    def _on_prefilled(self, req: Req) -> None:
        if req.first_token_time is None:
            self.counters["prompt_tokens"] += len(req.input_ids)
            self.counters["cached_tokens"] += req.cached_tokens
        self.running.append(req)

    def _finish(self, req: Req) -> None:
        """Req finished (stop, length, abort): its output goes out and its state is freed."""
        try:
            self.counters["finished_requests"] += 1
            self.outputs.add(req)
        finally:
            self._free(req)


def _may_speculate(req: Req) -> bool:
    """Whether a draft's verification is exact with the sampler's greedy rows: greedy, no
    penalties (they depend on the tokens before each row), past min_new_tokens, and no forced
    tokens queued (jump-forward off). A grammar's rows are verified one at a time, the matcher
    advancing through the draft (_verify_constrained)."""
    sp = req.sampling
    return (
        sp.is_greedy and not sp.has_penalties and not req.forced_ids
        and len(req.output_ids) >= sp.min_new_tokens
    )
