"""Model-free tests of the detokenizer: stop-string hold-back while streaming (the streamed
pieces always add up to the final trimmed text), trimming at the occurrence that stopped the
request (not an earlier one, output before min_new_tokens), and per-request isolation."""

from __future__ import annotations

from plait.messages import BatchStrOut, BatchTokenOut, RequestErrorOut
from plait.tokenizer.detokenizer import Detokenizer, _holdback
from tests.runtime.units import CharTokenizer, ids


def token_out(rid: str, text: str, finished: dict | None, stops: list[str]) -> BatchTokenOut:
    return BatchTokenOut(
        rids=[rid], new_token_ids=[ids(text)], finished_reasons=[finished], prompt_tokens=[1],
        completion_tokens=[0], cached_tokens=[0], skip_special_tokens=[True],
        no_stop_trim=[False], output_token_logprobs=[[]], output_top_logprobs=[[]],
        input_token_logprobs=[None], input_top_logprobs=[None], extra_meta=[{}],
        stop_strs=[stops],
    )


def stream(pieces: list[str], stops: list[str], matched: str | None) -> list[str]:
    detok = Detokenizer(CharTokenizer())
    deltas = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        finished = ({"type": "stop", "matched": matched} if matched else {"type": "length"}) if last else None
        [out] = detok.handle(token_out("r", piece, finished, stops))
        deltas.append(out.text_deltas[0])
    assert not detok.states  # finished requests leave nothing behind
    return deltas


def test_holdback_keeps_a_possible_stop_prefix():
    assert _holdback("hello EN", ["END"]) == 2
    assert _holdback("hello E", ["END", "Eh"]) == 1
    assert _holdback("hello", ["END"]) == 0
    assert _holdback("a END b", ["END"]) == 5  # already contains it: hold from there


def test_streamed_text_adds_up_to_the_trimmed_text():
    deltas = stream(["Hel", "lo E", "N", "D"], ["END"], "END")
    assert "".join(deltas) == "Hello "
    assert deltas[1] == "lo "  # "E" held back: it may start "END"


def test_a_held_prefix_that_is_not_a_stop_is_released():
    deltas = stream(["ab E", "x", "yz"], ["END"], None)
    assert deltas[0] == "ab " and deltas[1] == "Ex" and "".join(deltas) == "ab Exyz"


def test_trim_at_the_occurrence_that_stopped_not_an_earlier_one():
    # "END" at the start came before min_new_tokens (output); the request stopped on the
    # second one, which ends in the last token
    deltas = stream(["END", " middle ", "E", "N", "D"], ["END"], "END")
    assert "".join(deltas) == "END middle "


def test_error_drops_the_request_state_and_passes_through():
    detok = Detokenizer(CharTokenizer())
    detok.handle(token_out("r", "abc", None, []))
    assert "r" in detok.states
    err = RequestErrorOut("r", "constraint allows no continuation", 400, "regex")
    assert detok.handle(err) == [err] and "r" not in detok.states


def test_a_failing_request_does_not_take_the_batch_down():
    class Picky(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            if 0x10FFFF + 1 in ids:
                raise ValueError("unknown token")
            return super().decode(ids, skip_special_tokens)

    detok = Detokenizer(Picky())
    msg = token_out("good", "ok", {"type": "length"}, [])
    msg.rids.append("bad")
    msg.new_token_ids.append([0x10FFFF + 1])
    for name in ("finished_reasons", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "skip_special_tokens", "no_stop_trim", "output_token_logprobs",
                 "output_top_logprobs", "input_token_logprobs", "input_top_logprobs",
                 "extra_meta", "stop_strs"):
        getattr(msg, name).append(getattr(msg, name)[0])
    outs = detok.handle(msg)
    errors = [o for o in outs if isinstance(o, RequestErrorOut)]
    texts = [o for o in outs if isinstance(o, BatchStrOut)]
    assert [e.rid for e in errors] == ["bad"] and errors[0].status == 500
    assert texts[0].rids == ["good"] and texts[0].text_deltas == ["ok"]
    assert not detok.states
