"""Running the service: in the foreground (``auditor serve``, :func:`serve`) or in a
background thread (``auditor demo``, :class:`BackgroundServer`)."""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Callable

import httptools
import httpx
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from auditor.config import Settings


class AuditorHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C) with the connection limits uvicorn lacks.

    * ``max_connections``: a connection accepted while that many are open makes room by
      closing an idle one (no request in progress: never sent one, sending its headers, or
      kept alive after a response), of the client (IP address) that holds the most open
      connections, the longest idle of them first; so 1,000 idle sockets of one caller
      cannot keep probes or other callers out, they only lose their own sockets. When none
      is idle (every connection has a request in progress), the new connection is a
      *probe connection* if fewer than ``max_concurrent_probes`` are open: it gets
      :data:`PROBE_HEADER_TIMEOUT` s to send one request, which is served if it asks for a
      probe path (:data:`PROBE_ONLY_PATHS`), else answered 503 "too many open
      connections"; the connection closes after it. Past that too: 503 and closed at once.
      Either way idle sockets cannot exhaust the process's file descriptors (the condition
      is logged once per minute, not once per accept).
    * ``header_timeout_seconds``: a connection that has not delivered a request's complete
      headers within that time of opening (or of its previous response) is closed. uvicorn
      arms its keep-alive timer only after a response, so a connection that never sends a
      request, or sends headers a byte at a time, would otherwise be held forever.
    * ``max_header_bytes``: a request line plus headers longer than that is answered 400 and
      the connection closed (llhttp sets no limit): counted as the parser passes on the URL
      and each complete header line, and, separately, over the chunks that leave a request's
      headers incomplete (the parser holds a partial line), so that one endless header line
      cannot grow in memory either.
    * TCP_NODELAY on every accepted connection. With ``--workers N`` uvicorn listens on a
      socket it created with protocol number 0, so asyncio's ``_set_nodelay`` (which
      requires ``proto == IPPROTO_TCP``) skips the accepted connections; a response's header
      and body writes then meet Nagle's algorithm and the client's delayed ACK: +40 ms on
      every request (docs/performance.md).

    Why httptools and not h11: h11 parses in Python, chunk by chunk of every body; on the
    floor's stub servers httptools takes 0.4–0.55 µs less server CPU per report (batches of
    1,000 reports, docs/performance.md, seventh round).

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
        if AuditorHttp.limits is None:
            AuditorHttp.limits = Settings()
        lim = AuditorHttp.limits
        full = len(self.connections) >= lim.max_connections and self._open() >= lim.max_connections
        super().connection_made(transport)
        self._header_timer = None
        self._timed_cycle = None
        self._in_headers = False  # a request's line and headers are being received
        self._header_bytes = 0  # of them, passed on by the parser (URL, complete header lines)
        self._pending_bytes = 0  # of them, in chunks that left them incomplete
        self._refusal: str | None = None  # why the connection is answered 400 and closed
        self._idle_since = self.loop.time()  # opened, or its last response completed
        self._probe_only = False  # accepted past the cap: one request, to a probe path
        if full:
            from auditor.server.limits import throttled

            victim = self._idle_victim()
            if victim is not None:
                throttled.warning("connections", "%d connections open (AUDITOR_MAX_CONNECTIONS): closing idle ones, "
                                                 "of the clients holding the most, to make room", lim.max_connections)
                victim.transport.close()
            elif sum(getattr(c, "_probe_only", False) for c in self._live()) < lim.max_concurrent_probes:
                throttled.warning("connections-busy", "%d connections open, none idle (AUDITOR_MAX_CONNECTIONS): "
                                                      "new ones may only ask for a probe path", lim.max_connections)
                self._probe_only = True
                self._arm(min(PROBE_HEADER_TIMEOUT, lim.header_timeout_seconds))
                return
            else:
                throttled.warning("connections-full", "%d connections open, none idle, and %d probe connections "
                                                      "(AUDITOR_MAX_CONNECTIONS, AUDITOR_MAX_CONCURRENT_PROBES): "
                                                      "closing new ones at once",
                                  lim.max_connections, lim.max_concurrent_probes)
                transport.write(_CONNECTIONS_FULL)
                transport.close()
                return
        self._arm(lim.header_timeout_seconds)

    def _live(self):
        """The open connections of this process not already being closed."""
        return (c for c in self.connections if not c.transport.is_closing())

    def _open(self) -> int:
        return sum(1 for _ in self._live())

    def _idle(self) -> bool:
        """No request in progress or queued (never sent one, its headers still arriving, or
        kept alive after its response)."""
        return not self._probe_only and (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def _idle_victim(self) -> "AuditorHttp | None":
        """The idle connection to close for a new one: of the client (IP address) holding
        the most open connections, the longest idle of them; None when none is idle."""
        live = [c for c in self._live() if c is not self and isinstance(c, AuditorHttp)]
        held = collections.Counter(c.client[0] if c.client else None for c in live)
        idle = [c for c in live if c._idle()]
        if not idle:
            return None
        return max(idle, key=lambda c: (held[c.client[0] if c.client else None], -c._idle_since))

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
        from auditor.server.limits import throttled

        throttled.warning("header-timeout", "closed a connection that sent no complete request headers within "
                                            "%.0f s (AUDITOR_HEADER_TIMEOUT_SECONDS)",
                          AuditorHttp.limits.header_timeout_seconds)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._timed_cycle:  # headers complete: a request started
            self._timed_cycle = self.cycle
            self._disarm()
        if self._in_headers and not self.transport.is_closing():
            # a chunk that left the headers incomplete: all of it was request line and headers,
            # which the parser holds (a header line is passed on only once complete)
            self._pending_bytes += len(data)
            if self._pending_bytes > AuditorHttp.limits.max_header_bytes:
                self._refuse_headers()

    # parser callbacks (llhttp calls them while super().data_received feeds it)
    def on_message_begin(self) -> None:
        self._in_headers, self._header_bytes, self._pending_bytes = True, 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if not self._probe_only:
            return super().on_headers_complete()
        # a probe connection (accepted past the cap): a probe path is served, anything else
        # gets the 503 of a full server; the connection closes after either
        app = self.app
        if httptools.parse_url(self.url).path not in PROBE_ONLY_PATHS:
            self.app = _connections_full_app
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        self.cycle.keep_alive = False

    def _count_header_bytes(self, n: int) -> None:
        """Add ``n`` bytes of the request line and complete headers; past ``max_header_bytes``
        raise, which stops the parser before the request starts (uvicorn then answers
        :meth:`send_400_response` and closes)."""
        self._header_bytes += n
        if self._header_bytes > AuditorHttp.limits.max_header_bytes:
            self._refuse_headers(in_callback=True)

    def _refuse_headers(self, in_callback: bool = False) -> None:
        """Answer 400 naming the limit and close (in a parser callback: by raising)."""
        self._in_headers = False
        self._refusal = (f"request line and headers longer than {AuditorHttp.limits.max_header_bytes} bytes "
                         "(AUDITOR_MAX_HEADER_BYTES)")
        if in_callback:
            raise _HeadersTooLong(self._refusal)
        self.send_400_response(self._refusal)

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(self._refusal or msg)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = self.loop.time()
        if not self.transport.is_closing():
            self._arm(AuditorHttp.limits.header_timeout_seconds)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class _HeadersTooLong(Exception):
    """Raised in a parser callback past ``max_header_bytes`` (stops llhttp)."""


_FULL_BODY = (b'{"type":"urn:auditor:problem:overloaded","title":"Too many requests in progress, retry later",'
              b'"status":503,"detail":"too many open connections"}')
_CONNECTIONS_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\n"
    b"x-content-type-options: nosniff\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY
)


