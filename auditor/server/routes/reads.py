"""The API's reads: runs (``GET /v1/runs``, a run's summary and report) and a statistic's
steps (its history, one step's detail). Each document (:mod:`auditor.contract.reads`, built by
the service) is computed and encoded as its ``to_json()`` in a worker thread
(:meth:`AppState.read`); listings are keyset-paginated
(:mod:`auditor.server.cursors`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field

from auditor.contract.names import RUN_ID_PATTERN, STATISTIC_PATTERN
from auditor.contract.reads import RunsPage
from auditor.server.cursors import decode_cursor, encode_cursor, rank_key, runs_key, step_key
from auditor.server.routes.params import RunIdPath, WorkloadPath
from auditor.server.state import StateDep
from auditor.service import (REPORT_RANK_ROWS, REPORT_ROWS_BUDGET, STEP_RANK_ROWS, STEP_RANK_ROWS_MAX, WORKLOAD_RUNS,
                             WORKLOAD_STEPS, WORKLOAD_STEPS_MAX)

router = APIRouter()


@router.get("/v1/runs", tags=["runs"], summary="List runs, newest first (paginated, by status)")
async def list_runs(
    state: StateDep,
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
    steps_unverified, refused_reports, reports_dropped, status, consistent}],
    "next_cursor": str | null}``. Pass ``next_cursor`` back as ``cursor`` for the next
    page (opaque; null on the last page). Times are Unix seconds."""
    after = decode_cursor(cursor, runs_key)

    def page():
        rows, last = state.service.runs_page(limit=limit, after=after, status=status)
        return RunsPage(runs=rows, next_cursor=encode_cursor(list(last)) if last else None)
    return await state.read(page)


@router.get("/v1/runs/{run_id}", tags=["runs"], summary="One run's summary")
async def get_run(state: StateDep, run_id: str = RunIdPath):
    """One run's summary; 404 if unknown."""
    return await state.read(lambda: state.service.get_run(run_id))


@router.get("/v1/runs/{run_id}/report", tags=["runs"],
            summary="Consistency report of a run: verdicts, faults, bad steps' rank tables")
