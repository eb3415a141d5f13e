"""SGLang's own frontend (sglang.RuntimeEndpoint + an @function program) driving a plait server.

`pip install sglang` pulls CUDA wheels, so this runs only where `sglang.lang` imports; the
request shapes it sends are covered by test_native.py everywhere. To run it on CPU, unpack the
sglang wheel's `sglang/lang`, `sglang/utils.py`, `sglang/srt/environ.py` next to an empty
`sglang/__init__.py`, install aiohttp, msgspec, ipython and pybase64, and put that directory on
PYTHONPATH.
"""

from __future__ import annotations

import pytest

runtime_endpoint = pytest.importorskip("sglang.lang.backend.runtime_endpoint")
sgl = pytest.importorskip("sglang.lang.api")


@pytest.fixture(scope="module")
def backend(server):
    return runtime_endpoint.RuntimeEndpoint(server.url)


def test_gen_select_fork_and_batch(backend, http):
    @sgl.function
    def program(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=6, temperature=0, stop="\n")
        s += "\nGrade:" + sgl.select("grade", ["good", "bad", "unsure"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Reason {i}:" + sgl.gen("reason", max_tokens=3, temperature=0)
        forks.join()

    state = program.run(question="What is 2+2?", backend=backend)
    assert state.error() is None
    assert state["grade"] in ("good", "bad", "unsure")
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 0
    # the generated answer is what /generate returns for the same prompt
    prompt = "Question: What is 2+2?\nAnswer:"
    expected = http.post(
        "/generate",
        json={
            "text": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop": "\n"},
        },
    ).json()["text"]
    assert state["answer"] == expected
    states = program.run_batch([{"question": q} for q in ("a", "b", "c")], backend=backend)
    assert all(s["grade"] in ("good", "bad", "unsure") for s in states)


def test_streaming(backend):
    @sgl.function
    def story(s):
        s += "Once upon a time"
        s += sgl.gen("rest", max_tokens=8, temperature=0)

    full = story.run(backend=backend)["rest"]
    state = story.run(backend=backend, stream=True)
    assert "".join(state.text_iter("rest")) == full


def test_cache_prefix_and_flush(backend, http):
    backend.cache_prefix("A prefix that SGLang's frontend commits before a fork.")
    backend.flush_cache()
