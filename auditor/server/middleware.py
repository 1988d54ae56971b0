"""The ASGI middlewares that shape every response whatever answered it: security headers,
``HEAD`` on every ``GET``, and a browser's errors as HTML pages."""

from __future__ import annotations

import json

from auditor.server.auth import PUBLIC_PATHS
from auditor.server.problems import MEDIA_TYPE


#: Content-Security-Policy of the pages: scripts and styles of this origin only (plotly.js,
#: run.js, auditor.css are files of the package; the figures' data is a JSON script element,
#: which is not executed), inline styles allowed (plotly adds style elements, the pages set
#: style attributes), no plugins, no framing, forms post only here.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
            "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
            "frame-ancestors 'none'")
#: The same for Swagger UI and ReDoc (``/docs``, ``/redoc``): fastapi-offline's pages start
#: their bundle with an inline script, and ReDoc runs a worker from a blob.
DOCS_CSP = PAGE_CSP.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'") + "; worker-src 'self' blob:"
#: Anything else (JSON, problem details, metrics): nothing to run or load at all.
API_CSP = "default-src 'none'; frame-ancestors 'none'"
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc"})


class SecurityHeadersMiddleware:
    """Headers on every response, those of the other middlewares (401, 503) included:
    ``X-Content-Type-Options: nosniff`` (a JSON body or a problem is never sniffed into
    HTML), ``X-Frame-Options: DENY`` with CSP ``frame-ancestors 'none'`` (no page of the
    service in a frame of another site), ``Referrer-Policy: same-origin``, and a
    Content-Security-Policy: :data:`PAGE_CSP` on HTML, :data:`DOCS_CSP` on ``/docs`` and
    ``/redoc``, :data:`API_CSP` on everything else."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        docs = scope["path"] in DOCS_PATHS

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                html = any(k.lower() == b"content-type" and v.startswith(b"text/html") for k, v in headers)
                csp = DOCS_CSP if docs else PAGE_CSP if html else API_CSP
                headers += [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                            (b"referrer-policy", b"same-origin"), (b"content-security-policy", csp.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class HeadAsGetMiddleware:
    """``HEAD`` on every path that answers ``GET`` (pages, API reads, probes, assets): routed
    as the GET (FastAPI's routes register GET only: pages answered HEAD with 405), with the
    same status and headers; uvicorn sends no body for a HEAD (it sees the request's own
    method, not this copy's)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


#: Paths that are never pages, whatever the client accepts: the API, probes, metrics, assets.
_NOT_PAGES = ("/v1/", "/static/", "/static-offline-docs/")


class HtmlErrorsMiddleware:
    """A browser's errors as pages: a problem-details answer (any status, from any layer:
    a 404 of an unknown run, a 422 of a bad query, a 503) to a GET/HEAD that accepts
    ``text/html`` on a path outside the API (:data:`_NOT_PAGES`, :data:`PUBLIC_PATHS`,
    ``/openapi.json``) becomes :func:`auditor.web.render_error`'s page with the same status
    and headers (Retry-After, Allow, ...). API clients, which do not ask for HTML, keep
    the problem JSON."""

    def __init__(self, app):
        self.app = app

    @staticmethod
    def _wants_html(scope) -> bool:
        path = scope["path"]
        if (scope["method"] not in ("GET", "HEAD") or path.startswith(_NOT_PAGES) or path in PUBLIC_PATHS
                or path == "/openapi.json"):
            return False
        return any(k == b"accept" and b"text/html" in v for k, v in scope["headers"])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._wants_html(scope):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def convert(message):
            nonlocal start
            if message["type"] == "http.response.start":
                if any(k.lower() == b"content-type" and v.startswith(MEDIA_TYPE.encode())
                       for k, v in message.get("headers", ())):
                    start = message  # a problem: held until its (small) body is complete
                    return
                return await send(message)
            if start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            await send_page(start, b"".join(chunks))

        async def send_page(start: dict, body: bytes) -> None:
            from auditor import web

            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            headers = {k.lower(): v for k, v in start.get("headers", ())}
            html = web.render_error(status=start["status"], title=str(doc.get("title", "Error")),
                                    detail=str(doc.get("detail", "")),
                                    retry_after=headers.get(b"retry-after", b"").decode("latin-1") or None,
                                    root_path=scope.get("root_path", "")).encode()
            kept = [(k, v) for k, v in start.get("headers", ())
                    if k.lower() not in (b"content-type", b"content-length")]
            await send({**start, "headers": kept + [(b"content-type", b"text/html; charset=utf-8"),
                                                    (b"content-length", str(len(html)).encode())]})
            await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else html})

        await self.app(scope, receive, convert)
