"""The OpenAPI document (``/openapi.json``, ``/docs``, ``/redoc``): the tags that group the
operations, and what FastAPI cannot see in the routes: the request bodies of the endpoints
that read their body themselves, the documents the reads answer (encoded in a worker
thread, so declared here: :mod:`auditor.contract.reads`), the problem-details error
responses of every operation, and the bearer security scheme."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import TypeAdapter
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

from auditor.config import Settings
from auditor.contract import reads
from auditor.contract.models import ReportBatch, RunRegistration
from auditor.server.auth import ALWAYS_OPEN, PUBLIC_PATHS
from auditor.server.problems import MEDIA_TYPE, Problem

#: The groups of ``/docs``, in this order.
OPENAPI_TAGS = [
    {"name": "ingest", "description": "What trainer ranks send: reports (wire contract v1) and run registrations."},
    {"name": "runs", "description": "Runs and their consistency reports."},
    {"name": "steps", "description": "Per-step history and detail of one statistic of a run."},
    {"name": "workloads", "description": "Layout invariance: runs of one workload at different parallel layouts "
                                         "compared step by step."},
    {"name": "operations", "description": "Probes and metrics for orchestrators and Prometheus."},
]

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
    ("get", "/v1/workloads/{workload}"): (404, 422, 503),
    ("get", "/v1/compare"): (404, 422, 503),
    ("get", "/readyz"): (503,),
    ("get", "/metrics"): (503,),
}
_BODIES = {("post", "/v1/reports"): ReportBatch, ("put", "/v1/runs/{run_id}"): RunRegistration}
#: The document each read answers with 200 (its JSON is built and encoded in a worker thread).
_READS = {("get", "/v1/runs"): reads.RunsPage, ("get", "/v1/runs/{run_id}"): reads.Run,
          ("get", "/v1/runs/{run_id}/report"): reads.Report,
          ("get", "/v1/runs/{run_id}/statistics/{statistic}/steps"): reads.StepsPage,
          ("get", "/v1/runs/{run_id}/statistics/{statistic}/steps/{step}"): reads.StepPage}
_STATUS_TEXT = {401: "Missing or wrong bearer token", 403: "Read-only token used for a write",
                404: "Not found", 408: "Body not received in time", 409: "Conflicts with what is stored",
                413: "Body or batch too large", 415: "Content-Type is not application/json",
                422: "Validation failed (errors[] names each field)",
                503: "Database unavailable/busy or too many requests in progress; see Retry-After"}


def build_openapi(app: FastAPI, settings: Settings) -> dict:
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
    for document in dict.fromkeys(_READS.values()):  # a fixed order: a set of classes iterates by id
        read = _document_schemas(document)
        clash = {k for k in read.keys() & comps.keys() if comps[k] != read[k]}
        if clash:
            raise RuntimeError(f"OpenAPI components named twice: {sorted(clash)}")
        comps.update(read)
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
            document = _READS.get((method, path))
            if document is not None:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok["content"] = {"application/json": {"schema": {
                    "$ref": f"#/components/schemas/{READ_PREFIX}{document.__name__}"}}}
            model = _BODIES.get((method, path))
            if model is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = doc
    return doc


#: Prefix of the read documents' component names: ``reads.Report`` (the report a read
#: answers) is not the wire ``Report`` that ``POST /v1/reports`` takes. Without it the read
#: document replaced the wire one in ``ReportBatch``'s items: the body documented wrongly, and
#: schemathesis generated nested run reports as bodies (its fuzzing of that one operation
#: went from ~18 s to past 540 s).
READ_PREFIX = "Read"


def _document_schemas(document: type) -> dict[str, dict]:
    """JSON schemas of a read document and the documents it nests, by class name prefixed
    with :data:`READ_PREFIX`, with the declared fields only (``extra``, the Reader's holder
    of keys it does not know, is no key the service sends)."""
    js = TypeAdapter(document).json_schema(ref_template=f"#/components/schemas/{READ_PREFIX}{{model}}")
    out = {f"{READ_PREFIX}{name}": schema for name, schema in {document.__name__: js, **js.pop("$defs", {})}.items()}
    for schema in out.values():
        schema.get("properties", {}).pop("extra", None)
    return out
