"""The routes, one :class:`fastapi.APIRouter` per resource: :mod:`.reports` (the writes),
:mod:`.reads` (runs and steps), :mod:`.pages` (HTML and assets), :mod:`.health` (probes and
metrics). :data:`ROUTERS` is the order the app includes them in (the OpenAPI document's)."""

from auditor.server.routes import health, pages, reads, reports

ROUTERS = (reports.router, reads.router, pages.router, health.router)
