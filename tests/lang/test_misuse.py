"""What SGLang users porting programs do, right and wrong: SGLang's ProgramState idioms keep
working, and each misuse fails at the call with an error that names the argument and the
reason. Programs run on the tiny checkpoint through the in-process Engine and a real
`plait serve` (the `backend` fixture); checks that fail before any request need no backend."""

from __future__ import annotations

import re

import pytest

import plait.lang as pl


@pl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + pl.gen("answer", max_tokens=4)


def test_in_tells_whether_a_variable_is_set(backend):
    state = qa.run(question="Why?", backend=backend)
    assert state.error() is None
    assert "answer" in state  # SGLang's ProgramState.__contains__
    assert "nope" not in state


HEADER = "A shared instruction, long enough for run_batch to prefill it once for the batch.\n"


@pl.function
def chat(s, history, question):
    history.append("user: " + question)  # a body that updates its arguments, as chat loops do
    s += HEADER + "".join(line + "\n" for line in history) + "assistant:"
    s += pl.gen("reply", max_tokens=3)


def test_run_batch_runs_each_body_once_on_its_arguments(engine_backend):
    histories = [[], []]
    states = chat.run_batch(
        [{"history": h, "question": f"q{i}"} for i, h in enumerate(histories)],
        backend=engine_backend,
    )
    assert all(st.error() is None for st in states)
    # run() would append once; planning the batch's shared prefix must not append again
    assert histories == [["user: q0"], ["user: q1"]]
    for i, st in enumerate(states):
        assert st.text().startswith(HEADER + f"user: q{i}\nassistant:")
    assert states.summary.common_prefix_chars > 0  # the prefix was still planned


def test_select_checks_its_arguments_at_the_call():
    # a string is not a list of choices (list("yes") would be ["y", "e", "s"])
    with pytest.raises(TypeError, match="choices: must be a list of strings, got a str"):
        pl.select("c", "yes")
    with pytest.raises(TypeError, match="choices_method: must be a ChoicesSamplingMethod"):
        pl.select("c", ["a", "b"], choices_method="greedy")
    with pytest.raises(TypeError, match="choices_method"):
        pl.gen("c", choices=["a", "b"], choices_method=pl.greedy_token_selection.__class__)
    with pytest.raises(TypeError, match="temperature: must be a number, got '0'"):
        pl.select("c", ["a", "b"], temperature="0")
    with pytest.raises(ValueError, match="choices: must be a non-empty list"):
        pl.select("c", [])
    assert pl.select("c", ("a", "b")).choices == ["a", "b"]  # a tuple is a list of choices


@pl.function
def join_twice(s, mode):
    s += "Shared:"
    forks = s.fork(2)
    forks += lambda i: f" b{i}" + pl.gen("y", max_tokens=2)
    forks.join(mode)
    forks.join(mode)


@pl.function
def write_after_join(s):
    s += "Shared:"
    forks = s.fork(2)
    forks += pl.gen("y", max_tokens=2)
    forks.join()
    forks[0] += pl.gen("lost", max_tokens=2)  # nothing would ever read it back


def test_a_fork_joins_once_and_takes_no_writes_after(engine_backend):
    # concate_and_append twice appended every branch's text twice; gather_variable did nothing
    for mode in ("gather_variable", "concate_and_append"):
        with pytest.raises(ValueError, match="join: this fork was already joined"):
            join_twice.run(mode=mode, backend=engine_backend)
    with pytest.raises(ValueError, match="fork: branch 0 was joined"):
        write_after_join.run(backend=engine_backend)


@pl.function
def join_then_read(s):
    s += "Shared:"
    forks = s.fork(2)
    forks += pl.gen("y", max_tokens=2)
    forks.join()
    s += "|" + forks[1]["y"]  # reading a branch after the join is fine (SGLang programs do)


def test_branches_are_readable_after_the_join(engine_backend):
    state = join_then_read.run(backend=engine_backend)
    assert state.error() is None
    assert state.text().endswith("|" + state["y"][1])


def test_streaming_a_gathered_variable_says_it_is_a_list(engine_backend):
    # it yielded nothing: a list is not text
    state = join_then_read.run(stream=True, backend=engine_backend)
    with pytest.raises(ValueError, match=r"text_iter\('y'\): the variable holds a list"):
        list(state.text_iter("y"))
    assert len(state["y"]) == 2


