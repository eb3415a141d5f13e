"""Shared fixtures: tiny checkpoints (built once, cached) and the slow/gpu/model markers.

`python -m pytest -m "not model"` is the fast inner loop: the tests that start no model and no
server. A test is marked `model` by hand (`pytest.mark.model`) when its body starts one, and
here, automatically, when it asks for a fixture that does (MODEL_FIXTURES), so a new test on
those fixtures cannot slip into the fast loop. `heavy` tests (no model, but kernel or grammar
compiles at scale: minutes in all) are left out of the fast loop too: they are marked `model`
here as well.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests")


# fixtures that start a model (an Engine, a Scheduler) or a `plait serve` process
MODEL_FIXTURES = frozenset({
    "engine", "engine_backend", "server", "http", "endpoint_backend", "openai_backend",
    "backend", "make_scheduler",
})


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: a faster test covers it; use --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if _uses_model_fixture(item) or "heavy" in item.keywords:
            item.add_marker(pytest.mark.model)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not _cuda_available():
            item.add_marker(skip_gpu)


def _uses_model_fixture(item) -> bool:
    """A fixture of MODEL_FIXTURES, not a parametrized argument that shares its name
    (`@pytest.mark.parametrize("engine", ...)` is a pseudo-fixture pytest makes up)."""
    defs = getattr(item, "_fixtureinfo", None)
    defs = defs.name2fixturedefs if defs is not None else {}
    return any(
        defs.get(name) and defs[name][-1].func.__name__ == name
        for name in MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    )


def _cuda_available() -> bool:
    import torch  # only when a gpu test was collected: torch takes seconds to import

    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def checkpoint():
    """checkpoint(name) -> path of a tiny test checkpoint (built on first use)."""
    from plait.models.embedded import ensure_checkpoint

    return lambda name="tiny-llama": str(ensure_checkpoint(name))


@pytest.fixture(scope="session")
def tiny_llama(checkpoint):
    return checkpoint("tiny-llama")


@pytest.fixture(scope="session")
def fused_ops():
    """plait's fused CPU operators (fused_cpu.cpp), built or loaded once; skipped without AVX2."""
    import torch

    from plait.kernels import fused_ops as fo

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the fused operators need AVX2")
    assert fo.start_fused_ops(block=True), "fused_cpu.cpp failed to build"
    return fo.fused_ops()
