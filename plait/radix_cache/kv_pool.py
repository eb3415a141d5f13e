"""KV memory: per-layer K/V tensors with a token-granular free-slot allocator, and the
req->token table that maps (request slot, position) to a KV slot."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading

import numpy as np
import torch

from plait.runtime.hugepages import huge_zeros

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = 4096


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled buffer. On the CPU through calloc (numpy.zeros), whose fresh pages are zero
    without being written: torch.zeros memsets them, which for SmolLM2's default 5.6 GB pool cost
    2.2 s of every start and made all of it resident for a one-request `plait generate`. Zeros
    rather than empty: kernels may read slots never written (the Triton attention kernel's
    masked blocks), and garbage there can be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if huge_pages:  # fresh zero pages too, advised for 2 MB pages (plait/runtime/hugepages.py)
        buf = huge_zeros(nbytes)
        if buf is not None:
            return buf.view(dtype).view(shape)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class Prefaulter:
    """Faults in the pages of a CPU pool's never-used slots ahead of the allocator, in a
    background thread (Linux madvise MADV_POPULATE_WRITE, which maps the pages without
    touching their contents). The buffers are calloc'ed, so a slot's first write takes a page
    fault; on the VMs measured here a fresh page cost ~1-5 us (the host backs guest memory on
    first touch too): SmolLM2's rotary + KV store, 32 decode rows a step, 3.8 ms a step with
    faults vs 0.37 ms without, and a 4,096-token prefill writes 190 MB of fresh pages. Faulted
    inside a forward, a page stalls one thread while the others wait at the parallel region's
    end. Only a window of slots is kept faulted ahead (not the whole pool: a one-request
    `plait generate` need not make a 5.6 GB pool resident)."""

    CHUNK_SLOTS = 1024

    def __init__(self, buffers: list[torch.Tensor], window_slots: int, top_slot: int) -> None:
        self.buffers = buffers
        self.row_bytes = buffers[0][0].numel() * buffers[0].element_size()
        self.window = max(1, window_slots)
        self.done_low = top_slot + 1  # slots >= done_low are faulted in (or were handed out)
        self.want_low = self.done_low
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.failed = False

    def ahead_of(self, fresh: int) -> None:
        """Slots 1..fresh were never handed out: fault in the top `window` of them."""
        target = max(1, fresh - self.window + 1)
        if self.failed or target >= self.want_low:
            return
        with self._cv:
            self.want_low = min(self.want_low, target)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="plait-kv-prefault",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def wait(self, timeout: float = 60.0) -> bool:
        """Until the wanted window is faulted in (or prefaulting failed); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self.failed or self.done_low <= self.want_low,
                                     timeout)

    def _run(self) -> None:
        try:
            os.nice(10)
        except (OSError, AttributeError):
            pass
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.want_low < self.done_low)
                high = self.done_low
                low = max(self.want_low, high - self.CHUNK_SLOTS)
            if not self._populate(low, high):
                with self._cv:
                    self.failed = True
                    self._cv.notify_all()
                return
            with self._cv:
                self.done_low = low
                self._cv.notify_all()

    def _populate(self, low: int, high: int) -> bool:
        for b in self.buffers:
            start = b.data_ptr() + low * self.row_bytes
            end = b.data_ptr() + high * self.row_bytes
            start -= start % _PAGE  # a page shared with used slots: its contents are kept
            if self._libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                logger.info("KV pool prefault off: madvise failed (%s)", os.strerror(err))
                return False
        return True


class KVPool:
    """Per-layer K/V buffers of `size` token slots. Slot 0 is reserved as a padding target
    (never handed out), so padded gathers read harmless memory."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prefault_bytes: int = 0,
        huge_pages: bool = False,
    ) -> None:
        """`prefault_bytes`: on the CPU, keep this many bytes of never-used slots (all layers)
        faulted in ahead of the allocator (Prefaulter); 0: none. `huge_pages`: on the CPU, the
        buffers on memory advised for 2 MB pages (plait/runtime/hugepages.py)."""
        if size < 2:
            raise ValueError(f"KV pool size must be >= 2 tokens, got {size}")
        self.size = size  # usable slots: 1..size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
        self.k_buffer = [_zeros(shape, dtype, self.device, huge_pages) for _ in range(num_layers)]
        self.v_buffer = [_zeros(shape, dtype, self.device, huge_pages) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64)  # CPU free list
        self._num_free = size
        # slots 1.._fresh were never handed out: _free[:_fresh] is still arange(1, _fresh + 1)
        # (alloc takes from the top, free pushes there); tracked for the prefaulter only
        self._fresh = size
        self.prefaulter: Prefaulter | None = None
        if prefault_bytes > 0 and self.device.type == "cpu" and num_layers > 0 and (
            os.uname().sysname == "Linux"
        ):
            per_token = self.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
            self.prefaulter = Prefaulter(
                self.k_buffer + self.v_buffer, prefault_bytes // per_token, size
            )
            self.prefaulter.ahead_of(self._fresh)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def free_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64, CPU), or None if fewer than n are free."""
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        if self.prefaulter is not None and start < self._fresh:
            self._fresh = start
            self.prefaulter.ahead_of(start)
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        assert self._num_free + n <= self.size, "double free in KVPool"
        self._free[self._num_free : self._num_free + n] = slots.to(torch.int64).cpu()
        self._num_free += n
        if self._num_free == self.size:
            # nothing in use (a flushed cache, or no cache and no requests): the pool is laid
            # out as new, so the next requests get ascending runs of slots again rather than
            # the order the last ones were freed in (the radix cache's eviction order). In one
            # process, an engine that ran the judge workload before each decode run, 3 rounds
            # alternated with one that did not reset: decode 12.14 s against 12.57 (medians of
            # 6 runs each, SmolLM2 on the 2-core EPYC)
            self.clear()

    def clear(self) -> None:
        # free() may empty the pool inside a forward (the scheduler runs batches under
        # inference mode): the free list is still written in place outside one afterwards
        with torch.inference_mode(False):
            self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._num_free = self.size


class ReqToTokenPool:
    """req_to_token[req_slot, pos] = KV slot of token `pos` of the request in that slot.
    One more row than max_reqs, `padding_row`, is never handed out and stays all zeros (the
    KV pool's reserved slot 0): padded batch rows (CUDA graphs) decode through it."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu") -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.padding_row = max_reqs
        self.req_to_token = torch.zeros(
            (max_reqs + 1, max_context), dtype=torch.int32, device=device
        )
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def free_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[idx, start : start + slots.numel()] = slots.to(self.req_to_token.dtype)

    def read(self, idx: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[idx, start:end].to(torch.int64)
