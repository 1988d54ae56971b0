"""Where an :class:`~auditor.trainer.client.AuditorClient`'s reports go: the service, or the spool only.

A ``file:`` URL means the spool only; so does a URL no request can use (not ``http(s)://``
with a host) or a token that cannot be an HTTP header value — said once, with the
``auditor import`` command that uploads the spool later. The client never raises on either.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from auditor import bounded_http
from auditor.trainer.settings import warn_once
from auditor.trainer.spool import default_spool_dir


def destination(url, token, spool_dir: str | os.PathLike | None, spool: bool
                ) -> tuple[bool, str, str | os.PathLike | None, bool]:
    """``(file_only, url, spool_dir, spool)`` for a client given ``url`` and ``token``:
    file-only (spooling on) for a ``file:`` URL or, said once, an unusable URL or token."""
    url = str(url or "").strip()
    if url.startswith("file:"):
        return True, url, url[len("file://"):] if url.startswith("file://") else url[len("file:"):], True
    if (unusable := _unusable(url, token)) is not None:  # the spool only, said once
        key, why, upload = unusable
        where = Path(spool_dir or default_spool_dir())
        warn_once(key, "auditor client: %s; writing reports to the spool in %s only — upload them with "
                  "`auditor import %s %s`", why, where, where, upload)
        return True, f"file://{where}", where, True
    return False, url, spool_dir, spool


def open_http(timeout: float, token: str | None) -> httpx.Client:
    """The client's HTTP client: JSON, the bearer ``token`` if any, answers bounded in time and size."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return bounded_http.client(timeout=timeout, headers=headers)


def _unusable(url: str, token) -> tuple[str, str, str] | None:
    """Why no request can use ``url`` or ``token``, as (warning key, reason, the `auditor
    import` arguments to upload the spool with); None when both are usable."""
    if not _is_service_url(url):
        return (f"url={url}", f"{url!r} is not the http(s) URL of an auditor service (AUDITOR_URL=http://host:8000) "
                              "nor file:///dir", "--url http://HOST:8000")
    if token and not (str(token).isascii() and str(token).isprintable()):
        return f"token={token!r}", "the token is not printable ASCII (an HTTP header value)", f"--url {url} --token ..."
    return None


def _is_service_url(url: str) -> bool:
    """Whether ``url`` is an ``http(s)://host...`` URL httpx can send to."""
    try:
        parsed = httpx.URL(url)
        parsed.host.encode("idna")  # a label over 63 characters fails here, on every request
    except (httpx.InvalidURL, TypeError, UnicodeError):
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.host)

