"""The HTML pages (Jinja2 templates of :mod:`auditor.web`): ``/`` (runs), ``/runs/{run_id}``
(the run page with its plots), ``/workloads/{workload}`` (a workload's runs compared), ``/runbook``, the sign-in form (``/login``), and the assets
they load (``/static``: plotly.js from the plotly package, our CSS/JS), all served by this
process: no CDN, so air-gapped clusters see the pages. None is in the OpenAPI document."""

from __future__ import annotations

import hmac
import math
import urllib.parse
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.requests import ClientDisconnect

from auditor import web
from auditor.contract.names import STATISTIC_PATTERN
from auditor.server.auth import LOGIN_BODY_BYTES, TOKEN_COOKIE, local_path
from auditor.server.bodies import BodyTimeout, BodyTooLarge, disconnected, read_body
from auditor.server.cursors import decode_cursor, encode_cursor, runs_key
from auditor.server.limits import throttled
from auditor.server.problems import RETRY_AFTER, problem
from auditor.server.routes.params import RunIdPath, WorkloadPath
from auditor.server.state import ClientDep, RootPathDep, SettingsDep, StateDep
from auditor.service import LocalReader
from auditor.web.workload import render_workload_page

router = APIRouter()


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> FileResponse:
    return FileResponse(web.plotly_js_path(), media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})


router.mount("/static", StaticFiles(directory=web.STATIC_DIR), name="static")


@router.get("/login", response_class=HTMLResponse, include_in_schema=False)
def login_form(root: RootPathDep, next: str = "/") -> HTMLResponse:
    """The sign-in form of the pages when a token protects reads."""
    return HTMLResponse(web.render_login(next=local_path(next), root_path=root))


async def _login_form_body(request: Request, limit: int, settings) -> bytes | Response:
    """The sign-in form's body, at most ``limit`` bytes (else a 413 as soon as it is declared
    or received), within the body timeouts (else a 408)."""
    try:
        return await read_body(request, limit, settings.body_timeout_seconds, settings.body_deadline_seconds)
    except BodyTooLarge as e:
        got = f"{e.size} bytes" if e.size is not None else "more"
        return problem(413, "too_large", f"sign-in form larger than {limit} bytes, got {got}",
                       request.url.path, headers={"Connection": "close"},
                       errors=[{"field": "body", "loc": [], "type": "too_long", "msg": f"at most {limit} bytes"}])
    except BodyTimeout as e:
        return problem(408, "request_timeout", str(e), request.url.path, headers={"Connection": "close"})
    except ClientDisconnect:
        return disconnected(request)


@router.post("/login", include_in_schema=False)
async def login(request: Request, state: StateDep, settings: SettingsDep, client: ClientDep,
                root: RootPathDep) -> Response:
    """Check the token of the sign-in form (the read token or the service token); keep it in
    an HttpOnly, SameSite=Strict cookie that GET/HEAD requests of this browser are
    authorised with, and go back to the page asked for (303). Wrong token: the form again, 401.
    After ``login_max_failures`` wrong tokens from one client address within
    ``login_failure_window_seconds``, every sign-in of that address is the form again with a
    429 and Retry-After until the window ends (the token is not even compared). A body over
    ``LOGIN_BODY_BYTES`` (8 KiB) + 3 bytes per character of the longest token is a 413
    ``too_large`` as soon as it is declared or received (the rest is never read); a body
    that stalls is a 408, as on the write endpoints."""
    limit = LOGIN_BODY_BYTES + 3 * max((len(t) for t in (settings.read_token, settings.token) if t), default=0)
    throttle = state.login_failures
    wait = throttle.blocked(client)
    if wait > 0:
        throttled.warning("login", "more than %d wrong tokens at POST /login from %s within %g s "
                                   "(AUDITOR_LOGIN_MAX_FAILURES): answering 429", throttle.limit, client,
                          throttle.window)
        return HTMLResponse(web.render_login(
            next="/", root_path=root,
            error=f"Too many wrong tokens from this address: try again in {math.ceil(wait)} s."),
            status_code=429, headers={"Retry-After": str(math.ceil(wait)), "Connection": "close"})
    body = await _login_form_body(request, limit, settings)
    if isinstance(body, Response):
        return body
    form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0]
    target = local_path((form.get("next") or ["/"])[0])
    known = [t for t in (settings.read_token, settings.token) if t]
    if known and not any(hmac.compare_digest(token.encode(), t.encode()) for t in known):
        throttle.failed(client)
        return HTMLResponse(web.render_login(next=target, error="That is not this auditor's token.",
                                             root_path=root), status_code=401)
    throttle.succeeded(client)
    response = RedirectResponse(root + target, status_code=303)
    if known:
        response.set_cookie(TOKEN_COOKIE, urllib.parse.quote(token, safe=""), httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path=root or "/")
    return response


