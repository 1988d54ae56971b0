"""Error bodies of the HTTP API: RFC 9457 problem details, one shape for every error.

Every 4xx/5xx answer is ``application/problem+json``::

    {"type": "urn:auditor:problem:validation", "title": "Request validation failed",
     "status": 422, "detail": "reports[3].local.count: count must be >= 0, got -1.0",
     "instance": "/v1/reports",
     "errors": [{"field": "reports[3].local.count", "loc": ["reports", 3, "local", "count"],
                 "msg": "...", "type": "value_error"}]}

Extensions: ``errors`` (422, 413: one entry per offending field, ``field`` in the wire's
dotted form), ``errors_truncated`` (validation stopped at ``max_errors_listed``),
``conflicts`` (409: ``[{"index": i, "fields": ["local.sum"], ...}]``, one per offending
report of the batch). ``type`` is ``urn:auditor:problem:<code>``; the codes are the keys of
:data:`TITLES` (docs/deploy.md "Error bodies").
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field
from starlette.responses import Response

MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:auditor:problem:"
#: Seconds a client is asked to wait (Retry-After) after a 503.
RETRY_AFTER = "1"

#: Problem codes and their titles (the part of ``type`` after the prefix).
TITLES: dict[str, str] = {
    "bad_request": "Malformed HTTP request",
    "unauthorized": "Missing or wrong bearer token",
    "forbidden": "This token may only read",
    "not_found": "Not found",
    "method_not_allowed": "Method not allowed",
    "request_timeout": "Request body not received in time",
    "conflicting_report": "Report differs from the stored one with the same key",
    "coordinate_conflict": "Two ranks claim the same coordinates",
    "topology_conflict": "Report contradicts the run's topology",
    "spec_conflict": "Report contradicts the statistic's kind or spec",
    "workload_conflict": "Report or registration contradicts the run's workload label",
    "placement_conflict": "Report from a rank outside the statistic's placement",
    "too_large": "Request too large",
    "unsupported_media_type": "Request body is not JSON (Content-Type)",
    "validation": "Request validation failed",
    "limit_exceeded": "A configured limit would be exceeded",
    "unavailable": "Database unavailable or busy, retry later",
    "overloaded": "Too many requests in progress, retry later",
    "internal": "Internal error",
}


class FieldError(BaseModel):
    """One offending field."""

    field: str = Field(description="Wire name of the field, e.g. reports[3].local.count, path.step, body.")
    loc: list[str | int] = Field(description="The same as a path of keys and indices.")
    msg: str
    type: str = Field(description="Error type, e.g. value_error, missing, too_long, limit_exceeded.")


class Problem(BaseModel):
    """RFC 9457 problem details (``application/problem+json``), the body of every error."""

    type: str = Field(description="urn:auditor:problem:<code>")
    title: str
    status: int
    detail: str
    instance: str | None = Field(None, description="The request path.")
    errors: list[FieldError] | None = Field(None, description="422/413: the offending fields.")
    errors_truncated: bool | None = Field(
        None, description="True when validation stopped at max_errors_listed errors: fix these and resend.")
    conflicts: list[dict[str, Any]] | None = Field(
        None, description="409: one entry per offending report: index, run_id, statistic, step, microbatch, "
                          "rank, fields (wire names such as local.sum), and for coordinate_conflict "
                          "other_rank, coords (and other_index when the other report is in the same batch).")


def problem(status: int, code: str, detail: str, instance: str | None = None,
            headers: dict[str, str] | None = None, **extensions: Any) -> Response:
    """An error response in the one shape. ``extensions`` with value None are left out."""
    body = {"type": TYPE_PREFIX + code, "title": TITLES[code], "status": status, "detail": detail}
    if instance is not None:
        body["instance"] = instance
    body.update({k: v for k, v in extensions.items() if v is not None})
    return Response(json.dumps(body, default=str).encode(), status_code=status, media_type=MEDIA_TYPE,
                    headers=headers)


async def send_problem(send, response: Response, scope=None) -> None:
    """Send ``response`` from an ASGI middleware, before the app read the request body: the
    connection is then closed (``Connection: close``) when a body may follow, so its unread
    bytes are never taken for the next request."""
    headers = list(response.raw_headers)
    if scope is not None and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


def field_name(loc: tuple | list) -> str:
    """``("reports", 3, "local", "count")`` → ``"reports[3].local.count"``; empty → ``"body"``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def field_errors(errors: list[dict], limit: int | None = None, strip_body: bool = False) -> list[dict]:
    """pydantic/FastAPI error dicts as :class:`FieldError` dicts (at most ``limit``).
    ``strip_body``: drop FastAPI's leading ``"body"`` from locations."""
    out = []
    for e in errors[:limit] if limit is not None else errors:
        loc = tuple(e.get("loc", ()))
        if strip_body and loc[:1] == ("body",):
            loc = loc[1:]
        out.append({"field": field_name(loc), "loc": list(loc), "msg": str(e.get("msg", "")),
                    "type": str(e.get("type", "value_error"))})
    return out


def summary(errors: list[dict], total: int) -> str:
    """A one-line ``detail`` for a list of field errors."""
    first = errors[0] if errors else {"field": "body", "msg": "invalid"}
    more = f" (and {total - 1} more)" if total > 1 else ""
    return f"{first['field']}: {first['msg']}{more}"
