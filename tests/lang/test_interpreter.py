"""The interpreter's semantics on a model-free backend: ordering, reads, roles, fork/join,
errors, streaming, sampling defaults, async bodies."""

from __future__ import annotations

import asyncio

import pytest

import plait.lang as pl
from plait.lang.backends.base import BackendError
from plait.lang.ir import REGEX_INT, Gen, Select
from tests.lang.fakes import FakeBackend


class CapturingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.params = []

    async def generate(self, s, params, options):
        self.params.append((params, options))
        return await super().generate(s, params, options)


@pytest.fixture
def backend():
    return FakeBackend()


def test_text_and_variables(backend):
    @pl.function
    def prog(s, q):
        s += "Q: " + q + "\nA:" + pl.gen("a", max_tokens=8)
        s += "\nmore" + pl.gen("b")

    state = prog.run(q="hi", backend=backend)
    assert state["a"] == "<8>"
    assert state.text() == "Q: hi\nA:<8>\nmore<16>"
    assert state.get_meta_info("a")["prompt_tokens"] == 8
    assert state.error() is None
    assert state.usage.requests == 2


def test_reads_wait_for_the_expression_that_sets_them():
    backend = FakeBackend(delay=0.01)

    @pl.function
    def prog(s):
        s += "x" + pl.gen("a")
        first = s["a"]  # blocks until gen "a" ran
        s += "|" + first + "|" + pl.gen("b")

    state = prog.run(backend=backend)
    assert state.text() == "x<1>|<1>|<9>"


def test_var_scope_and_set_var(backend):
    @pl.function
    def prog(s):
        s += "before "
        with s.var_scope("inside"):
            s += "in " + pl.gen("g")
        s += " after"
        s["mine"] = 42

    state = prog.run(backend=backend)
    assert state["inside"] == "in <10>"
    assert state["mine"] == 42


def test_roles_follow_the_chat_template(backend):
    @pl.function
    def prog(s):
        s += pl.system("Be brief.")
        with s.user():
            s += "Hello"
        s += pl.assistant(pl.gen("reply"))

    state = prog.run(backend=backend)
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": state["reply"]},
    ]
    expected = backend.get_chat_template().render(state.messages(), False)
    assert state.text() == expected


def test_nested_roles_fail_the_program(backend):
    @pl.function
    def prog(s):
        with s.user():
            s += pl.assistant("no")

    state = prog.run(backend=backend)
    assert isinstance(state.error(), ValueError)
    assert "do not nest" in str(state.error())


def test_fork_commits_once_then_gathers(backend):
    @pl.function
    def prog(s):
        s += "shared prefix. "
        forks = s.fork(3)
        forks += lambda i: f"branch {i}: " + pl.gen("x")
        forks.join()
        s += "done" + pl.gen("y")

    state = prog.run(backend=backend)
    assert backend.cached == ["shared prefix. "]  # one prefill before the branches
    assert len(state["x"]) == 3
    branch_prompts = [p for p in backend.prompts if "branch" in p]
    assert sorted(branch_prompts) == [f"shared prefix. branch {i}: " for i in range(3)]
    assert [m["cached_tokens"] for m in state.get_meta_info("x")] == [15, 15, 15]
    assert state.text() == "shared prefix. done<19>"


def test_fork_forms_and_concate_and_append(backend):
    @pl.function
    def prog(s):
        s += "P:"
        forks = s.fork(2)
        forks[0] += "a" + pl.gen("v")
        forks += ["-", "b"]
        forks[1] += pl.gen("v")
        forks.join(mode="concate_and_append")
        s += "|" + pl.gen("after")

    state = prog.run(backend=backend)
    assert state.text() == "P:a<3>-b<3>|<12>"
    assert "v" not in state.stream_executor.variables  # concate_and_append gathers no variables


def test_fork_inside_a_role_and_copy(backend):
    @pl.function
    def prog(s):
        s += pl.user("Q")
        with s.assistant():
            forks = s.fork(2)
            for f in forks:
                f += pl.gen("draft")
            forks.join()
            s += "final"
        with s.copy() as c:
            c += pl.gen("side")

    state = prog.run(backend=backend)
    assert state.error() is None
    assert len(state["draft"]) == 2
    assert state.messages()[-1] == {"role": "assistant", "content": "final"}
    assert state["side"] == [state["side"][0]]


def test_a_failing_request_is_on_error_and_later_reads_raise():
    backend = FakeBackend(fail_marker="BAD")

    @pl.function
    def prog(s):
        s += "ok" + pl.gen("a")
        s += "BAD" + pl.gen("b")
        s += "skipped" + pl.gen("c")

    state = prog.run(backend=backend)
    assert isinstance(state.error(), BackendError)
    assert state["a"] == "<2>"
    with pytest.raises(pl.ProgramError, match="program failed"):
        state["b"]
    assert "skipped" not in state.text()


def test_a_failing_branch_fails_the_join():
    backend = FakeBackend(fail_marker="BAD")

    @pl.function
    def prog(s):
        s += "start "
        forks = s.fork(2)
        forks += lambda i: ("BAD" if i else "fine") + pl.gen("x")
        forks.join()

    state = prog.run(backend=backend)
    assert isinstance(state.error(), pl.ProgramError)
    assert isinstance(state.error().__cause__, BackendError)


def test_body_exceptions_propagate_from_run(backend):
    @pl.function
    def prog(s):
        s += pl.gen("a")
        raise KeyError("from the body")

    with pytest.raises(KeyError, match="from the body"):
        prog.run(backend=backend)


