"""RuntimeEndpoint: programs on a plait server (or any SGLang-native server) over HTTP;
Runtime: the same on a `plait serve` process this backend starts.

The chat template is the model's own: the server's /get_model_info names the model (and
tokenizer) path, whose tokenizer is loaded from local files when this machine has them; a
`chat_template` field in model_info is used when the server sends one. Without either, pass
`tokenizer=` or `chat_template=`; programs without roles need neither, and `select` then
uses the server's text protocol instead of token ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx

from plait.io_struct import GenerateInput, to_payload
from plait.lang.backends.base import BackendError
from plait.lang.backends.native import NativeBackend
from plait.lang.chat_template import ChatTemplate

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
# drop idle connections well before a server closes them (plait serve keeps them 75 s; other
# servers, e.g. uvicorn's default, 5 s): reusing one the server is closing fails the request
KEEPALIVE_EXPIRY_S = 4.0


class RuntimeEndpoint(NativeBackend):
    name = "runtime_endpoint"

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        tokenizer: Any = None,
        chat_template: str | None = None,
        max_connections: int = 256,
        verify: bool | str = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=64,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.model_info = self._get("/get_model_info")
        if isinstance(tokenizer, str) or tokenizer is None:
            tokenizer = _load_tokenizer(
                [tokenizer] if tokenizer else _tokenizer_paths(self.model_info)
            )
        template = None
        if tokenizer is not None:
            template = ChatTemplate.from_tokenizer(tokenizer, chat_template)
        elif chat_template or self.model_info.get("chat_template"):
            template = ChatTemplate.from_string(
                chat_template or self.model_info["chat_template"],
                {
                    k: self.model_info[k]
                    for k in ("bos_token", "eos_token")
                    if self.model_info.get(k)
                },
            )
        super().__init__(tokenizer=tokenizer, chat_template=template)

    def get_model_name(self) -> str:
        return self.model_info.get("model_path", "")

    # ------------------------------------------------------------------ transport
    async def request(self, inp: GenerateInput) -> dict[str, Any] | list[dict[str, Any]]:
        response = await self._client().post(self.base_url + "/generate", json=to_payload(inp))
        if response.status_code != 200:
            raise _error(response, "/generate")
        return response.json()

    async def request_stream(self, inp: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        payload = to_payload(inp)
        async with self._client().stream("POST", self.base_url + "/generate", json=payload) as r:
            if r.status_code != 200:
                await r.aread()
                raise _error(r, "/generate")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                obj = json.loads(data)
                if "error" in obj:
                    raise BackendError(f"{self.base_url}/generate: {_message(obj)}")
                yield obj

    def _client(self) -> httpx.AsyncClient:
        """One client per event loop: httpx connections belong to the loop that opened them."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(
                headers=self._headers,
                limits=self._limits,
                verify=self.verify,
                timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            )
            self._clients[loop] = client
        return client

    # ------------------------------------------------------------------ control
    def _get(self, path: str) -> dict[str, Any]:
        response = httpx.get(
            self.base_url + path, headers=self._headers, verify=self.verify, timeout=60.0
        )
        if response.status_code != 200:
            raise _error(response, path)
        return response.json()

    def flush_cache(self) -> None:
        response = httpx.post(
            self.base_url + "/flush_cache", headers=self._headers, verify=self.verify, timeout=60.0
        )
        if response.status_code != 200:
            raise _error(response, "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")


class Runtime(RuntimeEndpoint):
    """Starts a local `plait serve` process (plait.launch.ServerProcess) and runs programs
    on it; `shutdown()` (or leaving a `with` block) stops it."""

    def __init__(
        self, model_path: str | None = None, *, chat_template: str | None = None, **server_args: Any
    ) -> None:
        from plait.launch import ServerProcess

        server_args.setdefault("log_level", "warning")
        self.server = ServerProcess(model_path, **server_args)
        try:
            super().__init__(
                self.server.url, api_key=self.server.api_key, chat_template=chat_template
            )
        except BaseException:
            self.server.shutdown()
            raise

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def endpoint(self) -> Runtime:
        return self  # SGLang's Runtime.endpoint

    def shutdown(self) -> None:
        self.server.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _tokenizer_paths(info: dict[str, Any]) -> list[str]:
    return [p for p in dict.fromkeys([info.get("tokenizer_path"), info.get("model_path")]) if p]


def _load_tokenizer(paths: list[str]) -> Any:
    from plait.models.tokenizer import load_tokenizer

    for path in paths:
        try:
            return load_tokenizer(path, local_files_only=True)
        except Exception as e:  # not on this machine: fall back to the text protocol
            logger.info("no local tokenizer at %s (%s)", path, e)
    return None


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return str(body)


def _error(response: httpx.Response, path: str) -> BackendError:
    try:
        detail = _message(response.json())
    except ValueError:
        detail = response.text[:500]
    return BackendError(f"{path}: HTTP {response.status_code}: {detail}", response.status_code)
