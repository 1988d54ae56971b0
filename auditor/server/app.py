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
check before any body is read (:class:`~auditor.server.auth.AuthMiddleware`), a cap on requests in progress
(:class:`~auditor.server.limits.ConcurrencyMiddleware`), a budget of body bytes in flight taken before a body is
read and held until it is decoded and stored (:mod:`auditor.server.budget`; 503 past it),
bodies read while streaming up to ``max_body_bytes``
(413 without reading the rest) with a timeout between chunks, JSON parsing, validation and
rendering in worker threads (never on the event loop), ingest on a bounded number of
threads, and 503 + Retry-After for every "try again later" condition of the database.

Where each part lives: the routes in :mod:`auditor.server.routes` (one ``APIRouter`` per
resource), the dependencies they declare in :mod:`~auditor.server.state`, every exception's
problem in :mod:`~auditor.server.errors`, bodies in :mod:`~auditor.server.bodies`, the
sweep and the readiness probe in :mod:`~auditor.server.background`, the OpenAPI additions in
:mod:`~auditor.server.openapi`, the response-shaping middlewares in
:mod:`~auditor.server.middleware`. This module builds the app from them.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from auditor import __version__
from auditor.config import Settings
from auditor.server import errors
from auditor.server.auth import AuthMiddleware
from auditor.server.background import lifespan
from auditor.server.limits import ConcurrencyMiddleware
from auditor.server.middleware import HeadAsGetMiddleware, HtmlErrorsMiddleware, SecurityHeadersMiddleware
from auditor.server.openapi import OPENAPI_TAGS, build_openapi
from auditor.server.routes import ROUTERS

# Names other modules and tests imported from here before the split (kept working).
from auditor.server.background import GC_THRESHOLDS, PROBE_THREAD, tune_gc  # noqa: F401
from auditor.server.bodies import read_body  # noqa: F401
from auditor.server.limits import throttled  # noqa: F401
from auditor.server.state import AppState  # noqa: F401


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the FastAPI app. On start-up it migrates an empty database to head and refuses
    (``auditor.db.engine.SchemaError``) a database at another revision; it then runs the
    sweep (missing reports, late-completed steps, retention) every
    ``settings.sweep_interval_seconds`` and probes the database for ``/readyz``
    (:mod:`auditor.server.background`)."""
    settings = settings or Settings()
    # FastAPIOffline: /docs and /redoc with Swagger UI and ReDoc shipped inside the
    # fastapi-offline package (stock FastAPI loads them from a CDN: blank when air-gapped).
    app = FastAPIOffline(title="auditor", version=__version__, lifespan=lifespan(settings), openapi_tags=OPENAPI_TAGS,
                         description="Audits the statistics distributed trainers all-reduce across ranks. Every error "
                                     "is RFC 9457 problem details (application/problem+json).")
    app.add_middleware(HeadAsGetMiddleware)  # innermost: the routes see a GET
    app.add_middleware(AuthMiddleware, settings=settings)
    app.add_middleware(ConcurrencyMiddleware, limit=settings.max_concurrent_requests,
                       probe_limit=settings.max_concurrent_probes, read_limit=settings.max_concurrent_reads)
    app.add_middleware(HtmlErrorsMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)  # outermost: on the other middlewares' answers too
    errors.install(app)
    # In this order: the OpenAPI document's paths, and the hot path (POST /v1/reports) matched
    # first. Each included router is matched in turn (FastAPI 0.165): /healthz, in the last,
    # costs ~60 us more than in one flat route table, StateDep ~20 us (in process, no network).
    for router in ROUTERS:
        app.include_router(router)
    app.openapi = lambda: build_openapi(app, settings)
    return app
