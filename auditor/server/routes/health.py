"""What orchestrators and Prometheus ask: ``/healthz`` (liveness, on the event loop),
``/readyz`` (the database answers and stores writes, from the background probe:
:mod:`auditor.server.background`) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from auditor import __version__
from auditor.server.problems import RETRY_AFTER, problem
from auditor.server.state import StateDep

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="Liveness (no database, no token)")
async def healthz(state: StateDep):
    """Liveness, answered on the event loop (no thread, no database): 200 while the
    process serves, in milliseconds however busy ingest is. ``database`` is the
    result of the last background probe (see ``/readyz``)."""
    ok, message, at = state.database
    return {"status": "ok", "version": __version__, "schema_revision": state.schema_revision,
            "database": "ok" if ok else message, "database_checked_s_ago": round(time.monotonic() - at, 1)}


@router.get("/readyz", summary="Readiness: the database answers and stores writes")
async def readyz(state: StateDep):
    """Readiness: 200 when the last database probe (every few seconds, off the request
    path) succeeded and writes are stored; else 503 problem details with Retry-After:
    the database does not answer, or writes fail because it cannot store them (disk
    full, I/O error, read-only) — until a write succeeds again (the probe tries one
    every period meanwhile)."""
    ok, message, _ = state.database
    if not ok:
        return problem(503, "unavailable", f"database: {message}", "/readyz", headers={"Retry-After": RETRY_AFTER})
    if state.write_failure is not None:
        what, since = state.write_failure
        return problem(503, "unavailable", f"database: writes fail (for {time.monotonic() - since:.0f} s): {what}",
                       "/readyz", headers={"Retry-After": RETRY_AFTER})
    return {"status": "ok"}


@router.get("/metrics", summary="Prometheus metrics")
def metrics(state: StateDep) -> Response:
    """Prometheus exposition (DESIGN.md §6)."""
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
