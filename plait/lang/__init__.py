"""plait's language: `@function` programs of gen, select, roles and fork/join (SGLang's names).

    import plait as pl

    @pl.function
    def judge(s, answer):
        s += pl.system("You grade answers.")
        s += pl.user("Answer: " + answer)
        s += pl.assistant(pl.select("grade", ["good", "bad"]))

    pl.set_default_backend(pl.EngineBackend())          # or pl.RuntimeEndpoint(url), ...
    state = judge.run(answer="42")
    state["grade"], state.get_meta_info("grade")["scores"], state.text(), state.messages()
    states = judge.run_batch([{"answer": a} for a in answers], progress_bar=True)
    states.summary.cached_token_fraction

Async: `await judge.arun(...)`, `await judge.arun_batch(...)`, and `async def` bodies, which
read variables with `await s.aget("x")` (a blocking `s["x"]` is for sync bodies).
"""

from __future__ import annotations

from plait.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from plait.lang.backends import (
    Backend,
    BackendError,
    EngineBackend,
    OpenAI,
    Runtime,
    RuntimeEndpoint,
    UnsupportedFeature,
    Usage,
)
from plait.lang.backends.default import get_default_backend, set_default_backend
from plait.lang.chat_template import ChatTemplate
from plait.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from plait.lang.executor import ProgramError
from plait.lang.program import Function
from plait.lang.runner import BatchResult, BatchSummary
from plait.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend",
    "BackendError",
    "BatchResult",
    "BatchSummary",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "EngineBackend",
    "Function",
    "OpenAI",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "UnsupportedFeature",
    "Usage",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
