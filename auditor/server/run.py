"""Running the service: in the foreground (``auditor serve``, :func:`serve`) or in a
background thread (``auditor demo``, :class:`BackgroundServer`)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Callable

import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from auditor.config import Settings


class AuditorH11(H11Protocol):
    """uvicorn's h11 protocol with the connection limits uvicorn lacks.

    * ``max_connections``: a connection accepted while that many are open gets a 503
      (problem details) and is closed at once, so idle sockets cannot exhaust the process's
      file descriptors (the condition is logged once per minute, not once per accept).
    * ``header_timeout_seconds``: a connection that has not delivered a request's complete
      headers within that time of opening (or of its previous response) is closed. uvicorn
      arms its keep-alive timer only after a response, so a connection that never sends a
      request, or sends headers a byte at a time, would otherwise be held forever.
    * TCP_NODELAY on every accepted connection. With ``--workers N`` uvicorn listens on a
      socket it created with protocol number 0, so asyncio's ``_set_nodelay`` (which
      requires ``proto == IPPROTO_TCP``) skips the accepted connections; a response's header
      and body writes then meet Nagle's algorithm and the client's delayed ACK: +40 ms on
      every request (docs/performance.md).

    The limits come from :meth:`configure` (``auditor serve``, :class:`BackgroundServer`),
    else from ``Settings()`` (the ``AUDITOR_*`` environment) on first use in a process.
    """

    limits: Settings | None = None

    @classmethod
    def configure(cls, settings: Settings) -> None:
        cls.limits = settings

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if AuditorH11.limits is None:
            AuditorH11.limits = Settings()
        lim = AuditorH11.limits
        over = len(self.connections) >= lim.max_connections
        super().connection_made(transport)
        self._header_timer = None
        self._timed_cycle = None
        if over:
            from auditor.server.app import throttled

            throttled.warning("connections", "%d connections open (AUDITOR_MAX_CONNECTIONS): closing new ones at once",
                              lim.max_connections)
            transport.write(_CONNECTIONS_FULL)
            transport.close()
            return
        self._arm(lim.header_timeout_seconds)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(seconds, self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        from auditor.server.app import throttled

        throttled.warning("header-timeout", "closed a connection that sent no complete request headers within "
                                            "%.0f s (AUDITOR_HEADER_TIMEOUT_SECONDS)",
                          AuditorH11.limits.header_timeout_seconds)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._timed_cycle:  # headers complete: a request started
            self._timed_cycle = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(AuditorH11.limits.header_timeout_seconds)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


_FULL_BODY = (b'{"type":"urn:auditor:problem:overloaded","title":"Too many requests in progress, retry later",'
              b'"status":503,"detail":"too many open connections"}')
_CONNECTIONS_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY
)


def uvicorn_options(settings: Settings) -> dict:
    """The uvicorn settings that bound what a caller can hold (docs/deploy.md "Limits and
    security"): keep-alive, header size, listen backlog, how long a shutdown waits for the
    requests in progress, and the protocol above."""
    return {"http": AuditorH11, "timeout_keep_alive": settings.keep_alive_seconds,
            "h11_max_incomplete_event_size": settings.max_header_bytes, "backlog": settings.backlog,
            "timeout_graceful_shutdown": settings.shutdown_timeout_seconds}


def raise_fd_limit(settings: Settings) -> int:
    """Raise this process's soft limit of open files to its hard limit and return it;
    warn when ``max_connections`` would not fit below it (accepts would then fail with
    "Too many open files")."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if settings.max_connections + 256 > soft:
        import logging

        logging.getLogger("auditor.server").warning(
            "AUDITOR_MAX_CONNECTIONS=%d does not fit below the open-files limit %d (ulimit -n): lower it",
            settings.max_connections, soft)
    return soft


class BindError(OSError):
    """The service cannot listen on the address it was given (port taken, no such interface)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), inheritable by uvicorn's
    worker processes. Bound before the database is touched and before the application
    starts, so a taken port fails at once with :class:`BindError` (one line naming the
    address; ``auditor serve`` exits 2) and no background task ever starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = "; another process listens there: stop it or pick another --port" if e.errno == errno.EADDRINUSE else ""
        raise BindError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _exit_now(sig: int, after: float) -> None:
    import sys

    sys.stderr.write(f"auditor: not stopped {after:.0f} s after signal {signal.Signals(sig).name}: exiting now\n")
    sys.stderr.flush()
    os._exit(128 + sig)


class AuditorServer(uvicorn.Server):
    """uvicorn's server with an exit that never waits forever: the first SIGTERM/SIGINT
    starts the graceful shutdown (requests in progress get ``shutdown_timeout_seconds``,
    background tasks are cancelled) and arms a watchdog that ends the process
    (``os._exit(128 + signal)``) if it is still alive ``exit_after`` s later, whatever it
    waits for (a thread stuck in a database call, a lifespan that does not return)."""

    def __init__(self, config: uvicorn.Config, exit_after: float):
        super().__init__(config)
        self.exit_after = exit_after
        self._watchdog: threading.Timer | None = None

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        super().handle_exit(sig, frame)
        if self._watchdog is None:
            self._watchdog = threading.Timer(self.exit_after, _exit_now, args=(sig, self.exit_after))
            self._watchdog.daemon = True
            self._watchdog.start()


def log_config(log_level: str) -> dict:
    """uvicorn's logging configuration plus the service's own ``auditor.*`` loggers on the
    same handler and level (without it their INFO lines, e.g. a client leaving mid-body or
    a sweep round, went nowhere)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["auditor"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return cfg


def serve(host: str, port: int, workers: int = 1, log_level: str = "info",
          sock: socket.socket | None = None) -> None:
    """Run ``auditor.server.app:create_app`` under uvicorn in the foreground until stopped.

    ``sock``: a socket of :func:`listen_socket` (bound here if not given; :class:`BindError`
    when ``host:port`` is taken). With several workers each keeps its ingest counters in
    mmap files of one shared directory and ``/metrics`` merges them (docs/deploy.md,
    "Metrics with several workers and replicas"): ``$PROMETHEUS_MULTIPROC_DIR`` if set
    (wiped at start), else a fresh temporary directory removed on exit. The variable must
    be set before the workers import prometheus_client. Settings come from the environment
    (:class:`auditor.config.Settings`). SIGTERM/SIGINT end the process within
    ``shutdown_timeout_seconds`` + 5 s in every state (:class:`AuditorServer`). Raises
    ``SystemExit(3)`` when the application fails to start.
    """
    from auditor.server.metrics import MULTIPROC_ENV, prepare_multiprocess_dir

    sock = sock if sock is not None else listen_socket(host, port)
    own_dir = None
    if workers > 1 and not os.environ.get(MULTIPROC_ENV):
        own_dir = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="auditor-metrics-")
    if os.environ.get(MULTIPROC_ENV):
        prepare_multiprocess_dir(os.environ[MULTIPROC_ENV])
    settings = Settings()
    raise_fd_limit(settings)
    config = uvicorn.Config("auditor.server.app:create_app", factory=True, host=host, port=port, workers=workers,
                            log_level=log_level, log_config=log_config(log_level), **uvicorn_options(settings))
    import logging

    logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host,
                                            sock.getsockname()[1])
    try:
        if workers > 1:
            import inspect

            from uvicorn.supervisors import Multiprocess

            # uvicorn < 0.30 takes the workers' target; later ones build their servers themselves
            extra = {"target": uvicorn.Server(config).run} if "target" in inspect.signature(Multiprocess).parameters else {}
            Multiprocess(config, sockets=[sock], **extra).run()
            return
        server = AuditorServer(config, exit_after=settings.shutdown_timeout_seconds + 5.0)
        server.run(sockets=[sock])
        if not server.started:
            raise SystemExit(3)
    finally:
        sock.close()
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

        AuditorH11.configure(settings)
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on", **uvicorn_options(settings))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="auditor-server", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        wait_healthy(self.url, alive=self._thread.is_alive)  # a failed start-up fails at once
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
