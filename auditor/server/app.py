"""HTTP API (FastAPI): a thin layer over :class:`auditor.service.Service`.

Endpoints (JSON; every error is RFC 9457 problem details, :mod:`auditor.server.problems`):

* ``POST /v1/reports`` — ingest a batch (wire contract v1, DESIGN.md §3).
* ``PUT /v1/runs/{run_id}`` — register a run's topology and statistic specs.
* ``DELETE /v1/runs/{run_id}`` — delete a run with its reports and verdicts.
* ``GET /v1/runs`` (keyset-paginated), ``GET /v1/runs/{run_id}``, ``GET /v1/runs/{run_id}/report``,
  ``GET /v1/runs/{run_id}/statistics/{statistic}/steps`` (step history, keyset-paginated),
  ``GET /v1/runs/{run_id}/statistics/{statistic}/steps/{step}``.
* ``GET /healthz`` (liveness, answered on the event loop), ``GET /readyz`` (database),
  ``GET /metrics`` (Prometheus text format).

HTML (Jinja2 templates of :mod:`auditor.web`): ``GET /`` (runs), ``GET /runs/{run_id}`` (the
run page with its plots). Every asset — plotly.js from the plotly package, Swagger UI and
ReDoc from fastapi-offline, our CSS/JS — is served by this process (``/static``,
``/static-offline-docs``): no CDN, so air-gapped clusters see the pages and ``/docs``.

What protects the service from its callers (docs/deploy.md "Limits and security"): a token
check before any body is read (:class:`AuthMiddleware`), a cap on requests in progress
(:class:`ConcurrencyMiddleware`), a budget of body bytes in flight taken before a body is
read and held until it is decoded and stored (:mod:`auditor.server.budget`; 503 past it),
bodies read while streaming up to ``max_body_bytes``
(413 without reading the rest) with a timeout between chunks, JSON parsing, validation and
rendering in worker threads (never on the event loop), ingest on a bounded number of
threads, and 503 + Retry-After for every "try again later" condition of the database.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import gc
import hmac
import json
import logging
import math
import re
import threading
import time
import urllib.parse
from typing import Any, Callable, Literal

import anyio
import pydantic_core
import sqlalchemy as sa
from fastapi import FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from auditor import __version__
from auditor.config import Settings
from auditor.db.engine import current_revision, ensure_schema, make_engine
from auditor.server.budget import BodyBudget, Lease
from auditor.server.metrics import scrape_registry
from auditor.server.problems import MEDIA_TYPE, Problem, field_errors, problem, summary
from auditor.service import (REPORT_RANK_ROWS, REPORT_ROWS_BUDGET, STEP_RANK_ROWS, STEP_RANK_ROWS_MAX, ConflictError,
                             Contended, LimitError, NotFound, PageReads, Service)
from auditor.schemas import RUN_ID_PATTERN, STATISTIC_PATTERN, IngestResult, ReportBatch, RunRegistration, limit_errors, parse_report_batch

log = logging.getLogger("auditor.api")

#: Paths that answer without a token when ``Settings.public_endpoints`` (the default).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
#: Liveness answers without a token in any case (probes of orchestrators carry none).
ALWAYS_OPEN = frozenset({"/healthz"})
#: Seconds a client is asked to wait (Retry-After) after a 503.
RETRY_AFTER = "1"


class Throttled:
    """Log a recurring condition once when it starts, then at most once per ``every`` s
    with the number of repeats (not one line per event: a flood must not fill the disk)."""

    def __init__(self, logger: logging.Logger, every: float = 60.0):
        self._log, self._every = logger, every
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._every:
            self._count[key] = self._count.get(key, 0) + 1
            return
        repeats = self._count.pop(key, 0)
        self._last[key] = now
        self._log.warning(message + (f" ({repeats} more since the last such line)" if repeats else ""), *args)


throttled = Throttled(log)


class FailureThrottle:
    """Failed attempts per client address in a window (``POST /login``'s wrong tokens):
    after ``limit`` failures within ``window`` s of an address's first one, :meth:`blocked`
    says how many seconds remain until the window ends (the address is refused meanwhile,
    whatever it sends). At most ``max_clients`` addresses are tracked (the oldest windows
    are forgotten first), so a flood of addresses cannot grow memory. Event loop only."""

    def __init__(self, limit: int, window: float, max_clients: int = 10_000):
        self.limit, self.window, self.max_clients = limit, window, max_clients
        self._failures: dict[str, tuple[float, int]] = {}  # address -> (window start, failures); oldest first

    def _current(self, client: str, now: float) -> tuple[float, int] | None:
        entry = self._failures.get(client)
        if entry is not None and now - entry[0] >= self.window:
            del self._failures[client]
            return None
        return entry

    def blocked(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0.0 when it may now."""
        now = time.monotonic()
        entry = self._current(client, now)
        return entry[0] + self.window - now if entry is not None and entry[1] >= self.limit else 0.0

    def failed(self, client: str) -> None:
        """Count one failure of ``client``."""
        now = time.monotonic()
        start, n = self._current(client, now) or (now, 0)
        self._failures.pop(client, None)
        self._failures[client] = (start, n + 1)
        while len(self._failures) > self.max_clients:
            del self._failures[next(iter(self._failures))]

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures."""
        self._failures.pop(client, None)


class AppState:
    """What a request handler needs: settings, the service, metrics. One per app."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.engine = make_engine(settings.database_url, lock_timeout=settings.db_lock_timeout_seconds,
                                  pool_timeout=settings.db_pool_timeout_seconds)
        ensure_schema(self.engine, settings.database_url)
        self.schema_revision = current_revision(self.engine)
        self.service = Service.from_engine(self.engine, max_statistics_per_run=settings.max_statistics_per_run)
        # One process: ordinary metrics. Several uvicorn workers (PROMETHEUS_MULTIPROC_DIR,
        # set by `auditor serve --workers N`): every worker exports the sum of all workers.
        self.registry, self.metrics = scrape_registry(self.service.metric_series, settings.metrics_retention_seconds,
                                                      settings.metrics_max_series)
        self.ingest_limiter = anyio.CapacityLimiter(settings.ingest_concurrency)
        #: Run pages rendering at once (AUDITOR_MAX_CONCURRENT_PAGES): past it a 503.
        self.page_slots = threading.BoundedSemaphore(settings.max_concurrent_pages)
        #: Request-body bytes in flight (AUDITOR_MAX_BODY_BYTES_IN_FLIGHT): :func:`read_body`
        #: takes them, the endpoint that read the body gives them back when it is done.
        self.body_budget = BodyBudget(settings.body_budget_bytes, on_change=self.metrics.body_bytes.set)
        self.metrics.body_bytes.set(0)
        #: Wrong tokens per client address at POST /login (AUDITOR_LOGIN_MAX_FAILURES).
        self.login_failures = FailureThrottle(settings.login_max_failures, settings.login_failure_window_seconds)
        #: Last database probe (:func:`_probe_forever`): (ok, message, monotonic time).
        self.database: tuple[bool, str, float] = (True, "ok", time.monotonic())
        #: Since when writes fail because the database cannot store them (disk full, I/O
        #: error, read-only; :func:`storage_failure`): (message, monotonic time), None while
        #: they succeed. ``/readyz`` is 503 meanwhile; the next write that succeeds (a
        #: request's, or the probe's own, which it tries while this is set) clears it.
        self.write_failure: tuple[str, float] | None = None

    def write_failed(self, exc: BaseException) -> bool:
        """Record ``exc`` if it says the database cannot store writes; True if it did."""
        message = storage_failure(exc)
        if message is None:
            return False
        if self.write_failure is None:
            log.warning("writes fail: %s; /readyz answers 503 until one succeeds", message)
            self.write_failure = (message, time.monotonic())
        else:
            self.write_failure = (message, self.write_failure[1])
        return True

    def wrote(self) -> None:
        """A write succeeded: the database stores writes again."""
        if self.write_failure is not None:
            log.warning("writes succeed again after %.0f s of failures", time.monotonic() - self.write_failure[1])
            self.write_failure = None

    def close(self) -> None:
        self.engine.dispose()


