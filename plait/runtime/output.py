"""Finish checks after each new token, and batching of new tokens into BatchTokenOut."""

from __future__ import annotations

from plait.matching import stop_search_start
from plait.messages import BatchTokenOut
from plait.runtime.core import Req


class StopChecker:
    """EOS, stop_token_ids, stop strings and max_new_tokens; min_new_tokens defers them."""

    def __init__(self, tokenizer, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)

    def check(self, req: Req) -> None:
        if req.finished:
            return
        sp = req.sampling
        tok = req.output_ids[-1]
        n_out = len(req.output_ids)
        if n_out >= sp.min_new_tokens:
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
                req.finish("stop", matched=tok)
                return
            if sp.stop and self._stop_string(req):
                return
        if n_out >= sp.max_new_tokens:
            incomplete = req.grammar is not None and not req.grammar.can_terminate()
            req.finish("length", **({"incomplete": True} if incomplete else {}))

    def _stop_string(self, req: Req) -> bool:
        """A stop string ending in the newest token's text. Occurrences wholly inside older
        text do not count: they were either seen before (and stopped the request then) or came
        before min_new_tokens, when stop strings are plain output."""
        longest = max(len(s) for s in req.sampling.stop)
        ids = req.output_ids[-(longest + 2) :]
        tail = self.tokenizer.decode(ids, skip_special_tokens=False)
        before = self.tokenizer.decode(ids[:-1], skip_special_tokens=False)
        for s in req.sampling.stop:
            if tail.find(s, stop_search_start(before, s)) >= 0:
                req.finish("stop", matched=s)
                return True
        return False


class OutputCollector:
    """Requests with something to send this step; one BatchTokenOut for all of them."""

    def __init__(self, stream_interval: int) -> None:
        self.stream_interval = stream_interval
        self._reqs: dict[str, Req] = {}

    def add(self, req: Req) -> None:
        self._reqs[req.rid] = req

    def discard(self, req: Req) -> None:
        """Req failed: its client gets an error instead of this output."""
        if self._reqs.get(req.rid) is req:
            del self._reqs[req.rid]

    def flush(self) -> list[BatchTokenOut]:
        ready = [r for r in self._reqs.values() if self._due(r)]
        self._reqs = {rid: r for rid, r in self._reqs.items() if not self._due(r)}
        if not ready:
            return []
        out = BatchTokenOut(
            rids=[], new_token_ids=[], finished_reasons=[], prompt_tokens=[],
            completion_tokens=[], cached_tokens=[], skip_special_tokens=[], no_stop_trim=[],
            output_token_logprobs=[], output_top_logprobs=[], input_token_logprobs=[],
            input_top_logprobs=[], extra_meta=[], stop_strs=[],
        )
        for req in ready:
            _append(out, req)
        return [out]

    def _due(self, req: Req) -> bool:
        if req.finished:
            return True
        if req.missing_output_logprobs:
            return False  # each streamed token goes with its logprob (the next forward's)
        new = len(req.output_ids) - req.sent_output_len
        return req.stream and new >= self.stream_interval


def _append(out: BatchTokenOut, req: Req) -> None:
    out.rids.append(req.rid)
    out.new_token_ids.append(req.output_ids[req.sent_output_len :])
    req.sent_output_len = len(req.output_ids)
    out.finished_reasons.append(req.finished_reason)
    out.prompt_tokens.append(len(req.input_ids))
    out.completion_tokens.append(len(req.output_ids))
    out.cached_tokens.append(req.cached_tokens)
    out.skip_special_tokens.append(req.sampling.skip_special_tokens)
    out.no_stop_trim.append(req.sampling.no_stop_trim)
    out.include_stop_str.append(req.sampling.include_stop_str_in_output)
    out.stop_strs.append(list(req.sampling.stop))
    out.output_token_logprobs.append(req.output_token_logprobs)
    out.output_top_logprobs.append(req.output_top_logprobs)
    req.output_token_logprobs, req.output_top_logprobs = [], []
    out.input_token_logprobs.append(req.input_token_logprobs or None)
    out.input_top_logprobs.append(req.input_top_logprobs or None)
    if req.input_token_logprobs:  # sent once
        req.input_token_logprobs, req.input_top_logprobs = [], []
    extra = {"forced_tokens": req.num_forced_tokens, "queue_time": req.queue_time}
    if req.ngram_index is not None:  # speculation was tried for it
        extra["spec_accepted_tokens"] = req.spec_accepted_tokens
    out.extra_meta.append(extra)