async def get_report(
    request: Request,
    state: StateDep,
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
    page = str(request.url_for("run_page", run_id=run_id))
    return await state.read(lambda: replace(state.service.report(run_id, bad_steps_limit=bad_steps,
                                                                 statistic=statistic, rank_rows=rank_rows), page=page))


_FROM = Query(None, alias="from", ge=0, le=2**62, description="First step (inclusive).")
_TO = Query(None, alias="to", ge=0, le=2**62, description="Last step (inclusive).")


def check_step_range(start: int | None, stop: int | None) -> None:
    """A 422 naming ``from`` and ``to`` when both are given and ``from`` is past ``to`` (an
    empty range: the caller swapped them; a workload read would compare nothing and call it
    ``not_comparable``)."""
    if start is not None and stop is not None and start > stop:
        msg = f"from ({start}) is past to ({stop}): the step range is empty"
        raise RequestValidationError([{"loc": ("query", "from"), "type": "value_error", "input": start, "msg": msg},
                                      {"loc": ("query", "to"), "type": "value_error", "input": stop, "msg": msg}])


# ``{statistic:path}`` in both step routes: statistic names may hold "/" ("policy/grad_norm",
# sent as policy%2Fgrad_norm or policy/grad_norm; the ASGI path is decoded either way),
# which the default converter would not match (404). Unambiguous: ".../steps" ends the
# listing, ".../steps/<int>" the detail; a name's parts are never empty, "." or ".."
# (schemas.addressable).
@router.get("/v1/runs/{run_id}/statistics/{statistic:path}/steps", tags=["steps"],
            summary="Step history of one statistic (paginated, by verdict)")
async def get_steps(
    state: StateDep,
    run_id: str = RunIdPath,
    statistic: str = Path(min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
    start: int | None = _FROM,
    stop: int | None = _TO,
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
    most a correct reduction's rounding can show. 404 for an unknown run or statistic; 422
    naming ``from`` and ``to`` when ``from`` is past ``to``."""
    check_step_range(start, stop)
    after = decode_cursor(cursor, step_key)

    def page():
        out, last = state.service.steps(run_id, statistic, start=start, stop=stop, verdict=verdict, limit=limit,
                                        after=after)
        return replace(out, next_cursor=encode_cursor(last)) if last is not None else out
    return await state.read(page)


@router.get("/v1/runs/{run_id}/statistics/{statistic:path}/steps/{step}", tags=["steps"],
            summary="One step's verdict, faults and per-rank table (paginated)")
async def get_step(state: StateDep, run_id: str = RunIdPath,
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
    after = decode_cursor(cursor, rank_key)

    def page():
        out, last = state.service.step(run_id, statistic, step, limit=limit, after=after)
        return replace(out, next_cursor=encode_cursor(list(last))) if last is not None else out
    return await state.read(page)



#: A run id in a query list (``?run=a&run=b``): the wire pattern on each item.
RunIdItem = Annotated[str, Field(min_length=1, max_length=128, pattern=RUN_ID_PATTERN)]
_STEPS = Query(WORKLOAD_STEPS, ge=1, le=WORKLOAD_STEPS_MAX, description="Steps per run and statistic compared "
               "(the first from `from`).")


@router.get("/v1/workloads/{workload}", tags=["workloads"],
            summary="Layout invariance: the runs of one workload compared step by step")
async def get_workload(request: Request, state: StateDep, workload: str = WorkloadPath,
                       start: int | None = _FROM, stop: int | None = _TO, steps: int = _STEPS):
    """The runs labelled ``workload`` (``Report.workload``) compared across their layouts,
    statistic by statistic and step by step: per step each run's correct global statistic
    (count, mean, population variance; or the sum/norm) recomputed from its stored reports
    (all the data of the step, replicas once), and what it applied where its reduction
    covers the step, against a reference run (the world-size-1 run, else the majority)
    within the two runs' rounding bound (docs/tolerance.md §6). ``{workload, runs: [{run_id,
    world_size, sizes, microbatches, dtype, layout, statistics, skipped}], statistics:
    [{statistic, kind, runs, reference, reference_rule, reference_text, compared, findings:
    [{kind: layout_variance, statistic, moment, run, reference, first_step, steps, compared,
    diagnosis, message, evidence}], verdict, reason}], verdict, reason, findings,
    steps_compared, runs_truncated, page}``. ``verdict``: ``invariant``, ``variant`` or
    ``not_comparable`` (fewer than two runs sharing steps: never ``invariant`` unchecked).
    Bounded: at most 64 runs (the first by run id), ``steps`` steps per run and statistic,
    2²¹ stored reports read. 404 when no run carries the label; 422 naming ``from`` and
    ``to`` when ``from`` is past ``to``."""
    check_step_range(start, stop)
    page = str(request.url_for("workload_page", workload=workload))
    return await state.read(lambda: replace(state.service.compare_workload(workload, start=start, stop=stop,
                                                                           max_steps=steps), page=page))


@router.get("/v1/compare", tags=["workloads"], summary="Layout invariance: runs named one by one compared")
async def get_compare(state: StateDep,
                      run: list[RunIdItem] = Query(..., min_length=1, max_length=WORKLOAD_RUNS,
                                                   description="A run id; repeat it: ?run=a&run=b."),
                      start: int | None = _FROM, stop: int | None = _TO, steps: int = _STEPS):
    """The runs ``run`` compared as one workload whatever their labels: the document of
    ``GET /v1/workloads/{workload}`` with ``workload`` null. 404 naming an unknown run, 422
    naming a malformed run id, 422 naming ``from`` and ``to`` when ``from`` is past ``to``."""
    check_step_range(start, stop)
    return await state.read(lambda: state.service.compare_runs(run, start=start, stop=stop, max_steps=steps))
