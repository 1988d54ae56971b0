"""Running the service: in the foreground (``auditor serve``) or in a background thread
(``auditor demo``, tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import httpx
import uvicorn

from auditor.api import create_app
from auditor.config import Settings


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
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="auditor-server", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        wait_healthy(self.url)
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
