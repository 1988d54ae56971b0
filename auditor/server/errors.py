"""Every exception a request can end with, and its problem (:mod:`auditor.server.problems`):
one table, :data:`PROBLEMS`, installed on the app by :func:`install`.

    exception                          status  code                      wording
    ConflictError                      409     conflict's own code       the conflict's message, conflicts[]
    LimitError                         422     limit_exceeded            the limit and its setting
    Contended                          503     contended                 "...; retry later" + Retry-After
    RequestValidationError             422     validation                first field error (+ n more), errors[]
    NotFound                           404     not_found                 "not found: <what>"
    HTTPException (routing)            its     not_found, method_not_allowed (Allow: every method), ...
    DatabaseError (SQLAlchemy)         503     unavailable               cannot store writes / unavailable or busy
                                       500     internal                  anything else
    a driver's error (sqlite3, psycopg) 503/500 as DatabaseError (storage failures only)
    ClientDisconnect                   400     (no body)                 one INFO line
    Exception                          500     internal                  the type; the log has the trace

What the database error means is :func:`auditor.db.errors.classify`'s (the server names no
SQLAlchemy); a storage failure is also recorded for ``/readyz`` (:meth:`AppState.write_failed`).
"""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from auditor.db.errors import DRIVER_ERRORS, DatabaseError, classify, storage_failure
from auditor.server.bodies import disconnected
from auditor.server.limits import throttled
from auditor.server.problems import RETRY_AFTER, field_errors, problem, summary
from auditor.server.state import state_of
from auditor.service import ConflictError, Contended, LimitError, NotFound

log = logging.getLogger("auditor.api")


def internal(request: Request, exc: BaseException) -> Response:
    """The 500 of an unexpected error, its trace in the log (never in the answer)."""
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem(500, "internal", f"internal error ({type(exc).__name__}); the service log has the trace",
                   request.url.path)


async def _conflict(request: Request, exc: ConflictError) -> Response:
    state_of(request).metrics.rejected.labels(exc.error).inc(max(1, len(exc.conflicts)))
    return problem(409, exc.error, exc.message, request.url.path, conflicts=exc.conflicts)


async def _limit(request: Request, exc: LimitError) -> Response:
    state_of(request).metrics.rejected.labels("limit_exceeded").inc()
    errs = [{"field": exc.field, "loc": exc.loc, "msg": exc.message, "type": "limit_exceeded"}]
    return problem(422, "limit_exceeded", exc.message, request.url.path, errors=errs)


async def _contended(request: Request, exc: Contended) -> Response:
    throttled.warning("contended", "%s: answering 503", exc)
    return problem(503, "contended", f"{exc}; retry later", request.url.path, headers={"Retry-After": RETRY_AFTER})


async def _invalid(request: Request, exc: RequestValidationError) -> Response:
    """Body, path and query errors in the same shape as ``POST /v1/reports``'s."""
    errs = field_errors(list(exc.errors()), state_of(request).settings.max_errors_listed, strip_body=True)
    return problem(422, "validation", summary(errs, len(exc.errors())), request.url.path, errors=errs)


async def _not_found(request: Request, exc: NotFound) -> Response:
    return problem(404, "not_found", f"not found: {exc}", request.url.path)


async def _http(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}.get(exc.status_code, "bad_request")
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # every method of the path, not only those of the route that matched first
        allowed = sorted({m for route in iter_route_contexts(request.app.routes)
                          if route.matches(request.scope)[0] != Match.NONE
                          for m in getattr(route, "methods", None) or ()})
        headers["Allow"] = ", ".join(allowed)
    return problem(exc.status_code, code, str(exc.detail), request.url.path, headers=headers or None)


def _cannot_store(request: Request, exc: BaseException) -> Response | None:
    """The 503 of a database that cannot store writes (a read-only PostgreSQL was a 500),
    recorded for ``/readyz``; None for any other error."""
    if not state_of(request).write_failed(exc):
        return None
    throttled.warning("db-storage", "the database cannot store writes (%s): answering 503", type(exc).__name__)
    return problem(503, "unavailable", f"the database cannot store writes ({storage_failure(exc)}); retry later",
                   request.url.path, headers={"Retry-After": RETRY_AFTER})


async def _database(request: Request, exc: Exception) -> Response:
    if (refused := _cannot_store(request, exc)) is not None:
        return refused
    if classify(exc) == "unavailable":
        throttled.warning("db", "database unavailable or busy (%s): answering 503", type(exc).__name__)
        return problem(503, "unavailable", f"the database is unavailable or busy ({type(exc).__name__}); "
                                           "retry later", request.url.path, headers={"Retry-After": RETRY_AFTER})
    return internal(request, exc)


async def _driver(request: Request, exc: Exception) -> Response:
    """A database driver's error that reached here unwrapped (the store's raw cursors):
    a 503 when the database cannot store writes, else the 500 (without the generic
    handler's re-raise, whose traceback uvicorn logged once per request)."""
    return _cannot_store(request, exc) or internal(request, exc)


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    return disconnected(request)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return internal(request, exc)


#: Exception -> the handler that answers its problem (the table of the module docstring).
PROBLEMS: dict[type[BaseException], Callable[[Request, Exception], object]] = {
    ConflictError: _conflict,
    LimitError: _limit,
    Contended: _contended,
    RequestValidationError: _invalid,
    NotFound: _not_found,
    StarletteHTTPException: _http,
    DatabaseError: _database,
    **dict.fromkeys(DRIVER_ERRORS, _driver),
    ClientDisconnect: _client_gone,
    Exception: _unexpected,
}


def install(app: FastAPI) -> None:
    """Register every handler of :data:`PROBLEMS` on ``app``."""
    for exc_type, handler in PROBLEMS.items():
        app.add_exception_handler(exc_type, handler)
