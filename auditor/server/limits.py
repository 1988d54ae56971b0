"""What keeps one caller from taking the service: requests in progress per budget
(:class:`ConcurrencyMiddleware`), wrong sign-in tokens per address (:class:`FailureThrottle`),
and log lines of a recurring condition throttled to one a minute (:data:`throttled`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from auditor.server.problems import RETRY_AFTER, problem, send_problem

log = logging.getLogger("auditor.api")


class Throttled:
    """Log a recurring condition once when it starts, then at most once per ``every`` s
    with the number of repeats (not one line per event: a flood must not fill the disk)."""

    def __init__(self, logger: logging.Logger, every: float = 60.0):
        self._log, self._every = logger, every
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._every:
            self._count[key] = self._count.get(key, 0) + 1
            return
        repeats = self._count.pop(key, 0)
        self._last[key] = now
        self._log.warning(message + (f" ({repeats} more since the last such line)" if repeats else ""), *args)


throttled = Throttled(log)


class FailureThrottle:
    """Failed attempts per client address in a window (``POST /login``'s wrong tokens):
    after ``limit`` failures within ``window`` s of an address's first one, :meth:`blocked`
    says how many seconds remain until the window ends (the address is refused meanwhile,
    whatever it sends). At most ``max_clients`` addresses are tracked (the oldest windows
    are forgotten first), so a flood of addresses cannot grow memory. Event loop only."""

    def __init__(self, limit: int, window: float, max_clients: int = 10_000):
        self.limit, self.window, self.max_clients = limit, window, max_clients
        self._failures: dict[str, tuple[float, int]] = {}  # address -> (window start, failures); oldest first

    def _current(self, client: str, now: float) -> tuple[float, int] | None:
        entry = self._failures.get(client)
        if entry is not None and now - entry[0] >= self.window:
            del self._failures[client]
            return None
        return entry

    def blocked(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0.0 when it may now."""
        now = time.monotonic()
        entry = self._current(client, now)
        return entry[0] + self.window - now if entry is not None and entry[1] >= self.limit else 0.0

    def failed(self, client: str) -> None:
        """Count one failure of ``client``."""
        now = time.monotonic()
        start, n = self._current(client, now) or (now, 0)
        self._failures.pop(client, None)
        self._failures[client] = (start, n + 1)
        while len(self._failures) > self.max_clients:
            del self._failures[next(iter(self._failures))]

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures."""
        self._failures.pop(client, None)


#: Paths with a concurrency budget of their own (``max_concurrent_probes``): a load
#: balancer's readiness probe and Prometheus's scrape must answer while ingest is saturated.
PROBE_PATHS = frozenset({"/readyz", "/metrics"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class ConcurrencyMiddleware:
    """Requests in progress, in three budgets: probes (:data:`PROBE_PATHS`, ``probe_limit``),
    other reads (GET/HEAD/OPTIONS, ``read_limit``) and everything else — the writes, whose
    bodies a slow client can hold open — (``limit``). Past a budget: 503 + Retry-After at
    once (logged once per episode). ``/healthz`` has no cap, so liveness answers under any
    load; stalled bodies or a burst of ingest never take a probe's or a reader's slot."""

    def __init__(self, app, limit: int, probe_limit: int, read_limit: int):
        self.app = app
        self.limits = {"write": (limit, "AUDITOR_MAX_CONCURRENT_REQUESTS", ""),
                       "read": (read_limit, "AUDITOR_MAX_CONCURRENT_READS", "read "),
                       "probe": (probe_limit, "AUDITOR_MAX_CONCURRENT_PROBES", "probe ")}
        self.active = dict.fromkeys(self.limits, 0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/healthz":
            return await self.app(scope, receive, send)
        budget = ("probe" if scope["path"] in PROBE_PATHS else
                  "read" if scope["method"] in _READ_METHODS else "write")
        limit, setting, what = self.limits[budget]
        if self.active[budget] >= limit:
            throttled.warning(setting, "more than %d %srequests in progress (%s): answering 503", limit, what, setting)
            return await send_problem(send, problem(
                503, "overloaded", f"more than {limit} {what}requests in progress ({setting})", scope["path"],
                headers={"Retry-After": RETRY_AFTER}), scope)
        self.active[budget] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active[budget] -= 1
