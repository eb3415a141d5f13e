"""What SGLang users porting programs do, right and wrong: SGLang's ProgramState idioms keep
working, and each misuse fails at the call with an error that names the argument and the
reason. Programs run on the tiny checkpoint through the in-process Engine and a real
`plait serve` (the `backend` fixture); checks that fail before any request need no backend."""

from __future__ import annotations

import plait.lang as pl


@pl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + pl.gen("answer", max_tokens=4)


def test_in_tells_whether_a_variable_is_set(backend):
    state = qa.run(question="Why?", backend=backend)
    assert state.error() is None
    assert "answer" in state  # SGLang's ProgramState.__contains__
    assert "nope" not in state
