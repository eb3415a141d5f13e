"""The grammar compiler child process: `python -m plait.grammar.compiler_process`.

A fresh interpreter (not multiprocessing, whose spawn/forkserver modes re-import the parent's
__main__ script) that builds one backend and compiles jobs from its stdin, answering on its
stdout. Frames are a 4-byte big-endian length and a payload:

    parent -> child   first: pickle of BackendSpec (our own process: the tokenizer object)
                      then:  JSON {"kind": ..., "spec": ...}; an empty frame means "exit"
    child -> parent   JSON {"ready": true} | {"ok": true} followed by one frame with the
                      serialized grammar | {"error": message, "param": param}
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
from typing import BinaryIO

_LENGTH = struct.Struct(">I")


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame, or None at end of stream."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def write_json(stream: BinaryIO, message: dict) -> None:
    write_frame(stream, json.dumps(message).encode("utf-8"))


def main() -> int:
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt the frames
    from plait.grammar.base import GrammarError, create_grammar_backend

    try:
        spec = pickle.loads(read_frame(requests) or b"")
        backend = create_grammar_backend(
            spec.name, spec.tokenizer, spec.vocab_size, spec.eos_token_ids, **spec.options
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails its jobs
        write_json(replies, {"error": f"{type(e).__name__}: {e}", "param": None})
        return 1
    write_json(replies, {"ready": True})
    while True:
        frame = read_frame(requests)
        if not frame:
            return 0
        job = json.loads(frame)
        try:
            data = backend.serialize(backend.compile(job["kind"], job["spec"]))
        except GrammarError as e:
            write_json(replies, {"error": str(e), "param": e.param})
            continue
        except Exception as e:  # noqa: BLE001 - an engine bug fails one request
            write_json(replies, {"error": f"{job['kind']}: internal error ({e})",
                                 "param": job["kind"]})
            continue
        write_json(replies, {"ok": True})
        write_frame(replies, data or b"")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
