"""plait.Runtime: a `plait serve` subprocess on a free port, for programs and tests.

    with Runtime(model_path, max_running_requests=8) as rt:
        requests.post(rt.url + "/generate", json={"text": "Hi", "sampling_params": {...}})

Keyword arguments are ServerArgs fields (an unknown one is a TypeError before anything starts).
The server runs in its own process group, so `shutdown()` reaches its children even when the
server itself has to be killed.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from plait.args import API_KEY_ENV, ServerArgs

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0


class Runtime:
    def __init__(
        self,
        model_path: str | None = None,
        *,
        start_timeout: float = START_TIMEOUT_S,
        log_file: str | None = None,
        **server_args: Any,
    ) -> None:
        server_args.setdefault("log_level", "warning")  # a library should not chatter
        if "port" not in server_args:
            server_args["port"] = free_port(server_args.get("host", "127.0.0.1"))
        try:
            self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        except TypeError as e:
            raise TypeError(f"Runtime: {e}") from None
        self.url = self.args.url
        self.api_key = self.args.api_key
        self._log = open(log_file, "ab") if log_file else None  # noqa: SIM115 - closed in shutdown
        env = dict(os.environ)
        if self.api_key:  # through the environment: argv is visible to every user (`ps`)
            env[API_KEY_ENV] = self.api_key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "plait", "serve", *cli_flags(self.args)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True,
        )
        atexit.register(self.shutdown)  # never leave a server behind the interpreter
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"plait serve exited during start-up (code {self.proc.returncode}); "
                    "see its log above" + (f" or in {self._log.name}" if self._log else "")
                )
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"plait serve did not become healthy within {timeout:.0f} s")

    def shutdown(self) -> None:
        """SIGTERM (the server stops its children), then SIGKILL to the whole group if needed."""
        atexit.unregister(self.shutdown)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any child left behind
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def cli_flags(args: ServerArgs) -> list[str]:
    """The `plait serve` flags that reproduce `args` (fields left at their default omitted).
    The API key is never a flag: pass it in the PLAIT_API_KEY environment variable."""
    flags: list[str] = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if value == f.default or f.name == "api_key":
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            else:
                raise ValueError(f"{f.name}: a default-True flag cannot be turned off from the CLI")
        else:
            flags += [flag, str(value)]
    return flags


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
