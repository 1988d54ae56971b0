"""HTTP API (FastAPI): a thin layer over :class:`auditor.service.Service`.

Endpoints (all JSON):

* ``POST /v1/reports`` — ingest a batch (wire contract v1, DESIGN.md §3).
* ``PUT /v1/runs/{run_id}`` — register a run's topology and statistic specs.
* ``GET /v1/runs``, ``GET /v1/runs/{run_id}``, ``GET /v1/runs/{run_id}/report``,
  ``GET /v1/runs/{run_id}/statistics/{statistic}/steps/{step}``.
* ``GET /v1/runs/{run_id}/statistics/{statistic}/steps`` (step history, keyset-paginated).
* ``GET /healthz``, ``GET /metrics`` (Prometheus text format).

HTML (Jinja2 templates of :mod:`auditor.web`): ``GET /`` (runs), ``GET /runs/{run_id}`` (the
run page with its plots). Every asset — plotly.js from the plotly package, Swagger UI and
ReDoc from fastapi-offline, our CSS/JS — is served by this process (``/static``,
``/static-offline-docs``): no CDN, so air-gapped clusters see the pages and ``/docs``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import gc
import json
import logging
import time
from typing import Any, Literal

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from auditor import __version__
from auditor.config import Settings
from auditor.db.engine import current_revision, ensure_schema, make_engine
from auditor.schemas import RUN_ID_PATTERN, IngestResult, ReportBatch, RunRegistration
from auditor.server.metrics import scrape_registry
from auditor.service import ConflictError, NotFound, PageReads, Service

log = logging.getLogger("auditor.api")


def _field(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_detail(err: ValidationError) -> list[dict[str, Any]]:
    """pydantic errors as ``[{"field": "reports[3].local.count", "loc": [...], "msg", "type"}]``."""
    return [
        {"field": _field(e["loc"]), "loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in err.errors(include_url=False, include_input=False)
    ]


class AppState:
    """What a request handler needs: settings, the service, metrics. One per app."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.engine = make_engine(settings.database_url)
        ensure_schema(self.engine, settings.database_url)
        self.service = Service.from_engine(self.engine)
        # One process: ordinary metrics. Several uvicorn workers (PROMETHEUS_MULTIPROC_DIR,
        # set by `auditor serve --workers N`): every worker exports the sum of all workers.
        self.registry, self.metrics = scrape_registry(self.service.metric_series,
                                                      settings.metrics_retention_seconds)

    def close(self) -> None:
        self.engine.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the FastAPI app. On start-up it migrates an empty database to head and refuses
    (``auditor.db.engine.SchemaError``) a database at another revision; it then runs the
    missing-report sweep every ``settings.sweep_interval_seconds``."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        svc = AppState(settings)
        app.state.svc = svc
        tune_gc()
        sweeper = asyncio.create_task(_sweep_forever(svc))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            svc.close()

    # FastAPIOffline: /docs and /redoc with Swagger UI and ReDoc shipped inside the
    # fastapi-offline package (stock FastAPI loads them from a CDN: blank when air-gapped).
    app = FastAPIOffline(title="auditor", version=__version__, lifespan=lifespan,
                         description="Audits the statistics distributed trainers all-reduce across ranks.")

    def svc(request: Request) -> AppState:
        return request.app.state.svc

    def authorized(request: Request) -> None:
        token = settings.token
        if token and request.headers.get("authorization") != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer <AUDITOR_TOKEN>)")

    @app.exception_handler(ConflictError)
    async def _conflict(request: Request, exc: ConflictError):
        request.app.state.svc.metrics.rejected.labels(exc.error).inc(max(1, len(exc.conflicts)))
        return JSONResponse(status_code=409, content={
            "detail": {"error": exc.error, "message": exc.message, "conflicts": exc.conflicts}})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        """Body, path and query errors in the same shape as ``POST /v1/reports``'s."""
        detail = [{"field": _field(tuple(e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"])),
                   "loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound):
        return JSONResponse(status_code=404, content={"detail": f"not found: {exc}"})

    @app.exception_handler(sa.exc.OperationalError)
    async def _db_down(request: Request, exc: sa.exc.OperationalError):
        log.warning("database error: %s", exc)
        return JSONResponse(status_code=503, headers={"Retry-After": "1"},
                            content={"detail": "database unavailable, retry later"})

    @app.post("/v1/reports", response_model=IngestResult, dependencies=[Depends(authorized)])
    async def post_reports(request: Request, s: AppState = Depends(svc)) -> IngestResult:
        """Store a batch of rank reports and audit every step it completes.

        Body: ``{"reports": [Report, ...]}`` (DESIGN.md §3), 1 to ``max_batch`` reports.
        All-or-nothing: 422 (validation; ``detail[].field`` names the field, e.g.
        ``reports[3].local.count``) or 409 (``conflicting_report``, ``topology_conflict``,
        ``spec_conflict``; ``detail.conflicts[].index`` lists the offending reports) store
        nothing. Identical re-sends are counted in ``duplicates``. 503 with Retry-After
        when the database is unreachable.
        """
        t0 = time.perf_counter()
        body = await request.body()
        try:
            batch = await run_in_threadpool(ReportBatch.model_validate_json, body)
        except ValidationError as e:
            s.metrics.rejected.labels("validation").inc(_count_reports(body))
            return JSONResponse(status_code=422, content={"detail": validation_detail(e)})
        if len(batch.reports) > s.settings.max_batch:
            s.metrics.rejected.labels("batch_too_large").inc(len(batch.reports))
            return JSONResponse(status_code=413, content={"detail": [{
                "field": "reports", "loc": ["reports"], "type": "too_long",
                "msg": f"at most {s.settings.max_batch} reports per request, got {len(batch.reports)}"}]})
        out = await run_in_threadpool(s.service.ingest, batch.reports)
        s.metrics.received.inc(out.accepted)
        s.metrics.ingest_duration.observe(time.perf_counter() - t0)
        return IngestResult(accepted=out.accepted, duplicates=out.duplicates, steps_audited=len(out.audited))

    @app.put("/v1/runs/{run_id}", dependencies=[Depends(authorized)])
    def put_run(
        reg: RunRegistration,
        run_id: str = Path(min_length=1, max_length=128, pattern=RUN_ID_PATTERN),
        s: AppState = Depends(svc),
    ) -> dict:
        """Register a run's topology (and statistic kinds/specs) before its first report.
        Idempotent; 409 ``topology_conflict``/``spec_conflict`` if it contradicts the stored one."""
        return s.service.register_run(run_id, reg)

    @app.get("/v1/runs")
    def list_runs(
        limit: int = Query(100, ge=1, le=1000, description="Runs per page."),
        cursor: str | None = Query(None, description="`next_cursor` of the previous page."),
        status: Literal["consistent", "inconsistent"] | None = Query(
            None, description="Only runs with (inconsistent) or without (consistent) an inconsistent step."),
        s: AppState = Depends(svc),
    ) -> dict:
        """Runs, newest first: ``{"runs": [{run_id, world_size, sizes, created_at,
        last_activity, statistics, steps_audited, steps_inconsistent, consistent}],
        "next_cursor": str | null}``. Pass ``next_cursor`` back as ``cursor`` for the next
        page (opaque; null on the last page). Times are Unix seconds."""
        after = decode_cursor(cursor, lambda v: (float(v[0]), str(v[1])))
        rows, last = s.service.runs_page(limit=limit, after=after, status=status)
        return {"runs": rows, "next_cursor": encode_cursor(list(last)) if last else None}

    @app.get("/v1/runs/{run_id}")
    def get_run(run_id: str, s: AppState = Depends(svc)) -> dict:
        """One run's summary; 404 if unknown."""
        return s.service.get_run(run_id)

    @app.get("/v1/runs/{run_id}/report")
    def get_report(
        request: Request,
        run_id: str,
        statistic: str | None = None,
        bad_steps: int = Query(20, ge=0, le=1000, description="Bad steps shown per statistic."),
        s: AppState = Depends(svc),
    ) -> dict:
        """Consistency report: per statistic, steps audited/consistent/inconsistent/incomplete/
        pending, first and last bad step, fault counts by kind, the latest sigma figures and
        the worst ones (``worst_cp_disagreement_sigma``/``_step``, ``worst_applied_error_sigma``/
        ``_step``: the largest of any audited step, and that step), and
        for up to ``bad_steps`` bad steps their faults and per-rank table (rank, coords,
        local count and mean, applied mean/std, correct mean/std, error in σ)."""
        out = s.service.report(run_id, bad_steps_limit=bad_steps, statistic=statistic)
        out["page"] = str(request.url_for("run_page", run_id=run_id))
        return out

    @app.get("/v1/runs/{run_id}/statistics/{statistic}/steps")
    def get_steps(
        run_id: str,
        statistic: str,
        start: int | None = Query(None, alias="from", ge=0, le=2**62, description="First step (inclusive)."),
        stop: int | None = Query(None, alias="to", ge=0, le=2**62, description="Last step (inclusive)."),
        verdict: Literal["consistent", "inconsistent", "incomplete", "pending"] | None = Query(
            None, description="Only steps with this verdict (pending: not audited yet)."),
        limit: int = Query(1000, ge=1, le=10_000, description="Steps per page."),
        cursor: str | None = Query(None, description="`next_cursor` of the previous page."),
        s: AppState = Depends(svc),
    ) -> dict:
        """Step history of one statistic, in step order, from the stored per-step rows (no
        re-audit): ``{"run_id", "statistic", "kind", "steps": [{step, verdict, reports,
        expected, cp_disagreement_sigma, applied_error_sigma, tolerance_sigma, fault_kinds,
        audited_at}], "next_cursor"}``. σ figures are in standard deviations of the correct
        statistic (``moments`` only; null for ``sum``/``norm``); ``tolerance_sigma`` is the
        most a correct reduction's rounding can show. 404 for an unknown run or statistic."""
        after = decode_cursor(cursor, int)
        page = s.service.steps(run_id, statistic, start=start, stop=stop, verdict=verdict, limit=limit, after=after)
        last = page.pop("last")
        return {**page, "next_cursor": encode_cursor(last) if last is not None else None}

    @app.get("/v1/runs/{run_id}/statistics/{statistic}/steps/{step}")
    def get_step(run_id: str, statistic: str, step: int = Path(ge=0, le=2**62),
                 s: AppState = Depends(svc)) -> dict:
        """One step's verdict, faults and per-rank table; 404 if not seen."""
        return s.service.step(run_id, statistic, step)

    # ---------------------------------------------------------------- HTML pages
    from auditor import web

    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(web.plotly_js_path(), media_type="text/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})

    app.mount("/static", StaticFiles(directory=web.STATIC_DIR), name="static")

    @app.get("/runbook", response_class=HTMLResponse, include_in_schema=False)
    def runbook(request: Request) -> HTMLResponse:
        """The alert runbook (docs/alerts.md): where every alert's runbook_url points."""
        return HTMLResponse(web.render_runbook(root_path=request.scope.get("root_path", "")))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def runs_page(
        request: Request,
        cursor: str | None = None,
        status: Literal["consistent", "inconsistent"] | None = None,
        s: AppState = Depends(svc),
    ) -> HTMLResponse:
        after = decode_cursor(cursor, lambda v: (float(v[0]), str(v[1])))
        rows, last = s.service.runs_page(limit=100, after=after, status=status)
        return HTMLResponse(web.render_runs_page(rows, next_cursor=encode_cursor(list(last)) if last else None,
                                                 status=status, root_path=request.scope.get("root_path", "")))

    @app.get("/runs/{run_id}", response_class=HTMLResponse, name="run_page", include_in_schema=False)
    def run_page(
        request: Request,
        run_id: str,
        statistic: str | None = None,
        step: int | None = Query(None, ge=0, le=2**62),
        s: AppState = Depends(svc),
    ) -> HTMLResponse:
        """The run page: verdict counts, σ per step, faults per step, per-rank detail of the
        bad steps (``?statistic=&step=`` selects one)."""
        page = web.gather_run_page(PageReads(s.service), run_id, statistic=statistic, step=step)
        return HTMLResponse(web.render_run_page(**page, root_path=request.scope.get("root_path", "")))

    @app.get("/healthz")
    def healthz(s: AppState = Depends(svc)) -> JSONResponse:
        """Liveness and database reachability: 200 ``{"status": "ok"}`` or 503."""
        try:
            rev = current_revision(s.engine)
        except sa.exc.SQLAlchemyError as e:
            return JSONResponse(status_code=503, content={"status": "error", "database": str(e)[:200]})
        return JSONResponse({"status": "ok", "version": __version__, "schema_revision": rev})

    @app.get("/metrics")
    def metrics(s: AppState = Depends(svc)) -> Response:
        """Prometheus exposition (DESIGN.md §6)."""
        return Response(generate_latest(s.registry), media_type=CONTENT_TYPE_LATEST)

    return app


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


def encode_cursor(value: Any) -> str:
    """An opaque pagination cursor: the keyset position as URL-safe base64 of compact JSON."""
    return base64.urlsafe_b64encode(json.dumps(value, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, parse) -> Any:
    """The position of :func:`encode_cursor`'s ``cursor`` (``parse`` checks its shape); a
    cursor that is not one of ours is a 422 naming ``cursor``."""
    if not cursor:  # absent, or empty (`?cursor=`: the first page)
        return None
    try:
        return parse(json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))))
    except (ValueError, TypeError, IndexError, KeyError, binascii.Error):
        raise RequestValidationError([{"loc": ("query", "cursor"), "type": "value_error", "input": cursor,
                                       "msg": "not a cursor of this listing: pass back the next_cursor of the "
                                              "previous page unchanged"}]) from None


def _count_reports(body: bytes) -> int:
    try:
        reports = json.loads(body).get("reports")
        return max(1, len(reports)) if isinstance(reports, list) else 1
    except (ValueError, AttributeError):
        return 1


async def _sweep_forever(svc: AppState) -> None:
    while True:
        await asyncio.sleep(svc.settings.sweep_interval_seconds)
        try:
            n = await run_in_threadpool(svc.service.sweep, svc.settings.grace_seconds)
            if n:
                log.info("sweep audited %d incomplete step(s)", n)
        except Exception:  # keep sweeping; the next round retries
            log.exception("sweep failed")
