"""Delivery of encoded reports to ``POST /v1/reports``: the one retry loop of the trainer side.

:func:`deliver` is used by the client's sender thread (:class:`auditor.trainer.client.AuditorClient`)
and by ``auditor import`` (:func:`auditor.offline.upload`). One POST is classified by
:func:`post_lines`: transient failures (connection errors, timeouts, 408/429/5xx, and
401/403/404, which are configuration errors the data must survive) are retried with capped
exponential backoff and full jitter (:func:`backoff`), honouring ``Retry-After``; 409/422
naming report indices reject just those reports and resend the rest; 413, and a 400/422
of several reports that names none of them, splits the batch. A batch answered 500-class
(not 502/503/504) :data:`POISON_AFTER` times in a row is bisected, so one report that
breaks the service never blocks the others. Replays are safe because the service treats
an identical re-send as a no-op.
"""

from __future__ import annotations

import email.utils
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

#: Upper bound of one backoff sleep, seconds (the client notices a recovered service within it).
MAX_BACKOFF = 10.0
#: First backoff sleep, seconds; doubled on every consecutive transient failure.
BASE_BACKOFF = 0.1
#: Statuses retried like a network error: the data is fine, the service or its configuration is not.
TRANSIENT = frozenset({401, 403, 404, 405, 408, 425, 429})
#: Statuses that, for ``auditor import`` (a person at a terminal), mean the URL or the token
#: is wrong: reported at once instead of retried (the trainer's client retries them, so that
#: the data survives a misconfiguration until it is fixed).
CONFIGURATION_ERRORS = frozenset({401, 403, 404, 405})
#: 5xx statuses that mean the service (or a proxy's upstream) is away, not that this batch
#: broke it: retried for ever, never bisected.
PASSING = frozenset({502, 503, 504})
#: Consecutive 500-class answers to one batch after which it is bisected (and a single
#: report that still gets them is rejected as poison).
POISON_AFTER = 3


def encode(report: dict) -> bytes:
    """One report as compact JSON bytes (``NaN``/``Infinity`` tokens for non-finite floats)."""
    return json.dumps(report, separators=(",", ":")).encode()


@dataclass
class Outcome:
    """What one POST of a batch of encoded reports came to (see :func:`post_lines`)."""

    kind: str  # "sent" | "retry" | "partial" | "rejected" | "split"
    delay: float = 0.0
    rejected: frozenset[int] = field(default_factory=frozenset)
    message: str = ""
    #: ``sent``: how many of the batch the service already had (identical re-sends).
    duplicates: int = 0
    #: a 5xx that says "this request failed" (500, 501, ...), not "the service is away"
    #: (502/503/504): repeated on one batch, it marks a poison report (see :func:`deliver`)
    server_error: bool = False
    status: int | None = None  # the HTTP status; None for a network error


def post_lines(http: httpx.Client, url: str, lines: list[bytes]) -> Outcome:
    """POST ``lines`` (encoded reports) as one ``{"reports": [...]}`` body and classify the answer.

    ``sent``: all stored (or identical re-sends). ``retry``: transient, resend the same
    batch after at least ``delay`` s. ``partial``: the reports at indices ``rejected`` were
    refused (409 conflicts, 422 validation), resend the others. ``rejected``: the whole
    batch was refused. ``split``: 413, or a 400/422 of several reports that names none of
    them (one line is not JSON): resend in halves, which isolates the bad one.
    """
    body = b'{"reports":[' + b",".join(lines) + b"]}"
    try:
        response = http.post(f"{url}/v1/reports", content=body)
    except httpx.TransportError as exc:
        return Outcome("retry", 0.0, message=f"{type(exc).__name__}: {exc}")
    status = response.status_code
    if status < 300:
        try:
            duplicates = int(response.json().get("duplicates", 0))
        except (ValueError, AttributeError, TypeError):
            duplicates = 0
        return Outcome("sent", duplicates=duplicates)
    if status in TRANSIENT or status >= 500:
        return Outcome("retry", retry_after(response), message=f"HTTP {status}: {response.text[:200]}",
                       server_error=status >= 500 and status not in PASSING, status=status)
    if status == 413 and len(lines) > 1:
        return Outcome("split", message="HTTP 413")
    if status in (409, 422):
        bad = _named_indices(response, len(lines))
        if bad:
            return Outcome("partial", rejected=bad, message=f"HTTP {status}: {response.text[:500]}")
    if status in (400, 422) and len(lines) > 1:
        return Outcome("split", message=f"HTTP {status}")
    return Outcome("rejected", message=f"HTTP {status}: {response.text[:500]}", status=status)


