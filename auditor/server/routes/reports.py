"""The writes: ``POST /v1/reports`` (ingest a batch), ``PUT /v1/runs/{run_id}`` (register a
run) and ``DELETE /v1/runs/{run_id}``. Each reads its body itself (after the token check,
within the body limits: :mod:`auditor.server.bodies`) and decodes it in a worker thread."""

from __future__ import annotations

import logging
import time

import anyio
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from auditor.contract.models import IngestResult
from auditor.server.bodies import parse_reports, parse_run, read_json_body
from auditor.server.budget import Lease
from auditor.server.problems import field_errors, problem, summary
from auditor.server.routes.params import RunIdPath
from auditor.server.state import StateDep, json_bytes

log = logging.getLogger("auditor.api")

router = APIRouter()


@router.post("/v1/reports", response_model=IngestResult, tags=["ingest"],
          summary="Store a batch of rank reports and audit the steps it completes")
async def post_reports(request: Request, state: StateDep):
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
    t0 = time.perf_counter()
    # The body's bytes stay taken from the budget until the decoded batch is stored:
    # decoded, it is what costs memory (BODY_MEMORY_FACTOR).
    lease = Lease(state.body_budget)
    try:
        body = await read_json_body(request, state, lease)
        if isinstance(body, Response):
            return body
        parsed = await anyio.to_thread.run_sync(parse_reports, body, state.settings, limiter=state.ingest_limiter)
        del body  # the decoded batch is all the ingest needs
        if isinstance(parsed, tuple):
            status, code, errs, n = parsed
            state.metrics.rejected.labels("batch_too_large" if status == 413 else "validation").inc(n)
            listed = field_errors(errs, state.settings.max_errors_listed)
            cut = len(listed) >= state.settings.max_errors_listed
            return problem(status, code,
                           summary(listed, len(listed)) + (" (validation stopped there)" if cut else ""),
                           request.url.path, errors=listed, errors_truncated=True if cut else None)
        out = await anyio.to_thread.run_sync(state.service.ingest, parsed, limiter=state.ingest_limiter)
        del parsed
    finally:
        lease.close()
    state.wrote()
    state.metrics.received.inc(out.accepted)
    state.metrics.ingest_duration.observe(time.perf_counter() - t0)
    return IngestResult(accepted=out.accepted, duplicates=out.duplicates, steps_audited=len(out.audited))


@router.put("/v1/runs/{run_id}", tags=["ingest"], summary="Register a run's topology and statistics")
async def put_run(request: Request, state: StateDep, run_id: str = RunIdPath):
    """Register a run's topology (and statistic kinds/specs) before its first report.
    Body: :class:`auditor.contract.models.RunRegistration`. Idempotent; 409
    ``topology_conflict``/``spec_conflict`` if it contradicts the stored one; 422 past
    ``max_statistics_per_run`` or ``max_world_size``."""
    lease = Lease(state.body_budget)
    try:
        body = await read_json_body(request, state, lease)
        if isinstance(body, Response):
            return body
        parsed = await run_in_threadpool(parse_run, body, state.settings)
        del body
        if isinstance(parsed, list):
            listed = field_errors(parsed, state.settings.max_errors_listed)
            return problem(422, "validation", summary(listed, len(parsed)), request.url.path, errors=listed)
        out = await anyio.to_thread.run_sync(lambda: json_bytes(state.service.register_run(run_id, parsed)),
                                             limiter=state.ingest_limiter)
        state.wrote()
        return Response(out, media_type="application/json")
    finally:
        lease.close()


@router.delete("/v1/runs/{run_id}", tags=["runs"], summary="Delete a run with its reports and verdicts")
async def delete_run(state: StateDep, run_id: str = RunIdPath):
    """Delete a run with its reports, verdicts and faults, in transactions of at most
    ``delete_chunk_rows`` reports (ingest of other runs goes on meanwhile). Answers the
    counts deleted: ``{"run_id", "reports", "steps", "statistics"}``; 404 if unknown."""
    counts = await run_in_threadpool(state.service.delete_run, run_id, state.settings.delete_chunk_rows)
    state.wrote()
    log.info("deleted run %s: %s", run_id, counts)
    return counts