def test_sampling_defaults_and_overrides():
    backend = CapturingBackend()

    @pl.function
    def prog(s):
        s += pl.gen("a")
        s += pl.gen("b", max_tokens=3, temperature=0.5, min_tokens=1, stop=["\n"])
        s += pl.gen_int("c")
        s += pl.gen("d", return_logprob=True, top_logprobs_num=2)

    prog.run(backend=backend, temperature=0.0, max_new_tokens=7, top_k=5)
    (a, _), (b, _), (c, _), (d, opts) = backend.params
    assert (a.temperature, a.max_new_tokens, a.top_k) == (0.0, 7, 5)
    assert (b.temperature, b.max_new_tokens, b.min_new_tokens, b.stop) == (0.5, 3, 1, ["\n"])
    assert c.regex == REGEX_INT
    assert opts.return_logprob and opts.top_logprobs_num == 2
    with pytest.raises(ValueError, match="temperature"):
        prog.run(backend=backend, temperature=-1.0)


def test_gen_checks_its_arguments():
    with pytest.raises(ValueError, match="dtype and regex"):
        pl.gen("x", dtype=int, regex="[0-9]+")
    with pytest.raises(ValueError, match="dtype"):
        pl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="regex"):
        pl.gen("x", regex="(")
    assert isinstance(pl.gen("x", choices=["a", "b"]), Select)
    assert isinstance(pl.gen_string("x"), Gen)


def test_json_schema_accepts_pydantic_classes():
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    expr = pl.gen("p", json_schema=Person)
    assert '"age"' in expr.sampling["json_schema"]


def test_n_samples_fill_a_list(backend):
    @pl.function
    def prog(s):
        s += "x" + pl.gen("a", n=3)

    state = prog.run(backend=backend)
    assert state["a"] == ["<1>0", "<1>1", "<1>2"]
    assert state.text() == "x<1>0"


def test_select_records_the_decision_and_scores(backend):
    @pl.function
    def prog(s):
        s += "pick: " + pl.select("c", ["long one", "short"])

    state = prog.run(backend=backend)
    assert state["c"] == "short"
    assert state.get_meta_info("c")["scores"] == [-8.0, -5.0]
    assert state.text() == "pick: short"


def test_streaming_pieces_add_up_to_the_final_text(backend):
    @pl.function
    def prog(s):
        s += "a" + pl.gen("x")
        s += "b" + pl.gen("y")

    state = prog.run(stream=True, backend=backend)
    pieces = list(state.text_iter())
    assert len(pieces) > 2
    assert "".join(pieces) == state.text() == "a<1>b<5>"
    state = prog.run(stream=True, backend=backend)
    assert "".join(state.text_iter("y")) == state["y"] == "<5>"


async def test_async_bodies_read_with_aget(backend):
    @pl.function
    async def prog(s, q):
        s += q + pl.gen("a")
        a = await s.aget("a")
        s += "|" + a

    state = await prog.arun(q="hey", backend=backend)
    assert await state.atext() == "hey<3>|<3>"
    assert prog.run(q="hey", backend=backend).text() == "hey<3>|<3>"


async def test_blocking_reads_in_async_bodies_raise_a_clear_error(backend):
    @pl.function
    async def prog(s):
        s += pl.gen("a")
        s["a"]

    with pytest.raises(RuntimeError, match="await s.aget"):
        await prog.arun(backend=backend)


async def test_streaming_from_async_code(backend):
    @pl.function
    async def prog(s):
        s += "a" + pl.gen("x")

    state = await prog.arun(stream=True, backend=backend)
    pieces = [p async for p in state.text_async_iter()]
    assert "".join(pieces) == await state.atext()
    state = prog.run(stream=True, backend=backend)  # a program on the background loop
    assert "".join([p async for p in state.text_async_iter("x")]) == "<1>"


async def test_sync_entry_points_refuse_to_block_the_interpreter_loop(backend):
    @pl.function
    def inner(s):
        s += pl.gen("a")

    @pl.function
    async def outer(s):
        inner.run(backend=backend)

    with pytest.raises(RuntimeError, match="await arun"):
        outer.run(backend=backend)


def test_bind_and_positional_batch_items(backend):
    @pl.function
    def prog(s, a, b):
        s += a + b

    states = prog.bind(b="!").run_batch([["x"], ["y"]], backend=backend)
    assert [st.text() for st in states] == ["x!", "y!"]
    with pytest.raises(TypeError, match="no parameter"):
        prog.bind(c=1)


def test_default_backend_and_missing_backend(backend):
    @pl.function
    def prog(s):
        s += pl.gen("a")

    pl.set_default_backend(None)
    with pytest.raises(ValueError, match="set_default_backend"):
        prog.run()
    pl.set_default_backend(backend)
    try:
        assert prog.run().text() == "<0>"
    finally:
        pl.set_default_backend(None)


def test_programs_run_concurrently_on_one_loop():
    backend = FakeBackend(delay=0.05)

    @pl.function
    async def prog(s, i):
        s += str(i) + pl.gen("a")

    async def main():
        return await asyncio.gather(*(prog.arun(i=i, backend=backend) for i in range(20)))

    states = asyncio.run(main())
    assert backend.max_in_flight == 20
    assert [st.text() for st in states] == [f"{i}<{len(str(i))}>" for i in range(20)]
