"""Start and stop the runtime's child processes (scheduler, detokenizer)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from plait.args import ServerArgs
from plait.models.resolve import resolve_model_path

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


@dataclass
class IpcAddrs:
    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def in_dir(cls, path: str) -> IpcAddrs:
        return cls(f"ipc://{path}/scheduler", f"ipc://{path}/detokenizer", f"ipc://{path}/tokenizer")


@dataclass
class RuntimeProcesses:
    args: ServerArgs
    model_path: str
    addrs: IpcAddrs
    ipc_dir: str
    procs: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    owns_ipc_dir: bool = True

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self.owns_ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class ChildProcess:
    """A child started with subprocess, with the few Process-like methods the runtime uses."""

    def __init__(self, name: str, role: str, config: dict[str, Any]) -> None:
        self.name = name
        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, "-m", "plait.frontend.child", role, json.dumps(config), str(write_fd)]
        # bounded OpenMP spinning in the children: plait/runtime/cpu_tuning.py says why
        from plait.runtime.cpu_tuning import child_env

        self.popen = subprocess.Popen(cmd, pass_fds=(write_fd,), start_new_session=False,
                                      env=child_env())
        os.close(write_fd)
        self.ready_fd = read_fd

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the child reports; raises with the child's error otherwise."""
        chunks, deadline = [], time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the {self.name} process did not start within {timeout:.0f} s")
                ready, _, _ = select.select([self.ready_fd], [], [], min(left, 1.0))
                if not ready:
                    if not self.is_alive():
                        raise RuntimeError(
                            f"the {self.name} process exited during start-up (code {self.exitcode})"
                        )
                    continue
                data = os.read(self.ready_fd, 1 << 20)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(self.ready_fd)
        if not chunks:
            raise RuntimeError(f"the {self.name} process exited during start-up (code {self.exitcode})")
        info = json.loads(b"".join(chunks))
        if info.get("status") != "ready":
            logger.error("%s start-up failed:\n%s", self.name, info.get("traceback", ""))
            raise ValueError(f"{self.name} failed to start: {info.get('error')}")
        return info


def launch_runtime(args: ServerArgs) -> RuntimeProcesses:
    """Start detokenizer and scheduler; returns once both are ready (or raises)."""
    model_path = resolve_model_path(args.resolved_model_path)
    ipc_dir = args.ipc_dir or tempfile.mkdtemp(prefix="plait-ipc-")
    rt = RuntimeProcesses(args, model_path, IpcAddrs.in_dir(ipc_dir), ipc_dir,
                          owns_ipc_dir=args.ipc_dir is None)
    try:
        rt.procs["detokenizer"] = ChildProcess("detokenizer", "detokenizer", {
            "tokenizer_path": args.tokenizer_path or model_path,
            "input": rt.addrs.detokenizer_input, "output": rt.addrs.tokenizer_input,
        })
        rt.procs["scheduler"] = ChildProcess("scheduler", "scheduler", {
            "args": dataclasses.asdict(args), "model_path": model_path,
            "input": rt.addrs.scheduler_input, "output": rt.addrs.detokenizer_input,
        })
        rt.procs["detokenizer"].wait_ready(STARTUP_TIMEOUT_S)
        rt.model_info = rt.procs["scheduler"].wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        rt.shutdown()
        raise
    return rt


def launch_with_tokenizer(args: ServerArgs) -> tuple[RuntimeProcesses, Any]:
    """launch_runtime, with the frontend's tokenizer loading in a thread meanwhile: start-up
    takes the longer of the two instead of their sum."""
    from concurrent.futures import ThreadPoolExecutor

    model_path = resolve_model_path(args.resolved_model_path)
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(_load_tokenizer, args.tokenizer_path or model_path)
        runtime = launch_runtime(args.replace(model_path=model_path))
        try:
            return runtime, tokenizer.result()
        except BaseException:
            runtime.shutdown()
            raise


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
