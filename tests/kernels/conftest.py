"""Without CUDA, the Triton kernels run under Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a `@triton.jit` function is defined, so it must be set before
plait.kernels.triton_ops is first imported; this conftest is imported before the test modules
of this folder. With CUDA the kernels are compiled and the GPU tests run on the device.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