@router.get("/runbook", response_class=HTMLResponse, include_in_schema=False)
def runbook(root: RootPathDep) -> HTMLResponse:
    """The alert runbook (docs/alerts.md): where every alert's runbook_url points."""
    return HTMLResponse(web.render_runbook(root_path=root))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def runs_page(
    state: StateDep,
    root: RootPathDep,
    cursor: str | None = Query(None, max_length=1024),
    status: Literal["inconsistent", "unverified", "incomplete", "consistent", "pending"] | None = None,
) -> HTMLResponse:
    after = decode_cursor(cursor, runs_key)
    rows, last = state.service.runs_page(limit=100, after=after, status=status)
    return HTMLResponse(web.render_runs_page([r.to_json() for r in rows], next_cursor=encode_cursor(list(last)) if last else None,
                                             status=status, root_path=root))


@router.get("/runs/{run_id}", response_class=HTMLResponse, name="run_page", include_in_schema=False)
def run_page(
    request: Request,
    state: StateDep,
    root: RootPathDep,
    run_id: str = RunIdPath,
    statistic: str | None = Query(None, min_length=1, max_length=128, pattern=STATISTIC_PATTERN),
    step: int | None = Query(None, ge=0, le=2**62),
    from_rank: int = Query(0, ge=0, le=2**31 - 1),
    from_mb: int = Query(0, ge=0, le=2**31 - 1),
) -> Response:
    """The run page: verdict counts, σ per step, faults per step, per-rank detail of the
    bad steps (``?statistic=&step=`` selects one; its table shows
    :data:`auditor.web.PAGE_RANK_ROWS` rows from ``from_rank``/``from_mb`` on). At most
    ``max_concurrent_pages`` render at once per process (each streams the run's step
    summaries, so it holds a few MB whatever the run's length); past it a 503 with
    Retry-After."""
    if not state.page_slots.acquire(blocking=False):
        return _overloaded(state, request)
    try:
        page = web.gather_run_page(LocalReader(state.service), run_id, statistic=statistic, step=step,
                                   from_row=(from_rank, from_mb) if (from_rank, from_mb) != (0, 0) else None)
        return HTMLResponse(web.render_run_page(**page, root_path=root))
    finally:
        state.page_slots.release()


def _overloaded(state, request: Request) -> Response:
    """503 with Retry-After: ``max_concurrent_pages`` pages render already."""
    limit = state.settings.max_concurrent_pages
    throttled.warning("pages", "more than %d run pages rendering (AUDITOR_MAX_CONCURRENT_PAGES): answering 503", limit)
    return problem(503, "overloaded", f"more than {limit} run pages rendering at once "
                                      "(AUDITOR_MAX_CONCURRENT_PAGES); retry later", request.url.path,
                   headers={"Retry-After": RETRY_AFTER})


@router.get("/workloads/{workload}", response_class=HTMLResponse, name="workload_page", include_in_schema=False)
def workload_page(request: Request, state: StateDep, root: RootPathDep, workload: str = WorkloadPath) -> Response:
    """The workload page: the runs of ``workload`` at their layouts, each statistic's verdict
    and findings, every run's statistic overlaid per step with the differing steps marked
    (the comparison of ``GET /v1/workloads/{workload}``: bounded as it is). Shares the run
    pages' ``max_concurrent_pages`` slots."""
    if not state.page_slots.acquire(blocking=False):
        return _overloaded(state, request)
    try:
        doc, curves = state.service.workload_page(workload)
        return HTMLResponse(render_workload_page({**doc.to_json(), "curves": curves}, root_path=root))
    finally:
        state.page_slots.release()
