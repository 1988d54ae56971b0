"""Running the service: in the foreground (``auditor serve``, :func:`serve`) or in a
background thread (``auditor demo``, :class:`BackgroundServer`)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Callable

import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from auditor.config import Settings


class NoDelayH11(H11Protocol):
    """uvicorn's h11 protocol with TCP_NODELAY on every accepted connection.

    With ``--workers N`` uvicorn listens on a socket it created with protocol number 0, so
    asyncio's ``_set_nodelay`` (which requires ``proto == IPPROTO_TCP``) skips the accepted
    connections; a response's header and body writes then meet Nagle's algorithm and the
    client's delayed ACK: +40 ms on every request (docs/performance.md). One process gets
    TCP_NODELAY from asyncio already; setting it again is harmless.
    """

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


def serve(host: str, port: int, workers: int = 1, log_level: str = "info") -> None:
    """Run ``auditor.server.app:create_app`` under uvicorn in the foreground until stopped.

    With several workers each keeps its ingest counters in mmap files of one shared
    directory and ``/metrics`` merges them (docs/deploy.md, "Metrics with several workers and
    replicas"): ``$PROMETHEUS_MULTIPROC_DIR`` if set (wiped at start), else a fresh temporary
    directory removed on exit. The variable must be set before the workers import
    prometheus_client. Settings come from the environment (:class:`auditor.config.Settings`).
    """
    from auditor.server.metrics import MULTIPROC_ENV, prepare_multiprocess_dir

    own_dir = None
    if workers > 1 and not os.environ.get(MULTIPROC_ENV):
        own_dir = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="auditor-metrics-")
    if os.environ.get(MULTIPROC_ENV):
        prepare_multiprocess_dir(os.environ[MULTIPROC_ENV])
    try:
        uvicorn.run("auditor.server.app:create_app", factory=True, host=host, port=port, workers=workers,
                    log_level=log_level, http=NoDelayH11)
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 30.0, alive: Callable[[], bool] | None = None) -> None:
    """Poll ``{url}/healthz`` until it answers 200; raise ``TimeoutError`` after ``timeout`` s,
    or at once if ``alive()`` (e.g. "the server process still runs") turns false."""
    deadline = time.monotonic() + timeout
    last: Exception | str | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise TimeoutError(f"auditor at {url} exited before it became healthy")
        try:
            r = httpx.get(f"{url}/healthz", timeout=2.0)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"auditor at {url} not healthy after {timeout:.0f} s: {last}")


class BackgroundServer:
    """The service on 127.0.0.1 in a daemon thread; a context manager yielding its base URL."""

    def __init__(self, settings: Settings, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        from auditor.server.app import create_app  # not at import: workers of the demo need only free_port

        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="auditor-server", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        wait_healthy(self.url, alive=self._thread.is_alive)  # a failed start-up fails at once
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
