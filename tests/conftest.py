"""Shared fixtures: tiny checkpoints (built once, cached) and the slow/gpu markers."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests")


def pytest_collection_modifyitems(config, items):
    import torch

    skip_slow = pytest.mark.skip(reason="slow: a faster test covers it; use --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def checkpoint():
    """checkpoint(name) -> path of a tiny test checkpoint (built on first use)."""
    from plait.models.embedded import ensure_checkpoint

    return lambda name="tiny-llama": str(ensure_checkpoint(name))


@pytest.fixture(scope="session")
def tiny_llama(checkpoint):
    return checkpoint("tiny-llama")