def _named_indices(response: httpx.Response, n: int) -> frozenset[int]:
    """Report indices a 409 or 422 problem-details body names (``conflicts[].index``, or
    ``errors[].loc`` = ``["reports", i, ...]``); empty when it names none, when any error
    does not name a report, or when an index is out of range."""
    try:
        body = response.json()
        if body.get("conflicts"):
            bad = {int(c["index"]) for c in body["conflicts"]}
        else:
            errors = body["errors"]
            bad = {int(e["loc"][1]) for e in errors if list(e["loc"][:1]) == ["reports"] and len(e["loc"]) > 1}
            if len(bad) != len({int(e["loc"][1]) if len(e["loc"]) > 1 else -1 for e in errors}):
                return frozenset()
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return frozenset()
    return frozenset(bad) if bad and bad <= set(range(n)) else frozenset()


def backoff(failures: int, cap: float = MAX_BACKOFF) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, BASE·2^(failures−1))]."""
    return random.uniform(0.0, min(cap, BASE_BACKOFF * 2.0 ** (failures - 1)))


def retry_after(response: httpx.Response) -> float:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), capped; 0 if absent."""
    value = response.headers.get("Retry-After")
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return 0.0
    return min(max(seconds, 0.0), MAX_BACKOFF) if math.isfinite(seconds) else 0.0


class DeliveryError(ConnectionError):
    """``max_attempts`` consecutive transient failures: ``outcome`` is the last one."""

    def __init__(self, outcome: Outcome, failures: int):
        super().__init__(f"{outcome.message} ({failures} attempts)")
        self.outcome, self.failures = outcome, failures


def _never() -> bool:
    return False


def deliver(
    http: httpx.Client,
    url: str,
    lines: list[bytes],
    *,
    on_final: Callable[[str, list[bytes], list[list[bytes]], Outcome], None],
    on_retry: Callable[[Outcome, int], None] | None = None,
    on_answer: Callable[[], None] | None = None,
    stopped: Callable[[], bool] = _never,
    wait: Callable[[float], object] = time.sleep,
    max_backoff: float = MAX_BACKOFF,
    max_attempts: int | None = None,
) -> bool:
    """POST ``lines`` (encoded reports) to ``{url}/v1/reports`` until each has a final outcome.

    Callbacks: ``on_final(kind, chunk, pending, outcome)`` after the service answered a
    chunk for good — ``kind`` ``sent`` (all of ``chunk`` stored), ``partial`` (the indices
    ``outcome.rejected`` refused, the rest already queued in ``pending``) or ``rejected``
    (all of it); ``pending`` is the list of chunks still to send. ``on_retry(outcome,
    failures)`` after each transient failure, before the backoff sleep ``wait(seconds)``
    (at least ``Retry-After``). ``on_answer()`` whenever the service answered (any
    non-transient outcome, 413 splits included). ``stopped()`` is checked before each POST.

    A chunk answered 500-class (not 502/503/504) :data:`POISON_AFTER` times in a row is
    bisected; a single report that still gets them is final as ``rejected`` with the
    message prefixed ``poison:`` — the reports that are fine get through, and delivery goes
    on after the one that is not.

    Returns True when every line has a final outcome, False if ``stopped()`` turned true
    first. Raises :class:`DeliveryError` after ``max_attempts`` consecutive transient
    failures (``None``: retry forever).
    """
    pending = [lines]
    failures = 0
    server_errors = 0
    while pending:
        if stopped():
            return False
        chunk = pending.pop()
        out = post_lines(http, url, chunk)
        if out.kind == "retry":
            failures += 1
            server_errors = server_errors + 1 if out.server_error else 0
            if server_errors >= POISON_AFTER:
                failures = server_errors = 0
                if len(chunk) > 1:
                    half = len(chunk) // 2
                    pending += [chunk[half:], chunk[:half]]
                else:
                    on_final("rejected", chunk, pending, Outcome("rejected", message=f"poison: {out.message}",
                                                                 status=out.status))
                continue
            if on_retry is not None:
                on_retry(out, failures)
            if max_attempts is not None and failures >= max_attempts:
                raise DeliveryError(out, failures)
            pending.append(chunk)
            wait(max(out.delay, backoff(failures, max_backoff)))
            continue
        failures = server_errors = 0
        if on_answer is not None:
            on_answer()
        if out.kind == "split":
            half = len(chunk) // 2
            pending += [chunk[half:], chunk[:half]]
        elif out.kind == "partial":
            rest = [line for i, line in enumerate(chunk) if i not in out.rejected]
            if rest:
                pending.append(rest)
            on_final("partial", chunk, pending, out)
        else:
            on_final(out.kind, chunk, pending, out)
    return True
