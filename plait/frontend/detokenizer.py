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

from plait.messages import BatchStrOut, BatchTokenOut, MessageReceiver, MessageSender

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

    def handle(self, msg: Any) -> Any:
        if not isinstance(msg, BatchTokenOut):
            return msg
        deltas = []
        for i, rid in enumerate(msg.rids):
            deltas.append(self._step(rid, msg, i))
        return BatchStrOut(
            rids=msg.rids, text_deltas=deltas, new_token_ids=msg.new_token_ids,
            finished_reasons=msg.finished_reasons, prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens, cached_tokens=msg.cached_tokens,
            output_token_logprobs=msg.output_token_logprobs,
            output_top_logprobs=msg.output_top_logprobs,
            input_token_logprobs=msg.input_token_logprobs,
            input_top_logprobs=msg.input_top_logprobs, extra_meta=msg.extra_meta,
        )

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
                cut = text.find(matched)
                if cut >= 0:
                    text = text[:cut]
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
    from transformers import AutoTokenizer

    try:
        detok = Detokenizer(AutoTokenizer.from_pretrained(tokenizer_path))
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
        sender.send(detok.handle(receiver.recv()))
