"""Fixtures of the runtime tests: a real Scheduler on the tiny checkpoint, driven in-process."""

from __future__ import annotations

import pytest

from plait.args import ServerArgs
from plait.runtime.scheduler import Scheduler
from plait.models.tokenizer import load_tokenizer
from plait.runtime.scheduler_process import InProcessIO


@pytest.fixture(scope="module")
def make_scheduler(tiny_llama):
    """make_scheduler(**server_args) -> (Scheduler, InProcessIO)."""
    tokenizer = load_tokenizer(tiny_llama)

    def make(**kwargs):
        io = InProcessIO()
        args = ServerArgs(model_path=tiny_llama, **kwargs)
        return Scheduler(args, tiny_llama, io, tokenizer), io

    return make
