"""Every HTTP call of the pipeline with a total deadline.

httpx's timeouts (like urllib's) bound each read and write of a call, not the call: a server that
sends its answer one byte a second keeps a call alive as long as it likes. Here a call's deadline is
its read timeout from the moment it is sent (for openai-python: the client's `timeout`, or the one a
call passes with `with_options`), and every connect, read and write on its connection stops there:
past it the call fails with httpx2's timeout errors (openai-python: APITimeoutError), as a silent
server's does. Each attempt of a call that retries gets its own deadline.

- `with_deadlines(client)`: an httpx2 Client or AsyncClient (common.serving.chat's OpenAI clients),
  its calls given the deadline, and httpx's INFO line per request silenced (quiet_request_logs);
- `http_get(url, timeout, api_key)`: one GET within `timeout` seconds in all -> (status, body text)
  (the vLLM server's readiness polls, /metrics).
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from contextvars import ContextVar
from typing import Optional

# openai-python 3 builds on httpx2/httpcore2, older releases on httpx/httpcore (requirements allow both):
# a client is wrapped with the pair it was built from; http_get uses httpx2 where installed.
_PAIRS = {"httpx2": "httpcore2", "httpx": "httpcore"}
try:
    import httpx2
except ImportError:  # an environment with openai < 3 only
    import httpx as httpx2

# The deadline (time.monotonic()) of the call this thread or asyncio task is making. A connection
# serves one call at a time, within one thread or task: that call's deadline is this one.
_deadline: ContextVar[Optional[float]] = ContextVar("http_call_deadline", default=None)


def _start_call(request, clock=time.monotonic) -> None:
    read_timeout = (request.extensions.get("timeout") or {}).get("read")
    _deadline.set(None if read_timeout is None else clock() + read_timeout)


async def _start_call_async(request, clock=time.monotonic) -> None:
    _start_call(request, clock)


def _left(timeout: Optional[float], error: type[Exception], clock=time.monotonic) -> Optional[float]:
    """An I/O timeout cut to what is left of the call's deadline; `error` once nothing is left."""
    deadline = _deadline.get()
    if deadline is None:
        return timeout
    left = deadline - clock()
    if left <= 0:
        raise error("no complete answer within the call's timeout")
    return left if timeout is None else min(timeout, left)


class _Stream:
    """A connection whose reads and writes stop at the call's deadline. Sync or async alike: the
    inner stream's methods return a value or an awaitable, and this hands back what they return.
    `core`: the httpcore module of the client, whose timeout errors its httpx maps; `clock`: with_deadlines'."""

    def __init__(self, inner, core, clock=time.monotonic):
        self._inner, self._core, self._clock = inner, core, clock

    def read(self, max_bytes: int, timeout: Optional[float] = None):
        return self._inner.read(max_bytes, _left(timeout, self._core.ReadTimeout, self._clock))

    def write(self, buffer: bytes, timeout: Optional[float] = None):
        return self._inner.write(buffer, _left(timeout, self._core.WriteTimeout, self._clock))

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _Stream(self._inner.start_tls(ssl_context, server_hostname,
                                             _left(timeout, self._core.ConnectTimeout, self._clock)), self._core, self._clock)

    def __getattr__(self, name: str):  # close, get_extra_info
        return getattr(self._inner, name)


class _AsyncStream(_Stream):
    async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _AsyncStream(await self._inner.start_tls(ssl_context, server_hostname,
                                                        _left(timeout, self._core.ConnectTimeout, self._clock)),
                            self._core, self._clock)


class _Backend:
    """httpcore's network backend, its connections made within the call's deadline and kept to it."""

    def __init__(self, inner, core, clock=time.monotonic):
        self._inner, self._core, self._clock = inner, core, clock

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _Stream(self._inner.connect_tcp(host, port, _left(timeout, self._core.ConnectTimeout, self._clock),
                                               local_address, socket_options), self._core, self._clock)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _Stream(self._inner.connect_unix_socket(path, _left(timeout, self._core.ConnectTimeout, self._clock),
                                                       socket_options), self._core, self._clock)

    def __getattr__(self, name: str):  # sleep
        return getattr(self._inner, name)


class _AsyncBackend(_Backend):
    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _AsyncStream(await self._inner.connect_tcp(host, port, _left(timeout, self._core.ConnectTimeout, self._clock),
                                                          local_address, socket_options), self._core, self._clock)

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _AsyncStream(await self._inner.connect_unix_socket(path, _left(timeout, self._core.ConnectTimeout, self._clock),
                                                                  socket_options), self._core, self._clock)


def quiet_request_logs() -> None:
    """httpx logs one INFO line per request (`HTTP Request: POST ...`): hundreds over 01b's and 05's progress.
    Every client of the pipeline passes through with_deadlines, which calls this; warnings still show."""
    for name in _PAIRS:  # the loggers are named after the packages
        logging.getLogger(name).setLevel(logging.WARNING)


def with_deadlines(client, clock=time.monotonic):
    """`client` (an httpx2 or httpx Client or AsyncClient, no connection made yet), every call it makes held
    to its deadline. httpx takes no network backend through its public API, so the one its transports'
    connection pools were built with (the direct one and any proxy's) is wrapped in place.
    `clock`: what the deadlines are measured on; a test passes a virtual clock (with a virtual network) so that
    it checks where a call ends without timing it on a machine whose load it does not know."""
    # openai hands a subclass of its own: the package is that of the httpx class it derives from
    package = next((c.__module__.split(".")[0] for c in type(client).__mro__ if c.__module__.split(".")[0] in _PAIRS), None)
    if package is None:
        raise TypeError(f"with_deadlines takes an httpx2 or httpx client, not a {type(client).__qualname__}")
    httpx_mod, core = importlib.import_module(package), importlib.import_module(_PAIRS[package])
    quiet_request_logs()
    is_async = isinstance(client, httpx_mod.AsyncClient)
    client.event_hooks["request"].append(functools.partial(_start_call_async if is_async else _start_call, clock=clock))
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if pool is not None:
            pool._network_backend = (_AsyncBackend if is_async else _Backend)(pool._network_backend, core, clock)
    return client


def http_get(url: str, timeout: float, api_key: Optional[str] = None) -> tuple[int, str]:
    """GET url, answered in full within `timeout` seconds: (status, body text). TimeoutError past
    the deadline, ConnectionError when the server cannot be reached or breaks off (both OSErrors)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with with_deadlines(httpx2.Client(timeout=timeout)) as client:
            resp = client.get(url, headers=headers)
            return resp.status_code, resp.text
    except httpx2.TimeoutException:
        raise TimeoutError(f"no complete answer within {timeout:g}s") from None
    except httpx2.RequestError as e:  # refused, reset, a broken answer
        raise ConnectionError(f"{type(e).__name__}: {e}") from None
