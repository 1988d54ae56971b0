"""Who may call: the bearer-token check that runs before any body is read
(:class:`AuthMiddleware`), the browser's sign-in cookie (``POST /login``), and the paths
that answer without a token."""

from __future__ import annotations

import hmac
import urllib.parse

from fastapi.responses import RedirectResponse

from auditor.config import Settings
from auditor.server.problems import problem, send_problem

#: Paths that answer without a token when ``Settings.public_endpoints`` (the default).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
#: Liveness answers without a token in any case (probes of orchestrators carry none).
ALWAYS_OPEN = frozenset({"/healthz"})

#: The cookie a browser signs in with (``POST /login``); its value is the token. Accepted for
#: GET/HEAD only, so a cross-site form can never write with it (SameSite=Strict besides).
TOKEN_COOKIE = "auditor_token"
#: Bytes of a sign-in form (``POST /login``: token and ``next``) beyond the configured tokens'
#: worst-case percent-encoding (3 bytes a character); a longer body is a 413, never read whole.
LOGIN_BODY_BYTES = 8192
#: Assets that hold no data: every page (the sign-in page too) loads them without a token.
OPEN_PREFIXES = ("/static/", "/static-offline-docs/")


def _cookie(header: bytes, name: str) -> bytes | None:
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name.encode() and value:
            return urllib.parse.unquote_to_bytes(value)
    return None


class AuthMiddleware:
    """Bearer-token check before the route runs, so no body is read for a caller without
    the token. With ``token`` set, every request but the public paths needs
    ``Authorization: Bearer <token>``; ``read_token`` (optional) is accepted for GET/HEAD
    only (403 for writes). Tokens are compared with :func:`hmac.compare_digest`."""

    def __init__(self, app, settings: Settings):
        self.app = app
        self.settings = settings
        self._write = self._encode(settings.token)
        self._read = self._encode(settings.read_token)

    @staticmethod
    def _encode(token: str | None) -> bytes | None:
        return f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (self._write is None and self._read is None):
            return await self.app(scope, receive, send)
        path = scope["path"]
        if (path in ALWAYS_OPEN or path == "/login" or path.startswith(OPEN_PREFIXES)
                or (self.settings.public_endpoints and path in PUBLIC_PATHS)):
            return await self.app(scope, receive, send)
        given, cookie, accept = b"", None, b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.strip().partition(b" ")
                # the scheme is case-insensitive (RFC 7235 §2.1): "bearer x" is "Bearer x"
                given = b"Bearer " + credentials.strip() if scheme.lower() == b"bearer" else value
            elif name == b"cookie":
                cookie = value
            elif name == b"accept":
                accept = value
        reading = scope["method"] in ("GET", "HEAD")
        if not given and cookie is not None and reading:  # a browser that signed in (POST /login)
            token = _cookie(cookie, TOKEN_COOKIE)
            if token:
                given = b"Bearer " + token
        if self._write is not None and hmac.compare_digest(given, self._write):
            return await self.app(scope, receive, send)
        if self._read is not None and hmac.compare_digest(given, self._read):
            if reading:
                return await self.app(scope, receive, send)
            return await send_problem(send, problem(
                403, "forbidden", "the read-only token (AUDITOR_READ_TOKEN) cannot change anything; "
                                  "use AUDITOR_TOKEN", path), scope)
        if self._write is None and not reading:
            return await self.app(scope, receive, send)  # only a read token is configured
        if reading and b"text/html" in accept and not path.startswith("/v1/"):
            # a person opening a page: the sign-in form, then back here
            target = path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
            root = scope.get("root_path", "")
            return await send_problem(send, RedirectResponse(
                f"{root}/login?next={urllib.parse.quote(target, safe='')}", status_code=303), scope)
        await send_problem(send, problem(
            401, "unauthorized", "send 'Authorization: Bearer <AUDITOR_TOKEN>'"
            + (" (or AUDITOR_READ_TOKEN for reads)" if self._read is not None else ""), path,
            headers={"WWW-Authenticate": 'Bearer realm="auditor"'}), scope)


def local_path(target: str) -> str:
    """``target`` if it is a path of this site ("/runs/x?step=3"), else "/" (no open redirect
    to another host through ``next``)."""
    return target if target.startswith("/") and not target.startswith("//") and "\\" not in target else "/"