# ------------------------------------------------------------------ ASGI middlewares
async def _send_problem(send, response: Response, scope=None) -> None:
    """Send ``response`` from a middleware, before the app read the request body: the
    connection is then closed (``Connection: close``) when a body may follow, so its unread
    bytes are never taken for the next request."""
    headers = list(response.raw_headers)
    if scope is not None and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


#: The cookie a browser signs in with (``POST /login``); its value is the token. Accepted for
#: GET/HEAD only, so a cross-site form can never write with it (SameSite=Strict besides).
TOKEN_COOKIE = "auditor_token"
#: Bytes of a sign-in form (``POST /login``: token and ``next``) beyond the configured tokens'
#: worst-case percent-encoding (3 bytes a character); a longer body is a 413, never read whole.
LOGIN_BODY_BYTES = 8192
#: Assets that hold no data: every page (the sign-in page too) loads them without a token.
OPEN_PREFIXES = ("/static/", "/static-offline-docs/")


def _cookie(header: bytes, name: str) -> bytes | None:
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name.encode() and value:
            return urllib.parse.unquote_to_bytes(value)
    return None


class AuthMiddleware:
    """Bearer-token check before the route runs, so no body is read for a caller without
    the token. With ``token`` set, every request but the public paths needs
    ``Authorization: Bearer <token>``; ``read_token`` (optional) is accepted for GET/HEAD
    only (403 for writes). Tokens are compared with :func:`hmac.compare_digest`."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.settings = settings
        self._write = self._encode(settings.token)
        self._read = self._encode(settings.read_token)

    @staticmethod
    def _encode(token: str | None) -> bytes | None:
        return f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (self._write is None and self._read is None):
            return await self.app(scope, receive, send)
        path = scope["path"]
        if (path in ALWAYS_OPEN or path == "/login" or path.startswith(OPEN_PREFIXES)
                or (self.settings.public_endpoints and path in PUBLIC_PATHS)):
            return await self.app(scope, receive, send)
        given, cookie, accept = b"", None, b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.strip().partition(b" ")
                # the scheme is case-insensitive (RFC 7235 §2.1): "bearer x" is "Bearer x"
                given = b"Bearer " + credentials.strip() if scheme.lower() == b"bearer" else value
            elif name == b"cookie":
                cookie = value
            elif name == b"accept":
                accept = value
        reading = scope["method"] in ("GET", "HEAD")
        if not given and cookie is not None and reading:  # a browser that signed in (POST /login)
            token = _cookie(cookie, TOKEN_COOKIE)
            if token:
                given = b"Bearer " + token
        if self._write is not None and hmac.compare_digest(given, self._write):
            return await self.app(scope, receive, send)
        if self._read is not None and hmac.compare_digest(given, self._read):
            if reading:
                return await self.app(scope, receive, send)
            return await _send_problem(send, problem(
                403, "forbidden", "the read-only token (AUDITOR_READ_TOKEN) cannot change anything; "
                                  "use AUDITOR_TOKEN", path), scope)
        if self._write is None and not reading:
            return await self.app(scope, receive, send)  # only a read token is configured
        if reading and b"text/html" in accept and not path.startswith("/v1/"):
            # a person opening a page: the sign-in form, then back here
            target = path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
            root = scope.get("root_path", "")
            return await _send_problem(send, RedirectResponse(
                f"{root}/login?next={urllib.parse.quote(target, safe='')}", status_code=303), scope)
        await _send_problem(send, problem(
            401, "unauthorized", "send 'Authorization: Bearer <AUDITOR_TOKEN>'"
            + (" (or AUDITOR_READ_TOKEN for reads)" if self._read is not None else ""), path,
            headers={"WWW-Authenticate": 'Bearer realm="auditor"'}), scope)


#: Paths with a concurrency budget of their own (``max_concurrent_probes``): a load
#: balancer's readiness probe and Prometheus's scrape must answer while ingest is saturated.
PROBE_PATHS = frozenset({"/readyz", "/metrics"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class ConcurrencyMiddleware:
    """Requests in progress, in three budgets: probes (:data:`PROBE_PATHS`, ``probe_limit``),
    other reads (GET/HEAD/OPTIONS, ``read_limit``) and everything else — the writes, whose
    bodies a slow client can hold open — (``limit``). Past a budget: 503 + Retry-After at
    once (logged once per episode). ``/healthz`` has no cap, so liveness answers under any
    load; stalled bodies or a burst of ingest never take a probe's or a reader's slot."""

    def __init__(self, app, limit: int, probe_limit: int, read_limit: int):
        self.app = app
        self.limits = {"write": (limit, "AUDITOR_MAX_CONCURRENT_REQUESTS", ""),
                       "read": (read_limit, "AUDITOR_MAX_CONCURRENT_READS", "read "),
                       "probe": (probe_limit, "AUDITOR_MAX_CONCURRENT_PROBES", "probe ")}
        self.active = dict.fromkeys(self.limits, 0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/healthz":
            return await self.app(scope, receive, send)
        budget = ("probe" if scope["path"] in PROBE_PATHS else
                  "read" if scope["method"] in _READ_METHODS else "write")
        limit, setting, what = self.limits[budget]
        if self.active[budget] >= limit:
            throttled.warning(setting, "more than %d %srequests in progress (%s): answering 503", limit, what, setting)
            return await _send_problem(send, problem(
                503, "overloaded", f"more than {limit} {what}requests in progress ({setting})", scope["path"],
                headers={"Retry-After": RETRY_AFTER}), scope)
        self.active[budget] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active[budget] -= 1


#: Content-Security-Policy of the pages: scripts and styles of this origin only (plotly.js,
#: run.js, auditor.css are files of the package; the figures' data is a JSON script element,
#: which is not executed), inline styles allowed (plotly adds style elements, the pages set
#: style attributes), no plugins, no framing, forms post only here.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
            "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
            "frame-ancestors 'none'")
#: The same for Swagger UI and ReDoc (``/docs``, ``/redoc``): fastapi-offline's pages start
#: their bundle with an inline script, and ReDoc runs a worker from a blob.
DOCS_CSP = PAGE_CSP.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'") + "; worker-src 'self' blob:"
#: Anything else (JSON, problem details, metrics): nothing to run or load at all.
API_CSP = "default-src 'none'; frame-ancestors 'none'"
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})


class SecurityHeadersMiddleware:
    """Headers on every response, those of the other middlewares (401, 503) included:
    ``X-Content-Type-Options: nosniff`` (a JSON body or a problem is never sniffed into
    HTML), ``X-Frame-Options: DENY`` with CSP ``frame-ancestors 'none'`` (no page of the
    service in a frame of another site), ``Referrer-Policy: same-origin``, and a
    Content-Security-Policy: :data:`PAGE_CSP` on HTML, :data:`DOCS_CSP` on ``/docs`` and
    ``/redoc``, :data:`API_CSP` on everything else."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        docs = scope["path"] in DOCS_PATHS

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                html = any(k.lower() == b"content-type" and v.startswith(b"text/html") for k, v in headers)
                csp = DOCS_CSP if docs else PAGE_CSP if html else API_CSP
                headers += [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                            (b"referrer-policy", b"same-origin"), (b"content-security-policy", csp.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class HeadAsGetMiddleware:
    """``HEAD`` on every path that answers ``GET`` (pages, API reads, probes, assets): routed
    as the GET (FastAPI's routes register GET only: pages answered HEAD with 405), with the
    same status and headers; uvicorn sends no body for a HEAD (it sees the request's own
    method, not this copy's)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


#: Paths that are never pages, whatever the client accepts: the API, probes, metrics, assets.
_NOT_PAGES = ("/v1/", "/static/", "/static-offline-docs/")


class HtmlErrorsMiddleware:
    """A browser's errors as pages: a problem-details answer (any status, from any layer:
    a 404 of an unknown run, a 422 of a bad query, a 503) to a GET/HEAD that accepts
    ``text/html`` on a path outside the API (:data:`_NOT_PAGES`, :data:`PUBLIC_PATHS`,
    ``/openapi.json``) becomes :func:`auditor.web.render_error`'s page with the same status
    and headers (Retry-After, Allow, ...). API clients, which do not ask for HTML, keep
    the problem JSON."""

    def __init__(self, app):
        self.app = app

    @staticmethod
    def _wants_html(scope) -> bool:
        path = scope["path"]
        if (scope["method"] not in ("GET", "HEAD") or path.startswith(_NOT_PAGES) or path in PUBLIC_PATHS
                or path == "/openapi.json"):
            return False
        return any(k == b"accept" and b"text/html" in v for k, v in scope["headers"])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._wants_html(scope):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def convert(message):
            nonlocal start
            if message["type"] == "http.response.start":
                if any(k.lower() == b"content-type" and v.startswith(MEDIA_TYPE.encode())
                       for k, v in message.get("headers", ())):
                    start = message  # a problem: held until its (small) body is complete
                    return
                return await send(message)
            if start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            await send_page(start, b"".join(chunks))

        async def send_page(start: dict, body: bytes) -> None:
            from auditor import web

            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            headers = {k.lower(): v for k, v in start.get("headers", ())}
            html = web.render_error(status=start["status"], title=str(doc.get("title", "Error")),
                                    detail=str(doc.get("detail", "")),
                                    retry_after=headers.get(b"retry-after", b"").decode("latin-1") or None,
                                    root_path=scope.get("root_path", "")).encode()
            kept = [(k, v) for k, v in start.get("headers", ())
                    if k.lower() not in (b"content-type", b"content-length")]
            await send({**start, "headers": kept + [(b"content-type", b"text/html; charset=utf-8"),
                                                    (b"content-length", str(len(html)).encode())]})
            await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else html})

        await self.app(scope, receive, convert)


# ------------------------------------------------------------------ request bodies
class BodyTooLarge(Exception):
    def __init__(self, limit: int, size: int | None = None):
        self.limit, self.size = limit, size


class BodyTimeout(Exception):
    """The body did not arrive in time; ``str()`` says which limit (and its setting)."""


class BodyBudgetFull(Exception):
    """No room for the body in the budget of bytes in flight (a 503 + Retry-After)."""


async def read_body(request: Request, limit: int, chunk_timeout: float, deadline: float | None = None,
                    lease: Lease | None = None, budget_wait: float = 0.0) -> bytes:
    """The request body, read while it streams in: :class:`BodyTooLarge` as soon as the
    declared ``Content-Length`` or the bytes received pass ``limit`` (the rest is never
    read; the connection is closed after the 413), :class:`BodyTimeout` when no chunk
    arrives for ``chunk_timeout`` s or the whole body has not arrived ``deadline`` s after
    reading began (a client trickling a byte now and then cannot hold its slot forever).
    Raises ``starlette.requests.ClientDisconnect`` when the client goes away mid-body.

    With a ``lease`` (of :attr:`AppState.body_budget`) the body's bytes are taken from the
    budget before they are read: the declared ``Content-Length`` at once, waiting up to
    ``budget_wait`` s for room; without one, each chunk as it arrives (the first may wait,
    later ones take what is left or fail at once: a request that holds bytes never waits
    for more, so two such cannot wait on each other). :class:`BodyBudgetFull` when they
    do not fit. The caller closes the lease when it no longer holds the body or what was
    decoded from it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, int(declared))
    if lease is not None and declared is not None and declared.isdigit():
        if not await lease.take(int(declared), budget_wait):
            raise BodyBudgetFull()
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    end = None if deadline is None else time.monotonic() + deadline
    while True:
        wait = chunk_timeout if end is None else min(chunk_timeout, end - time.monotonic())
        # A cancel scope, not asyncio.wait_for: wait_for wraps each chunk's read in a task
        # that keeps the StopAsyncIteration ending the body, whose traceback holds this
        # frame and so every chunk: a reference cycle only the full collection frees, which
        # a server that allocates few Python objects rarely runs (server RSS climbed by a
        # body per request, 1.3 GiB over 10 M reports; benchmarks/memory.py).
        with anyio.move_on_after(max(wait, 0)) as scope:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                break
        if scope.cancelled_caught:
            if end is not None and time.monotonic() >= end - 1e-3:
                raise BodyTimeout(f"the body did not arrive within {deadline:g} s "
                                  f"(AUDITOR_BODY_DEADLINE_SECONDS); {size} bytes received")
            raise BodyTimeout(f"no part of the body arrived for {chunk_timeout:g} s "
                              f"(AUDITOR_BODY_TIMEOUT_SECONDS); {size} bytes received")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        if lease is not None and size > lease.held:
            more = size - lease.held
            if not (await lease.take(more, budget_wait) if lease.held == 0 else lease.try_grow(more)):
                raise BodyBudgetFull()
        chunks.append(chunk)
    return b"".join(chunks)


