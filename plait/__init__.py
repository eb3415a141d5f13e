"""plait: a runtime for LLM programs.

    import plait as pl

    @pl.function
    def qa(s, question):
        s += pl.user(question) + pl.assistant(pl.gen("answer", max_tokens=32))

    pl.set_default_backend(pl.EngineBackend())   # the default model (SmolLM2), in-process
    print(qa.run(question="Why is the sky blue?")["answer"])

The language (`plait.lang`: function, gen, select, roles, the backends, ...) and the serving
classes (`Engine`, `Runtime`) load on first use, so `import plait` stays light.
"""

from __future__ import annotations

from plait.args import ServerArgs
from plait.sampling import SamplingParams

__version__ = "0.1.0"

# Engine, SamplingParams, ServerArgs and plait.lang.__all__ (re-exported lazily;
# tests/lang/test_reexports.py keeps the lists equal). `Runtime` is plait.lang's (SGLang's
# `sgl.Runtime`): it starts a `plait serve` process (context manager, `.url`) and is also a
# backend for programs; the bare server process is plait.launch.ServerProcess.
__all__ = [
    "Backend",
    "BackendError",
    "BatchResult",
    "BatchSummary",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Engine",
    "EngineBackend",
    "Function",
    "OpenAI",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "SamplingParams",
    "ServerArgs",
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
_LANG_NAMES = frozenset(__all__) - {"Engine", "SamplingParams", "ServerArgs"}


def __getattr__(name: str):
    # heavy modules load on first use so `import plait` stays fast
    if name == "Engine":
        from plait.engine import Engine

        return Engine
    if name in _LANG_NAMES:
        import plait.lang

        return getattr(plait.lang, name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