#: Paths a probe connection (accepted past ``max_connections`` while none was idle) may ask for.
PROBE_ONLY_PATHS = frozenset({b"/healthz", b"/readyz", b"/metrics"})
#: Seconds a probe connection gets to send its request's headers.
PROBE_HEADER_TIMEOUT = 2.0


async def _connections_full_app(scope, receive, send) -> None:
    """The answer of a probe connection that asked for anything but a probe path."""
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/problem+json"), (b"retry-after", b"1"), (b"connection", b"close"),
        (b"x-content-type-options", b"nosniff"),
        (b"content-length", str(len(_FULL_BODY)).encode())]})
    await send({"type": "http.response.body", "body": _FULL_BODY})


def uvicorn_options(settings: Settings) -> dict:
    """The uvicorn settings that bound what a caller can hold (docs/deploy.md "Limits and
    security"): keep-alive, listen backlog, how long a shutdown waits for the requests in
    progress, and the protocol above (with the connection and header-size limits)."""
    return {"http": AuditorHttp, "timeout_keep_alive": settings.keep_alive_seconds, "backlog": settings.backlog,
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


#: Query parameters whose values the access log never shows (a token sent as ``?token=``).
#: A name is one when one of its words (split at ``_ - .``) is one of these, as in
#: ``token``, ``access_token``, ``api-key``, ``X-Amz-Signature``, ``client_secret``.
_CREDENTIAL_PARAM = re.compile(
    r"([?&](?:[^=&#]*[_.-])?(?:token|password|passwd|pwd|secret|key|apikey|auth|authorization|signature|sig|"
    r"session|sessionid|cookie|credentials?|jwt)(?:[_.-][^=&#]*)?=)[^&#]*", re.IGNORECASE)


def redact_query(path: str) -> str:
    """``path`` (with its query string) with the value of every parameter whose name looks
    like a credential (:data:`_CREDENTIAL_PARAM`: token, password, secret, key, auth,
    signature, session, ...) replaced by ``REDACTED``: ``/runs?token=abc&step=3`` → ``/runs?token=REDACTED&step=3``."""
    return _CREDENTIAL_PARAM.sub(r"\1REDACTED", path) if "?" in path else path


class RedactQuery(logging.Filter):
    """On uvicorn's access log (``'%s - "%s %s HTTP/%s" %d'``: client, method, path with
    query, version, status): the path through :func:`redact_query`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def log_config(log_level: str) -> dict:
    """uvicorn's logging configuration plus the service's own ``auditor.*`` loggers on the
    same handler and level (without it their INFO lines, e.g. a client leaving mid-body or
    a sweep round, went nowhere), and credential-looking query values redacted from the
    access log (:class:`RedactQuery`)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["auditor"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    cfg.setdefault("filters", {})["redact_query"] = {"()": "auditor.server.run.RedactQuery"}
    cfg["handlers"]["access"]["filters"] = ["redact_query"]
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
    """A TCP port on 127.0.0.1 that nothing listens on right now, picked at random below the
    kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) where one exists.

    Not ``bind(0)`` alone: that hands out a port of the ephemeral range, which the client
    side of any outgoing connection may take before the caller listens on it (parallel test
    workers' HTTP traffic took a rendezvous port: ``EADDRINUSE``), and processes asking at
    the same moment may be handed the same port. The port is free when chosen, not held."""
    import secrets

    low = _ephemeral_low()
    for _ in range(64):
        port = 10_000 + secrets.randbelow(low - 10_000) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel gives to outgoing connections (32768 when unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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

        AuditorHttp.configure(settings)
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