def _json(data: Any) -> bytes:
    """JSON bytes of a read's answer (rendered in a worker thread, not on the event loop)."""
    return json.dumps(data, separators=(",", ":"), default=str).encode()


#: Wire fields whose static ceiling (auditor.config.WIRE_MAX_SIZE) stands behind a configured
#: limit: a 422 for them names the configured limit and its setting, the one number a caller
#: is ever told (the world size limit also bounds each dim and group_ranks).
_LIMIT_OF_FIELD = {"world_size": ("max_world_size", "AUDITOR_MAX_WORLD_SIZE"),
                   "num_microbatches": ("max_num_microbatches", "AUDITOR_MAX_NUM_MICROBATCHES"),
                   "group_ranks": ("max_world_size", "AUDITOR_MAX_WORLD_SIZE"),
                   **{f"sizes.{d}": ("max_world_size", "AUDITOR_MAX_WORLD_SIZE")
                      for d in ("dp", "cp", "tp", "pp", "edp", "ep", "etp")}}


def name_limits(errors: list[dict], settings: Settings) -> list[dict]:
    """``errors`` with every breach of a static ceiling behind a configured limit (pydantic's
    ``less_than_equal`` / ``too_long`` on the fields of :data:`_LIMIT_OF_FIELD`) worded with
    the configured limit (``limit_exceeded``), as :func:`auditor.schemas.limit_errors` words
    the values between the two."""
    out = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        names = [str(p) for p in loc if not isinstance(p, int)]
        field = ".".join(names[-2:]) if names[-2:-1] == ["sizes"] else (names[-1] if names else "")
        if field in _LIMIT_OF_FIELD and e.get("type") in ("less_than_equal", "too_long"):
            attr, env = _LIMIT_OF_FIELD[field]
            what = "length" if e["type"] == "too_long" else "value"
            e = {**e, "type": "limit_exceeded",
                 "msg": f"{field} {what} is above the limit {getattr(settings, attr)} ({env})"}
        out.append(e)
    return out


def _parse_reports(body: bytes, settings: Settings) -> list | tuple[int, str, list[dict], int]:
    """Decode and validate a ``POST /v1/reports`` body (in a worker thread): the reports,
    or ``(status, code, field errors, number of reports)`` for a 413/422. A valid body is
    decoded by msgspec, any other validated by the pydantic models, whose errors are the 422
    (:func:`auditor.schemas.parse_report_batch`); at most ``max_errors_listed`` are collected."""
    reports, errs, n = parse_report_batch(body, settings.max_errors_listed)
    if reports is None:
        return 422, "validation", name_limits(errs, settings), n
    if n > settings.max_batch:
        return 413, "too_large", [{"loc": ("reports",), "type": "too_long",
                                   "msg": f"at most {settings.max_batch} reports per request (AUDITOR_MAX_BATCH), "
                                          f"got {n}; send smaller batches"}], n
    errs = limit_errors(reports, max_world_size=settings.max_world_size,
                        max_num_microbatches=settings.max_num_microbatches,
                        max_reports_per_step=settings.max_reports_per_step)
    if errs:
        return 422, "validation", errs[:settings.max_errors_listed], n
    return reports


