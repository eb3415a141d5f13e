"""The scheduler: receive -> schedule -> run -> sample -> emit -> free, in a loop.

One object owns the waiting/running queues and composes the parts: ModelRunner (forward),
KVManager (+ RadixCache), the admission policy, Sampler, grammar constraints (ReqGrammar),
and a SchedulerIO that carries messages (ZMQ in a process, or in-memory for tests).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from plait.args import ServerArgs
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
from plait.radix_cache.radix_cache import RadixCache
from plait.runtime import schedule_policy as policy
from plait.runtime.constraints import ConstraintTracker
from plait.runtime.core import Batch, Req
from plait.runtime.kv_manager import KVManager
from plait.runtime.model_runner import ModelRunner
from plait.runtime.output import OutputCollector, StopChecker
from plait.runtime.parallel import TPGroup
from plait.runtime.sampler import Sampler, top_logprobs
from plait.runtime.step_timer import StepTimer
from plait.sampling import SamplingParams

logger = logging.getLogger(__name__)


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
        cache = RadixCache(self.runner.kv_pool, disable=args.disable_radix_cache)
        self.kv = KVManager(self.runner.kv_pool, self.runner.req_to_token_pool, cache)
        cfg = self.runner.config
        self.eos_ids = tuple(cfg.eos_token_ids)
        self.sampler = Sampler(len(tokenizer), self.eos_ids, args.random_seed)
        self.constraints = ConstraintTracker(args, tokenizer, cfg.vocab_size, self.eos_ids)
        self.stop_checker = StopChecker(tokenizer, self.eos_ids)
        self.outputs = OutputCollector(args.stream_interval)
        self.ratio = policy.NewTokenRatio()
        self.timer = StepTimer()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.counters = {
            "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
            "extend_forwards": 0, "decode_forwards": 0, "retractions": 0, "forced_tokens": 0,
            "finished_requests": 0, "aborted_requests": 0,
            "request_forwards": 0,  # forwards summed over the requests in them
            # decode KV rows read once for a group sharing a cached prefix, not once per member
            "decode_shared_kv_tokens": 0,
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
            self.step(idle_wait_s=0.05)

    def step(self, idle_wait_s: float = 0.0) -> bool:
        """One iteration; returns True if a forward ran."""
        with self.timer("io"):
            idle = not self.has_work and not self.constraints.pending
            msgs = self.io.recv(idle_wait_s if idle else 0.0)
        for msg in msgs:
            self._dispatch(msg)
        with self.timer("grammar"):
            self._admit_compiled()
        with self.timer("schedule"):
            batch = self.next_batch()
        if batch is not None:
            self.run_batch(batch)
        with self.timer("io"):  # also aborts, which finish without a forward
            for msg in self.outputs.flush():
                self.io.send(msg)
        return batch is not None

    def _dispatch(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise TypeError(f"scheduler: no handler for message {type(msg).__name__}")
        handler(msg)

    # ------------------------------------------------------------------ handlers
    def handle_generate(self, msg: TokenizedGenerateReq) -> None:
        try:
            req = self._make_req(msg)
        except ValueError as e:
            self.io.send(RequestErrorOut(msg.rid, str(e), 400, getattr(e, "param", None)))
            return
        self.reqs[req.rid] = req
        if req.sampling.constraint is not None:
            self.constraints.submit(req)
        else:
            self.waiting.append(req)

    def _make_req(self, msg: TokenizedGenerateReq) -> Req:
        if msg.rid in self.reqs:
            raise ValueError(f"rid: request id {msg.rid!r} is already running")
        sampling = SamplingParams.from_dict(msg.sampling_params)
        if not msg.input_ids:
            raise ValueError("input_ids: the prompt is empty")
        need = len(msg.input_ids) + sampling.max_new_tokens
        if len(msg.input_ids) >= self.runner.context_length:
            raise ValueError(
                f"input_ids: prompt of {len(msg.input_ids)} tokens does not fit the context "
                f"length {self.runner.context_length}"
            )
        if need > self.runner.kv_pool.size:
            raise ValueError(
                f"max_new_tokens: the request needs {need} KV slots but the whole pool has "
                f"{self.runner.kv_pool.size}"
            )
        if max(msg.input_ids) >= self.runner.config.vocab_size or min(msg.input_ids) < 0:
            raise ValueError("input_ids: token id out of the model's vocabulary")
        return Req(
            rid=msg.rid, input_ids=list(msg.input_ids), sampling=sampling,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, stream=msg.stream,
        )

    def handle_abort(self, msg: AbortReq) -> None:
        req = self.reqs.get(msg.rid)
        if req is None:
            return
        req.finish("abort")
        self.counters["aborted_requests"] += 1
        self.constraints.cancel(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self._finish(req)

    def handle_flush(self, msg: FlushCacheReq) -> None:
        if self.has_work:
            self.io.send(FlushCacheOut(False, "requests are running"))
            return
        ok = self.kv.flush()
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
            "num_running": len(self.running) + (1 if self.chunked else 0),
            "num_waiting": len(self.waiting) + self.constraints.pending,
            "cache_hit_rate": c["cached_tokens"] / max(1, c["prompt_tokens"]),
            "context_length": self.runner.context_length,
            "step_time": self.timer.summary(),
            "grammar": self.constraints.stats(),
            **c,
        }

    def _admit_compiled(self) -> None:
        for req, error in self.constraints.poll():
            if error is not None:
                self.reqs.pop(req.rid, None)
                self.io.send(RequestErrorOut(req.rid, str(error), 400, getattr(error, "param", None)))
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
        if self.chunked is not None:  # continue the pending chunked prompt first
            req, self.chunked = self.chunked, None
            n = min(req.pending_len, budget)
            if self.kv.alloc(req, n):
                reqs.append(req)
                lens.append(n)
                budget -= n
                if n < req.pending_len:
                    self.chunked = req
            else:
                self.chunked = req
                self._retract_one(exclude=None)
                return None
        for req in [r for r in self.running if r.pending_len > 1]:  # jump-forward tokens
            n = req.pending_len
            if budget < n or not self.kv.alloc(req, n):
                continue
            reqs.append(req)
            lens.append(n)
            budget -= n
        if self.waiting and self.chunked is None:
            room = self.args.max_running_requests - len(self.running) - len(reqs)
            ordered = policy.order_waiting(self.waiting, self.args.schedule_policy, self.kv)
            reserve = policy.decode_reserve(self.running, self.ratio.value)
            adm = policy.admit(ordered, self.kv, budget, room, reserve)
            for req in adm.reqs:
                self.waiting.remove(req)
            reqs += adm.reqs
            lens += adm.extend_lens
            self.chunked = adm.chunked
        if not reqs:
            return None
        sample = [self.chunked is not r for r in reqs]
        return Batch(ForwardMode.EXTEND, reqs, lens, sample)

    def _decode_batch(self) -> Batch | None:
        reqs = [r for r in self.running if r.pending_len == 1]
        if not reqs:
            return None
        # retract first, then allocate: a victim must not hold a slot of this step
        while self.kv.available < len(reqs):
            victim = self._retract_one(exclude=None)
            if victim is None:
                raise RuntimeError("KV pool exhausted with nothing left to retract")
            if victim in reqs:
                reqs.remove(victim)
        if not reqs:
            return None
        for req in reqs:
            assert self.kv.alloc(req, 1)
        self.ratio.on_decode()
        return Batch(ForwardMode.DECODE, reqs, [1] * len(reqs), [True] * len(reqs))

    def _retract_one(self, exclude: Req | None) -> Req | None:
        """Send the running request with the least progress back to the waiting queue; its
        computed KV stays in the cache (unlocked) and is recomputed if evicted."""
        victims = [r for r in self.running if r is not exclude]
        if not victims:
            return None
        victim = min(victims, key=lambda r: (len(r.output_ids), -r.arrival_time))
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
            rows, logprob_rows = self._logit_rows(batch)
        with self.timer("forward"):
            out = self.runner.forward(batch, rows)
        self.counters["extend_forwards" if batch.mode is ForwardMode.EXTEND else "decode_forwards"] += 1
        self.counters["request_forwards"] += batch.batch_size
        self.counters["decode_shared_kv_tokens"] += out.shared_kv_tokens
        with self.timer("sample"):
            self._process(batch, out.logits, rows, logprob_rows)

    def _logit_rows(self, batch: Batch) -> tuple[list[int], dict[int, list[tuple[int, int]]]]:
        """Rows whose logits are needed: the last row of each sampling request, plus prompt
        rows for input logprobs ({batch index: [(row, prompt position predicted)]})."""
        rows: list[int] = []
        logprob_rows: dict[int, list[tuple[int, int]]] = {}
        offset = 0
        for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if req.wants_input_logprobs and req.kv_len < len(req.input_ids):
                first = max(req.logprob_start_len, 1)
                for pos in range(req.kv_len, req.kv_len + ext):
                    if first <= pos + 1 < len(req.input_ids):
                        logprob_rows.setdefault(i, []).append((offset + pos - req.kv_len, pos + 1))
            if batch.sample[i]:
                rows.append(offset + ext - 1)
            offset += ext
        extra = sorted({r for pairs in logprob_rows.values() for r, _ in pairs} - set(rows))
        return rows + extra, logprob_rows

    def _process(self, batch: Batch, logits: torch.Tensor, rows: list[int], logprob_rows) -> None:
        row_index = {r: k for k, r in enumerate(rows)}
        if logprob_rows:
            self._record_input_logprobs(batch, logits, row_index, logprob_rows)
        for req, ext in zip(batch.reqs, batch.extend_lens):
            req.kv_len += ext
        sampling_reqs = [r for r, s in zip(batch.reqs, batch.sample) if s]
        n_sample = len(sampling_reqs)
        to_sample = [r for r in sampling_reqs if r.sampling.max_new_tokens > 0 and not r.forced_ids]
        sample_idx = [k for k, r in enumerate(sampling_reqs) if r in to_sample]
        new_tokens: dict[int, int] = {}
        logprobs = None
        if to_sample:
            sub = logits[:n_sample][sample_idx] if len(sample_idx) != n_sample else logits[:n_sample]
            bitmask = self.constraints.bitmask(to_sample, logits.shape[1])
            res = self.sampler(sub, to_sample, bitmask)  # masks in place: logits are fresh per step
            logprobs = res.logprobs
            new_tokens = {id(r): t for r, t in zip(to_sample, res.next_ids)}
        for k, req in enumerate(to_sample):
            if req.return_logprob:
                self._record_output_logprob(req, logprobs[k], new_tokens[id(req)])
        if batch.mode is ForwardMode.EXTEND:
            for req, sample in zip(batch.reqs, batch.sample):
                self.kv.cache_prefilled(req)
                if not sample:
                    continue
                if req not in self.running:
                    self._on_prefilled(req)
        for req in sampling_reqs:
            if req.finished:
                continue
            if req.sampling.max_new_tokens == 0:
                req.finish("length")
            elif req.forced_ids:
                self._append(req, [req.forced_ids.pop(0)], forced=True)
            else:
                self._append(req, [new_tokens[id(req)]], forced=False)
            self.outputs.add(req)
            if req.finished:
                self._finish(req)

    def _on_prefilled(self, req: Req) -> None:
        if req.first_token_time is None:
            self.counters["prompt_tokens"] += len(req.input_ids)
            self.counters["cached_tokens"] += req.cached_tokens
        self.running.append(req)

    def _append(self, req: Req, tokens: list[int], forced: bool) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for tok in tokens:
            req.output_ids.append(tok)
            self.counters["generation_tokens"] += 1
            self.constraints.accept(req, tok)
            self.stop_checker.check(req)
            if req.finished:
                return
        if req.forced_ids:
            return
        follow = self.constraints.closing(req) or self.constraints.jump_forward(
            req, limit=req.remaining_new_tokens
        )
        if not follow:
            return
        self.counters["forced_tokens"] += len(follow)
        req.num_forced_tokens += len(follow)
        if self.args.disable_jump_forward:
            req.forced_ids.extend(follow)  # emitted one per decode step
        else:
            # appended now; their KV is computed by one extend step
            for tok in follow:
                req.output_ids.append(tok)
                self.counters["generation_tokens"] += 1
                self.constraints.accept(req, tok)
                self.stop_checker.check(req)
                if req.finished:
                    return

    def _finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
        self.reqs.pop(req.rid, None)
        self.counters["finished_requests"] += 1
        self.outputs.add(req)

    # ------------------------------------------------------------------ logprobs
    def _record_output_logprob(self, req: Req, row: torch.Tensor, token: int) -> None:
        req.output_token_logprobs.append([float(row[token]), token])
        if req.top_logprobs_num:
            req.output_top_logprobs.append(top_logprobs(row, req.top_logprobs_num))

    def _record_input_logprobs(self, batch, logits, row_index, logprob_rows) -> None:
        for i, pairs in logprob_rows.items():
            req = batch.reqs[i]
            if req.kv_len <= req.logprob_start_len == 0 and not req.input_token_logprobs:
                req.input_token_logprobs.append([None, req.input_ids[0]])
                if req.top_logprobs_num:
                    req.input_top_logprobs.append(None)
            idx = torch.tensor([row_index[r] for r, _ in pairs])
            rows = torch.log_softmax(logits[idx], dim=-1)
            for (r, pos), lp in zip(pairs, rows):
                tok = req.input_ids[pos]
                req.input_token_logprobs.append([float(lp[tok]), tok])
                if req.top_logprobs_num:
                    req.input_top_logprobs.append(top_logprobs(lp, req.top_logprobs_num))
