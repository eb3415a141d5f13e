"""Start, watch and stop the runtime's child processes (scheduler, detokenizer).

A child that dies is not restarted: its requests' state (KV cache, running requests) is gone
with it, and a clean restart of the whole server is both simpler and safer. `plait serve`
exits non-zero within CHILD_DEATH_EXIT_S of the death (so that a supervisor restarts it);
`plait.Engine` fails the requests in flight and every later call with the reason.
Children get their configuration on stdin, never in argv (`ps` shows argv to every user).
"""

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plait.args import ServerArgs
from plait.models.resolve import resolve_model_path
from plait.models.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
# how often the supervisor thread polls the children
CHILD_POLL_S = 0.2
# after a child died, the server is stopped gracefully; past this many seconds it is killed
CHILD_DEATH_EXIT_S = 4.0
CHILD_DIED_EXIT_CODE = 1


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
    failure: str | None = None  # why a child died, once one did
    _stopping: bool = False

    def supervise(self, on_death: Callable[[str], None], hard_exit_s: float | None = None) -> None:
        """Watch the children from a daemon thread: the first one that exits (outside
        shutdown) sets `failure` and calls on_death(reason) once. With hard_exit_s, the
        process exits with CHILD_DIED_EXIT_CODE if it is still running that long after."""

        def watch() -> None:
            while not self._stopping:
                dead = [(n, p) for n, p in self.procs.items() if not p.is_alive()]
                if dead and not self._stopping:
                    name, proc = dead[0]
                    self.failure = f"the {name} process died (exit code {proc.exitcode})"
                    logger.error("%s; stopping the server", self.failure)
                    on_death(self.failure)
                    if hard_exit_s is not None:
                        time.sleep(hard_exit_s)
                        logger.error("server did not stop in %.0f s after %s; exiting",
                                     hard_exit_s, self.failure)
                        self.shutdown()
                        os._exit(CHILD_DIED_EXIT_CODE)
                    return
                time.sleep(CHILD_POLL_S)

        threading.Thread(target=watch, name="child-supervisor", daemon=True).start()

    def exit_if_failed(self) -> None:
        """If a child died: stop the other children and exit the process now with
        CHILD_DIED_EXIT_CODE (skipping interpreter finalization, which takes seconds with
        the tokenizer loaded), so that a supervisor restarts the server promptly."""
        if self.failure is None:
            return
        self.shutdown()
        print(f"plait serve: {self.failure}; exiting with status {CHILD_DIED_EXIT_CODE} so that "
              "a supervisor restarts the server", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(CHILD_DIED_EXIT_CODE)

    def shutdown(self) -> None:
        self._stopping = True
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
        cmd = [sys.executable, "-m", "plait.frontend.child", role, str(write_fd)]
        # bounded OpenMP spinning in the children: plait/runtime/cpu_tuning.py says why
        from plait.runtime.cpu_tuning import child_env

        self.popen = subprocess.Popen(
            cmd, pass_fds=(write_fd,), start_new_session=False, stdin=subprocess.PIPE,
            env=child_env(),
        )
        os.close(write_fd)
        self.ready_fd = read_fd
        # the configuration goes through stdin: argv is world-readable (/proc/PID/cmdline)
        try:
            self.popen.stdin.write(json.dumps(config).encode())
            self.popen.stdin.close()
        except BrokenPipeError:  # the child died at once; wait_ready reports it
            pass

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
        tp_init = _tp_rendezvous(args, model_path, ipc_dir)
        rt.procs["scheduler"] = ChildProcess("scheduler", "scheduler", {
            # the scheduler never checks the API key: it does not get it at all
            "args": dataclasses.asdict(args.replace(api_key=None)), "model_path": model_path,
            "input": rt.addrs.scheduler_input, "output": rt.addrs.detokenizer_input,
            "tp_init": tp_init,
        })
        for rank in range(1, args.tp_size):  # tensor-parallel ranks > 0: forwards only
            rt.procs[f"tp{rank}"] = ChildProcess(f"tp{rank}", "tp_worker", {
                "args": dataclasses.asdict(args.replace(api_key=None)), "model_path": model_path,
                "rank": rank,
                "tp_init": tp_init,
            })
        rt.procs["detokenizer"].wait_ready(STARTUP_TIMEOUT_S)
        ranks = [rt.procs["scheduler"]] + [rt.procs[f"tp{r}"] for r in range(1, args.tp_size)]
        rt.model_info = _wait_all_ready(ranks, STARTUP_TIMEOUT_S)[0]
    except BaseException:
        rt.shutdown()
        raise
    return rt


def _tp_rendezvous(args: ServerArgs, model_path: str, ipc_dir: str) -> str | None:
    """The tensor-parallel group's rendezvous (a file store in the private ipc dir), after
    checking the model splits over args.tp_size ranks (a ValueError naming what does not)."""
    if args.tp_size == 1:
        return None
    from plait.models.config import ModelConfig
    from plait.runtime.parallel import check_tp_divisible

    check_tp_divisible(ModelConfig.from_dir(model_path), args.tp_size)
    store = os.path.join(ipc_dir, "tp_store")
    if os.path.exists(store):  # left by an earlier run in a user-given ipc dir
        os.remove(store)
    return f"file://{store}"


def _wait_all_ready(children: list[ChildProcess], timeout: float) -> list[dict[str, Any]]:
    """Wait for processes that start together (the TP ranks meet in collectives): the first
    failure is raised at once instead of after the others' collectives time out."""
    if len(children) == 1:
        return [children[0].wait_ready(timeout)]
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(len(children))
    try:
        futures = [pool.submit(c.wait_ready, timeout) for c in children]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
    finally:
        # after a failure the caller's shutdown() ends the others, and with them their waits
        pool.shutdown(wait=False)


def launch_with_tokenizer(args: ServerArgs) -> tuple[RuntimeProcesses, Any]:
    """launch_runtime, with the frontend's tokenizer loading in a thread meanwhile: start-up
    takes the longer of the two instead of their sum."""
    from concurrent.futures import ThreadPoolExecutor

    model_path = resolve_model_path(args.resolved_model_path)
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(load_tokenizer, args.tokenizer_path or model_path)
        runtime = launch_runtime(args.replace(model_path=model_path))
        try:
            return runtime, tokenizer.result()
        except BaseException:
            runtime.shutdown()
            raise