def _parse_run(body: bytes, settings: Settings) -> RunRegistration | list[dict]:
    """Validate a ``PUT /v1/runs/{run_id}`` body (in a worker thread). The statistics count
    is checked before they are validated (100,000 invalid ones would make 100,000 errors)."""
    try:
        obj = pydantic_core.from_json(body, allow_inf_nan=True)
    except ValueError as e:
        return [{"loc": (), "msg": f"invalid JSON: {e}", "type": "json_invalid"}]
    stats = obj.get("statistics") if isinstance(obj, dict) else None
    if isinstance(stats, dict) and len(stats) > settings.max_statistics_per_run:
        return [{"loc": ("statistics",), "type": "limit_exceeded",
                 "msg": f"{len(stats)} statistics, above the limit {settings.max_statistics_per_run} "
                        "per run (AUDITOR_MAX_STATISTICS_PER_RUN)"}]
    try:
        reg = RunRegistration.model_validate(obj, strict=True)
    except ValidationError as e:
        return name_limits(e.errors(include_url=False, include_input=False)[:settings.max_errors_listed], settings)
    if reg.world_size > settings.max_world_size:
        return [{"loc": ("world_size",), "type": "limit_exceeded",
                 "msg": f"world_size ({reg.world_size}) is above the limit {settings.max_world_size} "
                        "(AUDITOR_MAX_WORLD_SIZE)"}]
    return reg


def _internal(request: Request, exc: BaseException) -> Response:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem(500, "internal", f"internal error ({type(exc).__name__}); the service log has the trace",
                   request.url.path)


