"""The app's state (one :class:`AppState` per app, made by the lifespan) and the named
dependencies routes declare instead of reaching into ``request.app.state``:
:data:`StateDep` (the state: settings, the service, metrics, budgets), :data:`SettingsDep`,
:data:`ClientDep` (the caller's address) and :data:`RootPathDep` (the prefix a proxy mounts
the service under)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Annotated, Any, Callable

import anyio
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from auditor.config import Settings
from auditor.contract.documents import ReadDocument
from auditor.db.engine import current_revision, ensure_schema, make_engine
from auditor.db.errors import storage_failure
from auditor.server.budget import BodyBudget
from auditor.server.limits import FailureThrottle
from auditor.server.metrics import scrape_registry
from auditor.service import Service

log = logging.getLogger("auditor.api")


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
        #: Request-body bytes in flight (AUDITOR_MAX_BODY_BYTES_IN_FLIGHT):
        #: :func:`~auditor.server.bodies.read_body` takes them, the endpoint that read the body
        #: gives them back when it is done.
        self.body_budget = BodyBudget(settings.body_budget_bytes, on_change=self.metrics.body_bytes.set)
        self.metrics.body_bytes.set(0)
        #: Wrong tokens per client address at POST /login (AUDITOR_LOGIN_MAX_FAILURES).
        self.login_failures = FailureThrottle(settings.login_max_failures, settings.login_failure_window_seconds)
        #: Last database probe (:mod:`auditor.server.background`): (ok, message, monotonic time).
        self.database: tuple[bool, str, float] = (True, "ok", time.monotonic())
        #: Since when writes fail because the database cannot store them (disk full, I/O
        #: error, read-only; :func:`auditor.db.errors.storage_failure`): (message, monotonic
        #: time), None while they succeed. ``/readyz`` is 503 meanwhile; the next write that succeeds (a
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

    async def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Response:
        """``fn(*args, **kwargs)``'s document as a JSON response, computed and encoded in a
        worker thread (never on the event loop)."""
        return Response(await run_in_threadpool(lambda: json_bytes(fn(*args, **kwargs))),
                        media_type="application/json")

    def close(self) -> None:
        self.engine.dispose()


def json_bytes(data: Any) -> bytes:
    """JSON bytes of a read's answer (rendered in a worker thread, not on the event loop): a
    read document (:mod:`auditor.contract.reads`) as its ``to_json()``, else ``data`` as is."""
    if isinstance(data, ReadDocument):
        data = data.to_json()
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def state_of(request: Request) -> AppState:
    """The state of the app serving ``request`` (set by the lifespan)."""
    return request.app.state.svc


async def app_state(request: Request) -> AppState:
    """Dependency: the app's :class:`AppState` (async: answered on the event loop, no thread)."""
    return request.app.state.svc


async def app_settings(request: Request) -> Settings:
    """Dependency: the app's settings."""
    return request.app.state.svc.settings


async def client_address(request: Request) -> str:
    """Dependency: the caller's address ("?" when the server does not know it)."""
    return request.client.host if request.client else "?"


async def root_path(request: Request) -> str:
    """Dependency: the path prefix the service is mounted under (``--root-path``), "" if none."""
    return request.scope.get("root_path", "")


StateDep = Annotated[AppState, Depends(app_state)]
SettingsDep = Annotated[Settings, Depends(app_settings)]
ClientDep = Annotated[str, Depends(client_address)]
RootPathDep = Annotated[str, Depends(root_path)]