@pl.function
def fork_n(s, n):
    s += "Shared:"
    forks = s.fork(n)
    forks.join()


def test_fork_takes_a_positive_integer(engine_backend):
    with pytest.raises(ValueError, match="fork: number must be >= 1, got 0"):
        fork_n.run(n=0, backend=engine_backend)
    for bad in (2.7, "2", None):  # 2.7 forked 2 branches, "2" forked 2, None: int()'s error
        with pytest.raises(TypeError, match=f"fork: number must be an integer, got {bad!r}"):
            fork_n.run(n=bad, backend=engine_backend)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"max_tokens": "5"}, "max_tokens: must be an integer, got '5'"),
        ({"max_tokens": -1}, "max_tokens: must be in"),
        ({"temperature": "hot"}, "temperature: must be a number"),
        ({"stop": 5}, "stop: must be a string or a list of strings"),
        ({"top_p": 0}, "top_p: must be in"),
        ({"n": 0}, "n: must be in"),
        ({"max_tokens": 3, "min_tokens": 5}, "min_tokens: must not exceed the maximum"),
        ({"logit_bias": {"abc": 1}}, "logit_bias: keys must be token ids"),
        ({"regex": "[0-9]", "json_schema": {"type": "integer"}}, "json_schema: only one"),
        ({"dtype": int, "json_object": True}, "json_object: only one constraint"),
    ],
)
def test_gen_checks_its_arguments_at_the_call(kwargs, reason):
    # these failed only when the program ran: run() returned a state whose error() was set
    with pytest.raises(ValueError, match=re.escape(f"gen('x'): {reason}")):
        pl.gen("x", **kwargs)


def test_gen_leaves_to_the_call_what_its_defaults_complete():
    assert pl.gen("x", min_tokens=200).sampling == {"min_new_tokens": 200}  # run(max_tokens=300)
    with pytest.raises(TypeError, match="gen: name must be a string or None, got 5"):
        pl.gen(5)


def test_images_and_videos_say_they_are_unsupported():
    # SGLang programs use sgl.image / sgl.video inside roles; plait serves text-only models
    import plait

    for make, args in ((plait.image, ("cat.png",)), (pl.video, ("clip.mp4", 8))):
        with pytest.raises(pl.UnsupportedFeature, match="not supported.*text-only"):
            make(*args)


@pl.function
def ask(s, question):
    s += "Q: " + question + "\nA:" + pl.gen("answer", max_tokens=3, stop="\n")
    return "asked " + question


@pl.function
def two_questions(s):
    s += "Answer briefly.\n"
    first = ask(s, "Why?")  # a @function called on a state runs its body on that state
    s += "\n"
    ask(s, question="How?")
    return first


def test_a_function_called_on_a_state_runs_in_it(backend):
    # this was ask.run(s, "Why?"): "ask() takes 2 positional arguments but 3 were given"
    state = two_questions.run(backend=backend)
    assert state.error() is None
    assert state.ret_value == "asked Why?"
    assert state.text().startswith("Answer briefly.\nQ: Why?\nA:")
    assert "\nQ: How?\nA:" + state["answer"] in state.text()


@pl.function
def two_rounds(s, read):
    s += "Ideas:"
    for _ in range(2):
        forks = s.fork(2)
        forks += pl.gen("idea", max_tokens=2)
        forks.join()  # round 2: "idea" is already the parent's, so SGLang's rule keeps round 1's
        if read == "branches":
            [f["idea"] for f in forks]
    if read == "parent":
        s["idea"]


def test_reading_a_variable_a_join_did_not_gather_warns(engine_backend, caplog):
    state = two_rounds.run(read="branches", backend=engine_backend)
    assert state.error() is None
    assert not [r for r in caplog.records if "did not gather" in r.getMessage()]
    # the body's own read warns (once), and so does the caller's first read of the other state
    for state in (two_rounds.run(read="parent", backend=engine_backend), state):
        assert len(state["idea"]) == 2  # SGLang's semantics, kept: the first round's list
    warnings = [r.getMessage() for r in caplog.records if "did not gather" in r.getMessage()]
    assert len(warnings) == 2 and warnings[0].startswith("variable 'idea'"), warnings