def json_media_type_error(content_type: str | None) -> str | None:
    """None when ``content_type`` is JSON (``application/json`` or any ``…/…+json``, with
    parameters such as ``charset``), else the message of the 415. Every endpoint that
    reads a body requires it: a browser can send ``text/plain``, form types or no type
    across sites without a CORS preflight, never ``application/json``."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    got = f"got {content_type!r}" if content_type else "got none"
    return f"Content-Type must be application/json (or an application/*+json type), {got}"


def _disconnected(request: Request) -> Response:
    """A client went away before its request body was complete: one INFO line, no
    traceback, nothing stored (the response goes nowhere)."""
    log.info("client %s disconnected before sending the whole body of %s %s; nothing stored",
             request.client.host if request.client else "?", request.method, request.url.path)
    return Response(status_code=400, headers={"Connection": "close"})


#: SQLite's primary result codes of a database that cannot store a write (sqlite3.h):
#: SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN.
_SQLITE_STORAGE = {8: "read-only", 10: "I/O error", 13: "disk full", 14: "cannot open the database file"}
#: PostgreSQL SQLSTATEs of the same: disk_full, io_error, read_only_sql_transaction.
_PG_STORAGE = {"53100": "disk full", "58030": "I/O error", "25006": "read-only"}


def storage_failure(exc: BaseException) -> str | None:
    """What ``exc`` (a SQLAlchemy or driver error) says about the database's storage, in a
    few words and the driver's message ("disk full: database or disk is full"), when it
    says a write cannot be stored; None for any other error (locks, timeouts, a dropped
    connection, bad input)."""
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "sqlite_errorcode", None)
    what = (_SQLITE_STORAGE.get(code & 0xFF) if isinstance(code, int)
            else _PG_STORAGE.get(str(getattr(orig, "sqlstate", None) or "")))
    return None if what is None else f"{what}: {str(orig).strip()[:200]}"


def _is_unavailable(exc: BaseException) -> bool:
    """Database conditions that pass: unreachable, locked, pool exhausted, deadlock, lock
    timeout, connection dropped mid-request."""
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.TimeoutError, sa.exc.InterfaceError)):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and bool(exc.connection_invalidated)


#: Every path and query parameter carries the wire pattern of what it names, so characters a
#: database rejects (NUL, lone surrogates) are a 422 naming the parameter, never a query.
RunIdPath = Path(min_length=1, max_length=128, pattern=RUN_ID_PATTERN)


#: The groups of ``/docs``, in this order.
OPENAPI_TAGS = [
    {"name": "ingest", "description": "What trainer ranks send: reports (wire contract v1) and run registrations."},
    {"name": "runs", "description": "Runs and their consistency reports."},
    {"name": "steps", "description": "Per-step history and detail of one statistic of a run."},
    {"name": "operations", "description": "Probes and metrics for orchestrators and Prometheus."},
]


# ------------------------------------------------------------------ the app
def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the FastAPI app. On start-up it migrates an empty database to head and refuses
    (``auditor.db.engine.SchemaError``) a database at another revision; it then runs the
    sweep (missing reports, late-completed steps, retention) every
    ``settings.sweep_interval_seconds`` and probes the database for ``/readyz``."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        svc = AppState(settings)
        app.state.svc = svc
        tune_gc()
        tasks = [asyncio.create_task(_sweep_forever(svc)), asyncio.create_task(_probe_forever(svc))]
        try:
            yield
        finally:
            await _stop(tasks, settings.shutdown_timeout_seconds)
            svc.close()

    # FastAPIOffline: /docs and /redoc with Swagger UI and ReDoc shipped inside the
    # fastapi-offline package (stock FastAPI loads them from a CDN: blank when air-gapped).
    app = FastAPIOffline(title="auditor", version=__version__, lifespan=lifespan, openapi_tags=OPENAPI_TAGS,
                  description="Audits the statistics distributed trainers all-reduce across ranks. Every error "
                              "is RFC 9457 problem details (application/problem+json).")
    app.add_middleware(HeadAsGetMiddleware)  # innermost: the routes see a GET
    app.add_middleware(AuthMiddleware, settings=settings)
    app.add_middleware(ConcurrencyMiddleware, limit=settings.max_concurrent_requests,
                       probe_limit=settings.max_concurrent_probes, read_limit=settings.max_concurrent_reads)
    app.add_middleware(HtmlErrorsMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)  # outermost: on the other middlewares' answers too

    def svc_of(request: Request) -> AppState:
        return request.app.state.svc

    # ---------------------------------------------------------------- errors
    @app.exception_handler(ConflictError)
    async def _conflict(request: Request, exc: ConflictError):
        svc_of(request).metrics.rejected.labels(exc.error).inc(max(1, len(exc.conflicts)))
        return problem(409, exc.error, exc.message, request.url.path, conflicts=exc.conflicts)

    @app.exception_handler(LimitError)
    async def _limit(request: Request, exc: LimitError):
        svc_of(request).metrics.rejected.labels("limit_exceeded").inc()
        errs = [{"field": exc.field, "loc": exc.loc, "msg": exc.message, "type": "limit_exceeded"}]
        return problem(422, "limit_exceeded", exc.message, request.url.path, errors=errs)

    @app.exception_handler(Contended)
    async def _contended(request: Request, exc: Contended):
        throttled.warning("contended", "%s: answering 503", exc)
        return problem(503, "contended", f"{exc}; retry later", request.url.path, headers={"Retry-After": RETRY_AFTER})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        """Body, path and query errors in the same shape as ``POST /v1/reports``'s."""
        errs = field_errors(list(exc.errors()), settings.max_errors_listed, strip_body=True)
        return problem(422, "validation", summary(errs, len(exc.errors())), request.url.path, errors=errs)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound):
        return problem(404, "not_found", f"not found: {exc}", request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}.get(exc.status_code, "bad_request")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not only those of the route that matched first
            allowed = sorted({m for route in app.routes if route.matches(request.scope)[0] != Match.NONE
                              for m in getattr(route, "methods", None) or ()})
            headers["Allow"] = ", ".join(allowed)
        return problem(exc.status_code, code, str(exc.detail), request.url.path, headers=headers or None)

    def _cannot_store(request: Request, exc: BaseException) -> Response | None:
        """The 503 of a database that cannot store writes (:func:`storage_failure`; a
        read-only PostgreSQL was a 500), recorded for ``/readyz``; None for any other error."""
        if not svc_of(request).write_failed(exc):
            return None
        throttled.warning("db-storage", "the database cannot store writes (%s): answering 503", type(exc).__name__)
        return problem(503, "unavailable", f"the database cannot store writes ({storage_failure(exc)}); retry later",
                       request.url.path, headers={"Retry-After": RETRY_AFTER})

    @app.exception_handler(sa.exc.SQLAlchemyError)
    async def _database(request: Request, exc: sa.exc.SQLAlchemyError):
        if (refused := _cannot_store(request, exc)) is not None:
            return refused
        if _is_unavailable(exc):
            throttled.warning("db", "database unavailable or busy (%s): answering 503", type(exc).__name__)
            return problem(503, "unavailable", f"the database is unavailable or busy ({type(exc).__name__}); "
                                               "retry later", request.url.path, headers={"Retry-After": RETRY_AFTER})
        return _internal(request, exc)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        return _disconnected(request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return _internal(request, exc)

    async def _driver(request: Request, exc: Exception):
        """A database driver's error that reached here unwrapped (the store's raw cursors):
        a 503 when the database cannot store writes, else the 500 (without the generic
        handler's re-raise, whose traceback uvicorn logged once per request)."""
        return _cannot_store(request, exc) or _internal(request, exc)

    import sqlite3

    app.add_exception_handler(sqlite3.Error, _driver)
    with contextlib.suppress(ImportError):  # the postgres extra
        import psycopg

        app.add_exception_handler(psycopg.Error, _driver)

    async def body_of(request: Request, lease: Lease) -> bytes | Response:
        encoding = request.headers.get("content-encoding", "").strip().lower()
        # a gzip body read as JSON would be a 422 "invalid JSON at line 1"
        header, msg = (("content-encoding", f"Content-Encoding {encoding!r} is not supported: send the body "
                                            "uncompressed") if encoding not in ("", "identity")
                       else ("content-type", json_media_type_error(request.headers.get("content-type"))))
        if msg is not None:
            svc_of(request).metrics.rejected.labels("media_type").inc()
            return problem(415, "unsupported_media_type", msg, request.url.path, headers={"Connection": "close"},
                           errors=[{"field": header, "loc": ["header", header], "type": "media_type", "msg": msg}])
        try:
            return await read_body(request, settings.max_body_bytes, settings.body_timeout_seconds,
                                   settings.body_deadline_seconds, lease, settings.body_budget_wait_seconds)
        except BodyBudgetFull:
            lease.close()  # what a body without Content-Length took before it ran out of room
            limit = settings.body_budget_bytes
            throttled.warning("body-budget", "request bodies in flight reached %d bytes "
                                             "(AUDITOR_MAX_BODY_BYTES_IN_FLIGHT): answering 503", limit)
            return problem(503, "overloaded", f"more than {limit} bytes of request bodies in flight "
                                              "(AUDITOR_MAX_BODY_BYTES_IN_FLIGHT); retry later", request.url.path,
                           headers={"Retry-After": RETRY_AFTER, "Connection": "close"})
        except BodyTooLarge as e:
            svc_of(request).metrics.rejected.labels("body_too_large").inc()
            got = f"{e.size} bytes" if e.size is not None else "more"
            return problem(413, "too_large", f"request body larger than {settings.max_body_bytes} bytes "
                                             f"(AUDITOR_MAX_BODY_BYTES), got {got}; send smaller batches",
                           request.url.path, headers={"Connection": "close"},
                           errors=[{"field": "body", "loc": [], "type": "too_long",
                                    "msg": f"at most {settings.max_body_bytes} bytes"}])
        except BodyTimeout as e:
            svc_of(request).metrics.rejected.labels("body_timeout").inc()
            return problem(408, "request_timeout", str(e), request.url.path, headers={"Connection": "close"})
        except ClientDisconnect:
            return _disconnected(request)

    # ---------------------------------------------------------------- writes
    @app.post("/v1/reports", response_model=IngestResult, tags=["ingest"],
              summary="Store a batch of rank reports and audit the steps it completes")
    async def post_reports(request: Request):
        """Store a batch of rank reports and audit every step it completes.

        Body: ``{"reports": [Report, ...]}`` (DESIGN.md §3), 1 to ``max_batch`` reports,
        at most ``max_body_bytes``. All-or-nothing: 422 (``errors[].field`` names the
        field, e.g. ``reports[3].local.count``; ``limit_exceeded`` for the configured
        limits), 409 (``conflicting_report``, ``coordinate_conflict``, ``topology_conflict``,
        ``spec_conflict``; ``conflicts[].index`` lists the offending reports) and 413 store
        nothing. Identical re-sends are counted in ``duplicates``. 503 with Retry-After when
        the database is unavailable or busy. A late report that completes a step audited
        while incomplete re-audits it (counted in ``steps_audited``).
        """
        s = svc_of(request)
        t0 = time.perf_counter()
        # The body's bytes stay taken from the budget until the decoded batch is stored:
        # decoded, it is what costs memory (BODY_MEMORY_FACTOR).
        lease = Lease(s.body_budget)
        try:
            body = await body_of(request, lease)
            if isinstance(body, Response):
                return body
            parsed = await anyio.to_thread.run_sync(_parse_reports, body, settings, limiter=s.ingest_limiter)
            del body  # the decoded batch is all the ingest needs
            if isinstance(parsed, tuple):
                status, code, errs, n = parsed
                s.metrics.rejected.labels("batch_too_large" if status == 413 else "validation").inc(n)
                listed = field_errors(errs, settings.max_errors_listed)
                cut = len(listed) >= settings.max_errors_listed
                return problem(status, code,
                               summary(listed, len(listed)) + (" (validation stopped there)" if cut else ""),
                               request.url.path, errors=listed, errors_truncated=True if cut else None)
            out = await anyio.to_thread.run_sync(s.service.ingest, parsed, limiter=s.ingest_limiter)
            del parsed
        finally:
            lease.close()
        s.wrote()
        s.metrics.received.inc(out.accepted)
        s.metrics.ingest_duration.observe(time.perf_counter() - t0)
        return IngestResult(accepted=out.accepted, duplicates=out.duplicates, steps_audited=len(out.audited))

    @app.put("/v1/runs/{run_id}", tags=["ingest"], summary="Register a run's topology and statistics")
    async def put_run(request: Request, run_id: str = RunIdPath):
        """Register a run's topology (and statistic kinds/specs) before its first report.
        Body: :class:`auditor.schemas.RunRegistration`. Idempotent; 409
        ``topology_conflict``/``spec_conflict`` if it contradicts the stored one; 422 past
        ``max_statistics_per_run`` or ``max_world_size``."""
        s = svc_of(request)
        lease = Lease(s.body_budget)
        try:
            body = await body_of(request, lease)
            if isinstance(body, Response):
                return body
            parsed = await run_in_threadpool(_parse_run, body, settings)
            del body
            if isinstance(parsed, list):
                listed = field_errors(parsed, settings.max_errors_listed)
                return problem(422, "validation", summary(listed, len(parsed)), request.url.path, errors=listed)
            out = await anyio.to_thread.run_sync(lambda: _json(s.service.register_run(run_id, parsed)),
                                                 limiter=s.ingest_limiter)
            s.wrote()
            return Response(out, media_type="application/json")
        finally:
            lease.close()

    @app.delete("/v1/runs/{run_id}", tags=["runs"], summary="Delete a run with its reports and verdicts")
    async def delete_run(request: Request, run_id: str = RunIdPath):
        """Delete a run with its reports, verdicts and faults, in transactions of at most
        ``delete_chunk_rows`` reports (ingest of other runs goes on meanwhile). Answers the
        counts deleted: ``{"run_id", "reports", "steps", "statistics"}``; 404 if unknown."""
        s = svc_of(request)
        counts = await run_in_threadpool(s.service.delete_run, run_id, settings.delete_chunk_rows)
        s.wrote()
        log.info("deleted run %s: %s", run_id, counts)
        return counts

    # ---------------------------------------------------------------- reads
    async def read(fn: Callable[[], Any]) -> Response:
        return Response(await run_in_threadpool(lambda: _json(fn())), media_type="application/json")

    @app.get("/v1/runs", tags=["runs"], summary="List runs, newest first (paginated, by status)")
    async def list_runs(
        request: Request,
        limit: int = Query(100, ge=1, le=1000, description="Runs per page."),
        cursor: str | None = Query(None, max_length=1024, description="`next_cursor` of the previous page."),
        status: Literal["inconsistent", "unverified", "incomplete", "consistent", "pending"] | None = Query(
            None, description="Only runs of this status: inconsistent (some step inconsistent or audit_error), "
                              "unverified (none, but some step audited without a known layout: its groups could "
                              "not be checked), incomplete (neither, but some step audited with reports missing), "
                              "consistent (every audited step consistent) or pending (no step audited yet)."),
    ):
        """Runs, newest first: ``{"runs": [{run_id, world_size, sizes, created_at,
        last_activity, statistics, steps_audited, steps_inconsistent, steps_incomplete,
        steps_unverified, refused_reports, status, consistent}],
        "next_cursor": str | null}``. Pass ``next_cursor`` back as ``cursor`` for the next
        page (opaque; null on the last page). Times are Unix seconds."""
        s = svc_of(request)
        after = decode_cursor(cursor, runs_key)

        def page():
            rows, last = s.service.runs_page(limit=limit, after=after, status=status)
            return {"runs": rows, "next_cursor": encode_cursor(list(last)) if last else None}
        return await read(page)

    @app.get("/v1/runs/{run_id}", tags=["runs"], summary="One run's summary")
    async def get_run(request: Request, run_id: str = RunIdPath):
        """One run's summary; 404 if unknown."""
        s = svc_of(request)
        return await read(lambda: s.service.get_run(run_id))

    @app.get("/v1/runs/{run_id}/report", tags=["runs"],
             summary="Consistency report of a run: verdicts, faults, bad steps' rank tables")
    async def get_report(
        request: Request,
        run_id: str = RunIdPath,
        statistic: str | None = Query(None, min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
        bad_steps: int = Query(20, ge=0, le=1000, description="Bad steps shown per statistic."),
        rank_rows: int = Query(
            REPORT_RANK_ROWS, ge=0, le=REPORT_ROWS_BUDGET,
            description="Rows of each bad step's per-rank table: the ranks its faults name first, then the rest "
                        f"in rank order (at most {REPORT_ROWS_BUDGET} rows over the whole report; the full table: "
                        "GET .../steps/{step})."),
    ):
        """Consistency report: per statistic, steps audited/consistent/inconsistent/incomplete/
        audit_error/pending/reaudited, first and last bad step, fault counts by kind, the
        latest sigma figures, and for up to ``bad_steps`` bad steps their faults, verdict
        history (``previous_verdict``, ``verdict_changed_at``) and per-rank table (rank,
        coords, local count and mean, applied mean/std, correct mean/std, error in σ).
        ``consistent`` is false when any step is inconsistent or could not be audited.
        Bounded whatever the world: each bad step shows at most ``rank_rows`` rows (the
        faulted ranks first) with ``ranks_total`` and ``ranks_truncated``, each fault at most
        1024 ranks (``ranks_total``, ``ranks_truncated``); ``bad_steps`` × ``rank_rows`` beyond
        16,384 gives each step an equal share."""
        s = svc_of(request)
        page = str(request.url_for("run_page", run_id=run_id))
        return await read(lambda: {**s.service.report(run_id, bad_steps_limit=bad_steps, statistic=statistic,
                                                      rank_rows=rank_rows), "page": page})

    # ``{statistic:path}`` in both step routes: statistic names may hold "/" ("policy/grad_norm",
    # sent as policy%2Fgrad_norm or policy/grad_norm; the ASGI path is decoded either way),
    # which the default converter would not match (404). Unambiguous: ".../steps" ends the
    # listing, ".../steps/<int>" the detail; a name's parts are never empty, "." or ".."
    # (schemas.addressable).
    @app.get("/v1/runs/{run_id}/statistics/{statistic:path}/steps", tags=["steps"],
             summary="Step history of one statistic (paginated, by verdict)")
    async def get_steps(
        request: Request,
        run_id: str = RunIdPath,
        statistic: str = Path(min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
        start: int | None = Query(None, alias="from", ge=0, le=2**62, description="First step (inclusive)."),
        stop: int | None = Query(None, alias="to", ge=0, le=2**62, description="Last step (inclusive)."),
        verdict: Literal["consistent", "inconsistent", "incomplete", "audit_error", "unverified", "pending"] | None = Query(
            None, description="Only steps with this verdict (pending: not audited yet)."),
        limit: int = Query(1000, ge=1, le=10_000, description="Steps per page."),
        cursor: str | None = Query(None, max_length=1024, description="`next_cursor` of the previous page."),
    ):
        """Step history of one statistic, in step order, from the stored per-step rows (no
        re-audit): ``{"run_id", "statistic", "kind", "steps": [{step, verdict, reports,
        expected, cp_disagreement_sigma, applied_error_sigma, tolerance_sigma, fault_kinds,
        audited_at}], "next_cursor"}``. σ figures are in standard deviations of the correct
        statistic (``moments`` only; null for ``sum``/``norm``); ``tolerance_sigma`` is the
        most a correct reduction's rounding can show. 404 for an unknown run or statistic."""
        s = svc_of(request)
        after = decode_cursor(cursor, step_key)

        def page():
            out = s.service.steps(run_id, statistic, start=start, stop=stop, verdict=verdict, limit=limit,
                                  after=after)
            last = out.pop("last")
            return {**out, "next_cursor": encode_cursor(last) if last is not None else None}
        return await read(page)

    @app.get("/v1/runs/{run_id}/statistics/{statistic:path}/steps/{step}", tags=["steps"],
             summary="One step's verdict, faults and per-rank table (paginated)")
    async def get_step(request: Request, run_id: str = RunIdPath,
                       statistic: str = Path(min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
                       step: int = Path(ge=0, le=2**62),
                       limit: int = Query(STEP_RANK_ROWS, ge=1, le=STEP_RANK_ROWS_MAX,
                                          description="Rank rows per page."),
                       cursor: str | None = Query(None, max_length=1024,
                                                  description="`next_cursor` of the previous page.")):
        """One step's verdict (and the one a re-audit replaced), faults (every rank) and
        per-rank table in (rank, microbatch) order, ``limit`` rows a page: ``ranks_total``
        rows in all, ``ranks_truncated`` and ``next_cursor`` set when more follow; 404 if not
        seen."""
        s = svc_of(request)
        after = decode_cursor(cursor, rank_key)

        def page():
            out = s.service.step(run_id, statistic, step, limit=limit, after=after)
            last = out.pop("last")
            return {**out, "next_cursor": encode_cursor(list(last)) if last is not None else None}
        return await read(page)

    # ---------------------------------------------------------------- HTML pages
    from auditor import web

    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(web.plotly_js_path(), media_type="text/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})

    app.mount("/static", StaticFiles(directory=web.STATIC_DIR), name="static")

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_form(request: Request, next: str = "/") -> HTMLResponse:
        """The sign-in form of the pages when a token protects reads."""
        return HTMLResponse(web.render_login(next=_local_path(next), root_path=request.scope.get("root_path", "")))

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        """Check the token of the sign-in form (the read token or the service token); keep it in
        an HttpOnly, SameSite=Strict cookie that GET/HEAD requests of this browser are
        authorised with, and go back to the page asked for (303). Wrong token: the form again, 401.
        After ``login_max_failures`` wrong tokens from one client address within
        ``login_failure_window_seconds``, every sign-in of that address is the form again with a
        429 and Retry-After until the window ends (the token is not even compared). A body over ``LOGIN_BODY_BYTES`` (8 KiB) + 3 bytes per character of the longest token is
        a 413 ``too_large`` as soon as it is declared or received (the rest is never read); a
        body that stalls is a 408, as on the write endpoints."""
        limit = LOGIN_BODY_BYTES + 3 * max((len(t) for t in (settings.read_token, settings.token) if t), default=0)
        throttle = svc_of(request).login_failures
        client = request.client.host if request.client else "?"
        root = request.scope.get("root_path", "")
        wait = throttle.blocked(client)
        if wait > 0:
            throttled.warning("login", "more than %d wrong tokens at POST /login from %s within %g s "
                                       "(AUDITOR_LOGIN_MAX_FAILURES): answering 429", throttle.limit, client,
                              throttle.window)
            return HTMLResponse(web.render_login(
                next="/", root_path=root,
                error=f"Too many wrong tokens from this address: try again in {math.ceil(wait)} s."),
                status_code=429, headers={"Retry-After": str(math.ceil(wait)), "Connection": "close"})
        try:
            body = await read_body(request, limit, settings.body_timeout_seconds, settings.body_deadline_seconds)
        except BodyTooLarge as e:
            got = f"{e.size} bytes" if e.size is not None else "more"
            return problem(413, "too_large", f"sign-in form larger than {limit} bytes, got {got}",
                           request.url.path, headers={"Connection": "close"},
                           errors=[{"field": "body", "loc": [], "type": "too_long", "msg": f"at most {limit} bytes"}])
        except BodyTimeout as e:
            return problem(408, "request_timeout", str(e), request.url.path, headers={"Connection": "close"})
        except ClientDisconnect:
            return _disconnected(request)
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0]
        target = _local_path((form.get("next") or ["/"])[0])
        known = [t for t in (settings.read_token, settings.token) if t]
        if known and not any(hmac.compare_digest(token.encode(), t.encode()) for t in known):
            throttle.failed(client)
            return HTMLResponse(web.render_login(next=target, error="That is not this auditor's token.",
                                                 root_path=root), status_code=401)
        throttle.succeeded(client)
        response = RedirectResponse(root + target, status_code=303)
        if known:
            response.set_cookie(TOKEN_COOKIE, urllib.parse.quote(token, safe=""), httponly=True, samesite="strict",
                                secure=request.url.scheme == "https", path=root or "/")
        return response

    @app.get("/runbook", response_class=HTMLResponse, include_in_schema=False)
    def runbook(request: Request) -> HTMLResponse:
        """The alert runbook (docs/alerts.md): where every alert's runbook_url points."""
        return HTMLResponse(web.render_runbook(root_path=request.scope.get("root_path", "")))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def runs_page(
        request: Request,
        cursor: str | None = Query(None, max_length=1024),
        status: Literal["inconsistent", "unverified", "incomplete", "consistent", "pending"] | None = None,
    ) -> HTMLResponse:
        s = svc_of(request)
        after = decode_cursor(cursor, runs_key)
        rows, last = s.service.runs_page(limit=100, after=after, status=status)
        return HTMLResponse(web.render_runs_page(rows, next_cursor=encode_cursor(list(last)) if last else None,
                                                 status=status, root_path=request.scope.get("root_path", "")))

    @app.get("/runs/{run_id}", response_class=HTMLResponse, name="run_page", include_in_schema=False)
    def run_page(
        request: Request,
        run_id: str = RunIdPath,
        statistic: str | None = Query(None, min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
        step: int | None = Query(None, ge=0, le=2**62),
        from_rank: int = Query(0, ge=0, le=2**31 - 1),
        from_mb: int = Query(0, ge=0, le=2**31 - 1),
    ) -> Response:
        """The run page: verdict counts, σ per step, faults per step, per-rank detail of the
        bad steps (``?statistic=&step=`` selects one; its table shows
        :data:`auditor.web.PAGE_RANK_ROWS` rows from ``from_rank``/``from_mb`` on). At most
        ``max_concurrent_pages`` render at once per process (each streams the run's step
        summaries, so it holds a few MB whatever the run's length); past it a 503 with
        Retry-After."""
        s = svc_of(request)
        if not s.page_slots.acquire(blocking=False):
            limit = settings.max_concurrent_pages
            throttled.warning("pages", "more than %d run pages rendering (AUDITOR_MAX_CONCURRENT_PAGES): "
                                       "answering 503", limit)
            return problem(503, "overloaded", f"more than {limit} run pages rendering at once "
                                              "(AUDITOR_MAX_CONCURRENT_PAGES); retry later", request.url.path,
                           headers={"Retry-After": RETRY_AFTER})
        try:
            page = web.gather_run_page(PageReads(s.service), run_id, statistic=statistic, step=step,
                                       from_row=(from_rank, from_mb) if (from_rank, from_mb) != (0, 0) else None)
            return HTMLResponse(web.render_run_page(**page, root_path=request.scope.get("root_path", "")))
        finally:
            s.page_slots.release()

    @app.get("/healthz", tags=["operations"], summary="Liveness (no database, no token)")
    async def healthz(request: Request):
        """Liveness, answered on the event loop (no thread, no database): 200 while the
        process serves, in milliseconds however busy ingest is. ``database`` is the
        result of the last background probe (see ``/readyz``)."""
        s = svc_of(request)
        ok, message, at = s.database
        return {"status": "ok", "version": __version__, "schema_revision": s.schema_revision,
                "database": "ok" if ok else message, "database_checked_s_ago": round(time.monotonic() - at, 1)}

    @app.get("/readyz", tags=["operations"], summary="Readiness: the database answers and stores writes")
    async def readyz(request: Request):
        """Readiness: 200 when the last database probe (every few seconds, off the request
        path) succeeded and writes are stored; else 503 problem details with Retry-After:
        the database does not answer, or writes fail because it cannot store them (disk
        full, I/O error, read-only) — until a write succeeds again (the probe tries one
        every period meanwhile)."""
        s = svc_of(request)
        ok, message, _ = s.database
        if not ok:
            return problem(503, "unavailable", f"database: {message}", "/readyz", headers={"Retry-After": RETRY_AFTER})
        if s.write_failure is not None:
            what, since = s.write_failure
            return problem(503, "unavailable", f"database: writes fail (for {time.monotonic() - since:.0f} s): {what}",
                           "/readyz", headers={"Retry-After": RETRY_AFTER})
        return {"status": "ok"}

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    def metrics(request: Request) -> Response:
        """Prometheus exposition (DESIGN.md §6)."""
        return Response(generate_latest(svc_of(request).registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app, settings)
    return app


# ------------------------------------------------------------------ OpenAPI
#: Error statuses each operation declares (besides 401/403 when a token is configured).
_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/reports"): (408, 409, 413, 415, 422, 503),
    ("put", "/v1/runs/{run_id}"): (408, 409, 413, 415, 422, 503),
    ("delete", "/v1/runs/{run_id}"): (404, 422, 503),
    ("get", "/v1/runs"): (422, 503),
    ("get", "/v1/runs/{run_id}"): (404, 422, 503),
    ("get", "/v1/runs/{run_id}/report"): (404, 422, 503),
    ("get", "/v1/runs/{run_id}/statistics/{statistic}/steps"): (404, 422, 503),
    ("get", "/v1/runs/{run_id}/statistics/{statistic}/steps/{step}"): (404, 422, 503),
    ("get", "/readyz"): (503,),
    ("get", "/metrics"): (503,),
}
_BODIES = {("post", "/v1/reports"): ReportBatch, ("put", "/v1/runs/{run_id}"): RunRegistration}
_STATUS_TEXT = {401: "Missing or wrong bearer token", 403: "Read-only token used for a write",
                404: "Not found", 408: "Body not received in time", 409: "Conflicts with what is stored",
                413: "Body or batch too large", 415: "Content-Type is not application/json",
                422: "Validation failed (errors[] names each field)",
                503: "Database unavailable/busy or too many requests in progress; see Retry-After"}


def _openapi(app: FastAPI, settings: Settings) -> dict:
    """The OpenAPI document: request-body schemas of the endpoints that read their body
    themselves (after the token check), problem-details error responses on every operation,
    and the bearer security scheme."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes,
                      tags=app.openapi_tags)
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for model in (Problem, ReportBatch, RunRegistration):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        comps[model.__name__] = js
    ref = {"schema": {"$ref": "#/components/schemas/Problem"}}
    protected = bool(settings.token or settings.read_token)
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = list(_ERRORS.get((method, path), ()))
            public = path in ALWAYS_OPEN or (settings.public_endpoints and path in PUBLIC_PATHS)
            if protected and not public:
                codes += [401] + ([403] if method not in ("get", "head") else [])
                op["security"] = [{"bearer": []}]
            for code in sorted(set(codes)):
                responses[str(code)] = {"description": _STATUS_TEXT[code], "content": {MEDIA_TYPE: ref}}
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text exposition format 0.0.4",
                                    "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}
            model = _BODIES.get((method, path))
            if model is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = doc
    return doc


#: Cyclic-GC thresholds of a service process. Validating and storing a batch allocates
#: ~10 objects per report that live until the transaction ends; with the default (700, 10,
#: 10) they are promoted and full collections walk the whole heap again and again (35% of
#: the ingest CPU in the profile, docs/performance.md). The ingest path makes few reference
#: cycles; they are still collected, only later.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Move everything allocated at start-up (modules, SQLAlchemy, pydantic schemas) out of
    the collector's reach (``gc.freeze``) and raise the thresholds to :data:`GC_THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _local_path(target: str) -> str:
    """``target`` if it is a path of this site ("/runs/x?step=3"), else "/" (no open redirect
    to another host through ``next``)."""
    return target if target.startswith("/") and not target.startswith("//") and "\\" not in target else "/"


def encode_cursor(value: Any) -> str:
    """An opaque pagination cursor: the keyset position as URL-safe base64 of compact JSON."""
    return base64.urlsafe_b64encode(json.dumps(value, separators=(",", ":")).encode()).decode().rstrip("=")


#: The largest step (the wire's bound, auditor.schemas): a steps cursor holds a step.
MAX_STEP = 2**62
_RUN_ID_RE = re.compile(RUN_ID_PATTERN)


def step_key(v: Any) -> int:
    """The keyset position of a steps cursor: a step, an integer in [0, :data:`MAX_STEP`].
    Anything else raises ValueError (a value outside the column's range reached the
    database before: OverflowError on SQLite, DataError on PostgreSQL, a 500)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP:
        raise ValueError(f"not a step: {v!r}")
    return v


def rank_key(v: Any) -> tuple[int, int]:
    """The keyset position of a step's rank-rows cursor: ``[rank, microbatch]``, two
    non-negative integers. Anything else raises ValueError."""
    if (not isinstance(v, list) or len(v) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_STEP for x in v)):
        raise ValueError(f"not a rank position: {v!r}")
    return v[0], v[1]


def runs_key(v: Any) -> tuple[float, str]:
    """The keyset position of a runs cursor: ``[created_at, run_id]``, a finite number and a
    run id of the wire's pattern. Anything else raises ValueError (a NUL or a lone
    surrogate in the run id, or a number beyond float range, failed in the driver: a 500)."""
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError("not [created_at, run_id]")
    at, run_id = v
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        raise ValueError(f"not a time: {at!r}")
    at = float(at)  # OverflowError for an integer beyond float range
    if not math.isfinite(at):
        raise ValueError(f"not a time: {at!r}")
    if not isinstance(run_id, str) or len(run_id) > 128 or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    return at, run_id


def decode_cursor(cursor: str | None, parse) -> Any:
    """The position of :func:`encode_cursor`'s ``cursor`` (``parse`` checks its shape and the
    range of each value: :func:`step_key`, :func:`runs_key`); a cursor that is not one of
    ours is a 422 naming ``cursor``, never a query with its values."""
    if not cursor:  # absent, or empty (`?cursor=`: the first page)
        return None
    try:
        return parse(json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))))
    except (ValueError, TypeError, IndexError, KeyError, RecursionError, OverflowError, binascii.Error):
        raise RequestValidationError([{"loc": ("query", "cursor"), "type": "value_error", "input": cursor,
                                       "msg": "not a cursor of this listing: pass back the next_cursor of the "
                                              "previous page unchanged"}]) from None


async def _sweep_forever(svc: AppState) -> None:
    """Every ``sweep_interval_seconds``: one bounded sweep round, then (with
    ``run_retention_days``) the deletion of a few idle runs, in bounded chunks."""
    st = svc.settings
    while True:
        await asyncio.sleep(st.sweep_interval_seconds)
        try:
            n = await run_in_threadpool(svc.service.sweep, st.grace_seconds, None, st.sweep_max_steps,
                                        st.sweep_max_seconds)
            if n:
                log.info("sweep audited %d step(s)", n)
            if st.run_retention_days > 0:
                for run_id in await run_in_threadpool(svc.service.idle_runs, st.run_retention_days * 86400.0, None, 5):
                    counts = await run_in_threadpool(svc.service.delete_run, run_id, st.delete_chunk_rows)
                    log.info("retention: deleted run %s idle for over %s days: %s", run_id,
                             st.run_retention_days, counts)
        except NotFound:
            pass  # a run deleted by another replica meanwhile
        except Exception as exc:  # keep sweeping; the next round retries
            if svc.write_failed(exc):
                throttled.warning("sweep-storage", "sweep: the database cannot store writes (%s); retrying next round",
                                  storage_failure(exc))
            elif _is_unavailable(exc):
                throttled.warning("sweep-db", "sweep: database unavailable or busy (%s); retrying next round",
                                  type(exc).__name__)
            else:
                log.exception("sweep failed")


#: Name of the thread of a database probe (:func:`_probe_forever`); at most one is alive.
PROBE_THREAD = "auditor-db-probe"


async def _probe_forever(svc: AppState) -> None:
    """Probe the database every ``probe_interval_seconds``, for ``/readyz`` and ``/healthz``,
    in a thread of its own named :data:`PROBE_THREAD` (not a request thread). A probe
    without an answer after ``probe_timeout_seconds`` counts as a failure and is abandoned;
    while its thread is still waiting on the database, no new probe starts (each period
    reports how long it has been waiting), so a hung database holds one probe thread and
    one pooled connection, not one more every period.

    Not ``asyncio.wait_for``: up to Python 3.11 it swallows a cancellation that arrives as
    the awaited future completes, and this loop then never ended: the lifespan shutdown
    waited for it forever (``auditor serve`` on a taken port hung, deaf to SIGTERM)."""
    loop = asyncio.get_running_loop()
    every, timeout = svc.settings.probe_interval_seconds, svc.settings.probe_timeout_seconds
    thread: threading.Thread | None = None
    started = 0.0
    while True:
        if thread is not None and thread.is_alive():
            waited = time.monotonic() - started
            svc.database = (False, f"TimeoutError: the database probe has been waiting {waited:.0f} s for an "
                                   "answer", time.monotonic())
        else:
            answer = loop.create_future()
            started = time.monotonic()
            write = svc.write_failure is not None
            thread = threading.Thread(target=_probe, args=(svc.engine, loop, answer, write), name=PROBE_THREAD,
                                      daemon=True)
            thread.start()
            try:
                with anyio.fail_after(timeout):
                    ok, message, failed = await asyncio.shield(answer)
                svc.database = (ok, message, time.monotonic())
                if write and ok:
                    if failed is None:
                        svc.wrote()
                    else:
                        svc.write_failed(failed)
            except TimeoutError:
                svc.database = (False, f"TimeoutError: the database did not answer the probe within {timeout:g} s",
                                time.monotonic())
        await asyncio.sleep(every)


def _probe(engine: sa.Engine, loop: asyncio.AbstractEventLoop, answer: asyncio.Future, write: bool) -> None:
    """One probe (in :data:`PROBE_THREAD`): ``(ok, message, write error)`` handed to
    ``answer`` on ``loop``. With ``write`` (writes have been failing) it also commits a
    write that changes nothing (the schema revision set to itself) and hands over the
    database error it raised, if any (else None): tried only then, so a
    probe never competes with ingest for the write lock while writes succeed."""
    failed = None
    try:
        current_revision(engine)
        result = (True, "ok")
        if write:
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("UPDATE alembic_version SET version_num = version_num"))
            except sa.exc.SQLAlchemyError as exc:  # a storage failure, or a lock: not cleared either way
                failed = exc
    except Exception as exc:  # noqa: BLE001 - reported by /readyz
        result = (False, f"{type(exc).__name__}: {str(exc)[:200]}")
    result = (*result, failed)
    with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
        loop.call_soon_threadsafe(_settle, answer, result)


def _settle(answer: asyncio.Future, result: tuple) -> None:
    if not answer.done():
        answer.set_result(result)


async def _stop(tasks: list[asyncio.Task], timeout: float) -> None:
    """Cancel the background tasks and wait at most ``timeout`` s for them (a sweep round
    in its thread finishes first): the shutdown never waits on a task forever."""
    for t in tasks:
        t.cancel()
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        log.warning("background task %s did not stop within %.0f s of the shutdown; leaving it",
                    t.get_coro().__name__, timeout)
