"""Bounded HTTP exchanges: every answer is read whole within a byte cap and a total deadline.

The programs on the client side of the wire — the trainer's sender thread
(:mod:`auditor.trainer.delivery`), the CLI, ``auditor import`` and :class:`auditor.Reader` —
must not trust the other end to be an auditor. httpx's ``timeout`` bounds each socket
operation (the wait for the next bytes), not an exchange: a server trickling its headers or
body one byte a second keeps a request alive for ever, and ``response.read()`` holds an
endless body in memory. :func:`exchange` bounds both:

* **time**: :func:`client` makes an ``httpx.Client`` whose connections read and write
  through :class:`_DeadlineBackend`, so every socket operation of an exchange waits at most
  until the exchange's deadline — connecting, sending, the status line and headers, the
  body. Past it httpx raises ``httpx.ReadTimeout`` (or ``ConnectTimeout``/``WriteTimeout``).
* **size**: the body is streamed and given up on past ``max_bytes`` (:class:`BadAnswer`).
  ``Accept-Encoding: identity`` is asked; a body compressed anyway (gzip, deflate) is
  decompressed with the same cap on the *decompressed* bytes (a gzip bomb costs at most
  ``max_bytes``); another encoding is a :class:`BadAnswer`.

Redirects are never followed (a service answers none; a loop of them is one answer here).
This module needs the standard library and httpx only: the trainer side imports it.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import httpcore

__all__ = ["Answer", "BadAnswer", "client", "exchange", "install_deadlines"]

_local = threading.local()  # .deadline: monotonic time the current exchange of this thread must end by


class BadAnswer(httpx.TransportError):
    """An answer that cannot be read as it stands: a body longer than the bound (after
    decoding), or in an encoding other than identity, gzip or deflate. ``status`` is the
    answer's HTTP status; ``url`` the request's URL."""

    def __init__(self, message: str, *, status: int, url: str, request: httpx.Request | None = None):
        super().__init__(message, request=request)
        self.status, self.url = status, url


@dataclass(frozen=True)
class Answer:
    """A whole answer: ``status``, ``headers``, ``body`` (decoded bytes, at most the bound)
    and ``url`` (the request's)."""

    status: int
    headers: httpx.Headers
    body: bytes
    url: str

    @property
    def text(self) -> str:
        """The body as text (UTF-8, undecodable bytes replaced)."""
        return self.body.decode("utf-8", "replace")


def _left() -> float | None:
    """Seconds the current exchange of this thread has left (None: no exchange is bounded)."""
    deadline = getattr(_local, "deadline", None)
    return None if deadline is None else deadline - time.monotonic()


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    left = _left()
    if left is None:
        return timeout
    if left <= 0:
        raise error("the exchange's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads and writes wait at most until the deadline of the exchange
    running in the calling thread (a connection kept alive serves later exchanges too)."""

    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if _left() is None:
            return self._inner.write(buffer, timeout)
        view = memoryview(buffer)  # in pieces: one send of a large body may take longer than what is left
        for i in range(0, len(view), 1 << 16):
            self._inner.write(bytes(view[i:i + (1 << 16)]), _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                     _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's network backend, with every connection a :class:`_DeadlineStream`."""

    def __init__(self, inner: httpcore.NetworkBackend):
        self._inner = inner

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _DeadlineStream(self._inner.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._inner.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout),
                                                               socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install_deadlines(http: httpx.Client) -> httpx.Client:
    """Make every HTTP transport of ``http`` (its own and those mounted for proxies) read
    and write through :class:`_DeadlineBackend`. A transport that is not httpx's (a test's
    ``MockTransport``, an ASGI app) is left alone: its answers are still bounded in size."""
    for transport in [http._transport, *http._mounts.values()]:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is not None and not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)
    return http


def client(*, timeout: float, headers: dict[str, str] | None = None,
           transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """An ``httpx.Client`` for :func:`exchange`: ``timeout`` (seconds) bounds each socket
    operation, the deadline of :func:`exchange` the whole; asks for uncompressed answers;
    follows no redirect; environment proxies honoured as by httpx."""
    return install_deadlines(httpx.Client(timeout=timeout, transport=transport, follow_redirects=False,
                                          headers={"Accept-Encoding": "identity", **(headers or {})}))


def exchange(http: httpx.Client, method: str, url: str, *, max_bytes: int | Callable[[int], int],
             seconds: float, **request: Any) -> Answer:
    """Send one request and read its whole answer within ``seconds`` (connecting, sending,
    the headers and the body: a total deadline, not a wait between bytes) and ``max_bytes``
    bytes of (decoded) body — a number, or a function of the answer's status.

    ``request``: httpx's ``content``, ``json``, ``params``, ``headers``. Raises
    ``httpx.TimeoutException`` past the deadline, :class:`BadAnswer` for a body over
    ``max_bytes`` or in an unknown encoding, and any other ``httpx.HTTPError`` of the
    exchange (connection refused or reset, a malformed status line or headers).
    """
    outer = getattr(_local, "deadline", None)
    deadline = time.monotonic() + max(seconds, 0.0)
    _local.deadline = deadline if outer is None else min(outer, deadline)
    try:
        with http.stream(method, url, **request) as response:
            body = _read(response, max_bytes(response.status_code) if callable(max_bytes) else max_bytes)
            return Answer(response.status_code, response.headers, body, str(response.request.url))
    finally:
        _local.deadline = outer


def _read(response: httpx.Response, max_bytes: int) -> bytes:
    """The body of ``response``, decoded, at most ``max_bytes`` (:class:`BadAnswer` past it)."""
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    where = str(response.request.url)

    def too_large() -> BadAnswer:
        return BadAnswer(f"an answer longer than {max_bytes:,} bytes (HTTP {response.status_code})",
                         status=response.status_code, url=where, request=response.request)

    if encoding in ("", "identity"):
        decoder = None
    elif encoding in ("gzip", "x-gzip", "deflate"):
        decoder = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)  # gzip or zlib header, detected
    else:
        raise BadAnswer(f"an answer in Content-Encoding {encoding!r} (identity was asked)",
                        status=response.status_code, url=where, request=response.request)
    out = bytearray()
    # a response built in memory (a MockTransport's) was read already: its content is all there is
    for chunk in [response.content] if response.is_stream_consumed else response.iter_raw():
        if decoder is not None:
            try:
                chunk = decoder.decompress(chunk, max_bytes - len(out) + 1)
            except zlib.error as exc:
                raise BadAnswer(f"an answer whose {encoding} body cannot be decoded ({exc})",
                                status=response.status_code, url=where, request=response.request) from None
            if decoder.unconsumed_tail:
                raise too_large()
        out += chunk
        if len(out) > max_bytes:
            raise too_large()
    return bytes(out)
