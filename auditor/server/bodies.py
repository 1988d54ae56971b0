"""Request bodies: read while they stream in, within the limits (size, time, the budget of
bytes in flight), decoded and validated in a worker thread, and every way a body is refused
(413, 408, 415, 422, 503) worded with the setting that decides it."""

from __future__ import annotations

import logging
import time

import anyio
import pydantic_core
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from auditor.config import Settings
from auditor.contract.models import RunRegistration
from auditor.contract.parse import limit_errors, parse_report_batch
from auditor.server.budget import Lease
from auditor.server.limits import throttled
from auditor.server.problems import RETRY_AFTER, problem
from auditor.server.state import AppState

log = logging.getLogger("auditor.api")


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


def disconnected(request: Request) -> Response:
    """A client went away before its request body was complete: one INFO line, no
    traceback, nothing stored (the response goes nowhere)."""
    log.info("client %s disconnected before sending the whole body of %s %s; nothing stored",
             request.client.host if request.client else "?", request.method, request.url.path)
    return Response(status_code=400, headers={"Connection": "close"})


async def read_json_body(request: Request, state: AppState, lease: Lease) -> bytes | Response:
    """The body of a write (``POST /v1/reports``, ``PUT /v1/runs/{run_id}``) read by
    :func:`read_body` within the settings' limits, its bytes taken from ``lease``; or the
    answer that refuses it: 415 (not JSON, or compressed), 503 (no room in the budget of
    bytes in flight), 413 (too large), 408 (too slow), 400 (the client went away)."""
    settings = state.settings
    encoding = request.headers.get("content-encoding", "").strip().lower()
    # a gzip body read as JSON would be a 422 "invalid JSON at line 1"
    header, msg = (("content-encoding", f"Content-Encoding {encoding!r} is not supported: send the body "
                                        "uncompressed") if encoding not in ("", "identity")
                   else ("content-type", json_media_type_error(request.headers.get("content-type"))))
    if msg is not None:
        state.metrics.rejected.labels("media_type").inc()
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
        state.metrics.rejected.labels("body_too_large").inc()
        got = f"{e.size} bytes" if e.size is not None else "more"
        return problem(413, "too_large", f"request body larger than {settings.max_body_bytes} bytes "
                                         f"(AUDITOR_MAX_BODY_BYTES), got {got}; send smaller batches",
                       request.url.path, headers={"Connection": "close"},
                       errors=[{"field": "body", "loc": [], "type": "too_long",
                                "msg": f"at most {settings.max_body_bytes} bytes"}])
    except BodyTimeout as e:
        state.metrics.rejected.labels("body_timeout").inc()
        return problem(408, "request_timeout", str(e), request.url.path, headers={"Connection": "close"})
    except ClientDisconnect:
        return disconnected(request)


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
    the configured limit (``limit_exceeded``), as :func:`auditor.contract.parse.limit_errors` words
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


def parse_reports(body: bytes, settings: Settings) -> list | tuple[int, str, list[dict], int]:
    """Decode and validate a ``POST /v1/reports`` body (in a worker thread): the reports,
    or ``(status, code, field errors, number of reports)`` for a 413/422. A valid body is
    decoded by msgspec, any other validated by the pydantic models, whose errors are the 422
    (:func:`auditor.contract.parse.parse_report_batch`); at most ``max_errors_listed`` are collected."""
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


def parse_run(body: bytes, settings: Settings) -> RunRegistration | list[dict]:
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
