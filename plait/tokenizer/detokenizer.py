"""Detokenizer process: token ids -> incremental text, with stop strings trimmed.

While a request streams, text that could be the start of one of its stop strings is held
back, so the concatenated stream always equals the final (trimmed) text. Messages that are
not token output (errors, control replies) pass through unchanged.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import zmq

from plait.matching import stop_search_start
from plait.messages import (
    BatchStrOut,
    BatchTokenOut,
    MessageReceiver,
    MessageSender,
    RequestErrorOut,
)

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded so far (untrimmed)
    sent: int = 0  # characters of text already sent


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, msg: Any) -> list[Any]:
        """The messages to forward for msg: text for token output (plus an error for each
        request whose text could not be made), anything else unchanged."""
        if isinstance(msg, RequestErrorOut):  # the request failed: its text state goes too
            self.states.pop(msg.rid, None)
            return [msg]
        if not isinstance(msg, BatchTokenOut):
            return [msg]
        keep, deltas, errors = [], [], []
        for i, rid in enumerate(msg.rids):
            try:
                deltas.append(self._step(rid, msg, i))
                keep.append(i)
            except Exception as e:  # one request's output; the others go on
                logger.exception("detokenizing request %s failed", rid)
                self.states.pop(rid, None)
                errors.append(RequestErrorOut(rid, f"internal error in detokenization: "
                                              f"{type(e).__name__}: {e}", 500))
        out: list[Any] = errors
        if keep:
            out.append(_text_out(msg, keep, deltas))
        return out

    def _step(self, rid: str, msg: BatchTokenOut, i: int) -> str:
        st = self.states.setdefault(rid, DecodeState())
        skip = msg.skip_special_tokens[i]
        st.ids.extend(msg.new_token_ids[i])
        finished = msg.finished_reasons[i]
        stops = msg.stop_strs[i] if msg.stop_strs else []
        if finished is not None:
            self.states.pop(rid, None)
            text = self.tokenizer.decode(st.ids, skip_special_tokens=skip)
            matched = finished.get("matched")
            if isinstance(matched, str) and not msg.no_stop_trim[i]:
                # the match ends in the last token's text (the scheduler stops there); an
                # earlier occurrence (before min_new_tokens) is output, not a stop
                before = self.tokenizer.decode(st.ids[:-1], skip_special_tokens=skip)
                cut = text.find(matched, stop_search_start(before, matched))
                if cut >= 0:
                    keep = msg.include_stop_str[i] if msg.include_stop_str else False
                    text = text[: cut + len(matched) if keep else cut]
            return text[st.sent :]
        self._decode_incremental(st, skip)
        end = len(st.text) - _holdback(st.text, stops)
        delta = st.text[st.sent : end] if end > st.sent else ""
        st.sent = max(st.sent, end)
        return delta

    def _decode_incremental(self, st: DecodeState, skip: bool) -> None:
        prefix = self.tokenizer.decode(st.ids[st.prefix_offset : st.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(st.ids[st.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            st.text += full[len(prefix) :]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)


def _text_out(msg: BatchTokenOut, keep: list[int], deltas: list[str]) -> BatchStrOut:
    def pick(values: list) -> list:
        return [values[i] for i in keep] if values else values

    return BatchStrOut(
        rids=pick(msg.rids), text_deltas=deltas, new_token_ids=pick(msg.new_token_ids),
        finished_reasons=pick(msg.finished_reasons), prompt_tokens=pick(msg.prompt_tokens),
        completion_tokens=pick(msg.completion_tokens), cached_tokens=pick(msg.cached_tokens),
        output_token_logprobs=pick(msg.output_token_logprobs),
        output_top_logprobs=pick(msg.output_top_logprobs),
        input_token_logprobs=pick(msg.input_token_logprobs),
        input_top_logprobs=pick(msg.input_top_logprobs), extra_meta=pick(msg.extra_meta),
    )


def _holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of text that may begin (or already contain) a stop string."""
    hold = 0
    for s in stops:
        at = text.find(s)
        if at >= 0:
            hold = max(hold, len(text) - at)
            continue
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def run_detokenizer_process(tokenizer_path: str, input_addr: str, output_addr: str, ready_conn) -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s detokenizer %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from plait.models.tokenizer import load_decoder

    try:
        detok = Detokenizer(load_decoder(tokenizer_path))
        ctx = zmq.Context()
        receiver = MessageReceiver(ctx, input_addr, bind=True)
        sender = MessageSender(ctx, output_addr, bind=False)
        ready_conn.send({"status": "ready"})
    except Exception as e:
        ready_conn.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    finally:
        ready_conn.close()
    while True:
        for msg in receiver.recv():
            for out in detok.handle(msg):
                sender.send(out)
