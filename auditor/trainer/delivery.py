"""Delivery of encoded reports to ``POST /v1/reports``: the one retry loop of the trainer side.

:func:`deliver` is used by the client's sender thread (:class:`auditor.trainer.client.AuditorClient`)
and by ``auditor import`` (:func:`auditor.offline.upload`). One POST is classified by
:func:`post_lines`: transient failures (connection errors, timeouts, 408/429/5xx, and
401/403/404, which are configuration errors the data must survive) are retried with capped
exponential backoff and full jitter (:func:`backoff`), honouring ``Retry-After``; 409/422
naming report indices reject just those reports and resend the rest; 413, and a 400/422
of several reports that names none of them, splits the batch. A batch answered 500-class
(not 502/503/504) :data:`POISON_AFTER` times in a row is bisected, so one report that
breaks the service never blocks the others — but a report is dead-lettered only when the
service is demonstrably healthy for other input; a service that fails everything is an
outage, waited out with the batch kept whole. Replays are safe because the service treats
an identical re-send as a no-op.

Nothing an answer holds is trusted: each POST is one exchange of
:func:`auditor.bounded_http.exchange` — the whole answer within the client's timeout
(:func:`exchange_seconds`) and :func:`answer_limit` bytes — and a batch counts as sent only
on an ingest answer whose ``accepted`` and ``duplicates`` add up to it. Anything else — a
2xx of HTML or of the wrong types, a redirect, an answer past its bound — is retried like an
outage and marked ``foreign`` (the URL points at something that is not an auditor).
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

from auditor.bounded_http import BadAnswer, exchange

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
#: broke it: retried for ever, never bisected (as is any 5xx that carries ``Retry-After``).
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
    #: the answer is not an auditor's (a 2xx that is no ingest answer, a redirect, a body
    #: over the bound): the URL points elsewhere (a proxy, another service)
    foreign: bool = False


#: Bytes of a 2xx ingest answer read at most (``{"accepted": N, "duplicates": M,
#: "steps_audited": K}`` is a few dozen): past it the answer is not an auditor's.
MAX_SENT_ANSWER_BYTES = 4 << 10
#: Bytes of an error answer (problem details) read at most: a base plus, per report of the
#: batch, room for its entry in ``conflicts``/``errors`` (the service lists one per report).
MAX_PROBLEM_BYTES, PROBLEM_BYTES_PER_REPORT = 64 << 10, 2 << 10
#: Seconds one exchange (connect, send, the whole answer) may take when the client's own
#: timeout says nothing (``timeout=None``).
DEFAULT_EXCHANGE_SECONDS = 30.0


def answer_limit(n: int) -> Callable[[int], int]:
    """The most bytes of an answer to a batch of ``n`` reports read, by status (see
    :data:`MAX_SENT_ANSWER_BYTES`, :data:`MAX_PROBLEM_BYTES`)."""
    return lambda status: MAX_SENT_ANSWER_BYTES if status < 300 else MAX_PROBLEM_BYTES + PROBLEM_BYTES_PER_REPORT * n


def exchange_seconds(http: httpx.Client) -> float:
    """The total deadline of one exchange of ``http``: its read timeout (what it waits for an
    answer), else its connect timeout, else :data:`DEFAULT_EXCHANGE_SECONDS`."""
    t = http.timeout
    return t.read or t.connect or DEFAULT_EXCHANGE_SECONDS


def post_lines(http: httpx.Client, url: str, lines: list[bytes]) -> Outcome:
    """POST ``lines`` (encoded reports) as one ``{"reports": [...]}`` body and classify the answer.

    ``sent``: an ingest answer whose ``accepted`` and ``duplicates`` add up to the batch.
    ``retry``: transient, resend the same batch after at least ``delay`` s — a network
    error, no whole answer within :func:`exchange_seconds` or :func:`answer_limit` bytes,
    408/429/5xx, 401/403/404/405, a redirect, or a 2xx that is not an ingest answer of this
    batch (HTML, wrong types, counts that do not add up: ``foreign``). ``partial``: the
    reports at indices ``rejected`` were refused (409 conflicts, 422 validation), resend the
    others. ``rejected``: the whole batch was refused. ``split``: 413, or a 400/422 of several
    reports that names none of them (one line is not JSON): resend in halves, which
    isolates the bad one. Messages quote the problem's ``detail``.
    """
    body = b'{"reports":[' + b",".join(lines) + b"]}"
    try:
        answer = exchange(http, "POST", f"{url}/v1/reports", content=body, max_bytes=answer_limit(len(lines)),
                          seconds=exchange_seconds(http))
    except BadAnswer as exc:
        return Outcome("retry", message=f"{exc.url} answered {exc}", status=exc.status, foreign=True)
    except httpx.TransportError as exc:
        return Outcome("retry", 0.0, message=f"{url}/v1/reports: {type(exc).__name__}: {exc}")
    status = answer.status
    if status < 300:
        duplicates = _ingest_answer(answer.body, len(lines))
        if duplicates is None:
            return Outcome("retry", message=f"{answer.url} answered HTTP {status} with what is not an auditor's "
                           f"answer to a batch of {len(lines)} report(s): {_snippet(answer.body)}",
                           status=status, foreign=True)
        return Outcome("sent", duplicates=duplicates, status=status)
    if status < 400:
        where = answer.headers.get("Location", "nowhere")
        return Outcome("retry", message=f"{answer.url} answered HTTP {status} (a redirect to {where}; an auditor "
                       "answers none: give the service's base URL)", status=status, foreign=True)
    problem = _answer_json(answer.body)
    said = f"{answer.url} answered HTTP {status}: {problem_detail(problem, answer.body)}"
    if status in TRANSIENT or status >= 500:
        delay = retry_after(answer.headers)
        return Outcome("retry", delay, message=said,
                       server_error=status >= 500 and status not in PASSING and not answer.headers.get("Retry-After"),
                       status=status)
    if status == 413 and len(lines) > 1:
        return Outcome("split", message=said, status=status)
    if status in (409, 422):
        bad = _named_indices(problem, len(lines))
        if bad:
            return Outcome("partial", rejected=bad, message=said, status=status)
    if status in (400, 422) and len(lines) > 1:
        return Outcome("split", message=said, status=status)
    return Outcome("rejected", message=said, status=status)


def _ingest_answer(body: bytes, n: int) -> int | None:
    """``duplicates`` of an ingest answer to a batch of ``n`` reports — a JSON object whose
    ``accepted`` and ``duplicates`` are integers ≥ 0 adding up to ``n`` — else None."""
    doc = _answer_json(body)
    if not isinstance(doc, dict):
        return None
    accepted, duplicates = doc.get("accepted"), doc.get("duplicates")
    if type(accepted) is not int or type(duplicates) is not int or min(accepted, duplicates) < 0:
        return None
    return duplicates if accepted + duplicates == n else None


def problem_detail(problem: object, body: bytes = b"", limit: int = 2000) -> str:
    """What an error answer says, in one line: a problem's ``detail`` (its ``title`` if it
    has none), else the start of the body; at most ``limit`` characters."""
    if isinstance(problem, dict):
        said = problem.get("detail") or problem.get("title")
        if isinstance(said, str) and said.strip():
            text = " ".join(said.split())
            return text if len(text) <= limit else text[:limit] + " …"
    return _snippet(body)


def _snippet(body: bytes, limit: int = 200) -> str:
    """The start of a body as one line (``(empty)`` for none)."""
    text = " ".join(body[:limit * 4].decode("utf-8", "replace").split())
    return repr(text[:limit] + (" …" if len(text) > limit or len(body) > limit * 4 else "")) if text else "(empty)"


def _named_indices(body: object, n: int) -> frozenset[int]:
    """Report indices a 409 or 422 problem-details body names (``conflicts[].index``, or
    ``errors[].loc`` = ``["reports", i, ...]``); empty when it names none, when any error
    does not name a report, or when an index is out of range."""
    try:
        if body.get("conflicts"):
            bad = {_report_index(c["index"]) for c in body["conflicts"]}
        else:
            errors = body["errors"]
            bad = {_report_index(e["loc"][1]) for e in errors
                   if list(e["loc"][:1]) == ["reports"] and len(e["loc"]) > 1}
            if len(bad) != len({_report_index(e["loc"][1]) if len(e["loc"]) > 1 else -1 for e in errors}):
                return frozenset()
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return frozenset()
    return frozenset(bad) if bad and bad <= set(range(n)) else frozenset()


def _answer_json(body: bytes) -> object:
    """``body`` as JSON, or None when it is not JSON (the JSON parser's ``RecursionError`` on
    deeply nested garbage included: an answer never raises here)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _report_index(value: object) -> int:
    """A report index as the service writes it, a JSON integer; anything else (``1e999``,
    read as an infinite float, whose ``int()`` is an OverflowError; ``1.5``; ``true``) is a
    TypeError: an answer that names no report."""
    if type(value) is not int:
        raise TypeError(f"not a report index: {value!r}")
    return value


def backoff(failures: int, cap: float = MAX_BACKOFF) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, BASE·2^(failures−1))]."""
    return random.uniform(0.0, min(cap, BASE_BACKOFF * 2.0 ** (failures - 1)))


def retry_after(headers: httpx.Headers) -> float:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date), capped; 0 if absent."""
    value = headers.get("Retry-After")
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
    """Delivery gave up: ``max_attempts`` consecutive transient failures, or (``unreachable``)
    no HTTP answer at all within ``unreachable_after`` seconds. ``outcome`` is the last failure."""

    def __init__(self, outcome: Outcome, failures: int, unreachable: bool = False):
        what = "no HTTP answer" if unreachable else outcome.message
        super().__init__(f"{what} ({failures} attempts)" if not unreachable
                         else f"unreachable: {outcome.message} ({failures} attempts, {what})")
        self.outcome, self.failures, self.unreachable = outcome, failures, unreachable


def _never() -> bool:
    return False


def probe(http: httpx.Client, url: str) -> bool:
    """Whether the service answers ``GET {url}/readyz`` with a status below 500 (it is up and
    its database answers): the check that a report failing alone is poison, not an outage."""
    try:
        return exchange(http, "GET", f"{url}/readyz", max_bytes=MAX_SENT_ANSWER_BYTES,
                        seconds=exchange_seconds(http)).status < 500
    except httpx.HTTPError:
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
    unreachable_after: float | None = None,
) -> bool:
    """POST ``lines`` (encoded reports) to ``{url}/v1/reports`` until each has a final outcome.

    Callbacks: ``on_final(kind, chunk, pending, outcome)`` after the service answered a
    chunk for good — ``kind`` ``sent`` (all of ``chunk`` stored), ``partial`` (the indices
    ``outcome.rejected`` refused, the rest already queued in ``pending``) or ``rejected``
    (all of it); ``pending`` is the list of chunks still to send. ``on_retry(outcome,
    failures)`` after each transient failure, before the backoff sleep ``wait(seconds)``
    (at least ``Retry-After``). ``on_answer()`` whenever the service answered (any
    non-transient outcome, 413 splits included). ``stopped()`` is checked before each POST.

    Poison or outage: a chunk answered 500-class (not 502/503/504, and without
    ``Retry-After``) :data:`POISON_AFTER` times in a row is isolated by :class:`_Isolation`
    (bisection). A report is final as ``rejected`` (message prefixed ``poison:``) only when
    the service is demonstrably healthy for other input: the POST just before its own
    failure succeeded, and the service still answers right after it (:func:`probe`). When
    sub-batches keep failing with no success in between, it is an outage: the chunk is kept
    whole and retried with backoff — reports are never dead-lettered because the service is
    sick.

    Returns True when every line has a final outcome, False if ``stopped()`` turned true
    first. Raises :class:`DeliveryError` after ``max_attempts`` consecutive transient
    failures (``None``: retry forever), or — ``unreachable_after`` seconds — when no POST
    got any HTTP answer for that long since the call began (a host that accepts
    connections and never answers).
    """
    return _Delivery(http, url, lines, on_final, on_retry, on_answer, stopped, wait, max_backoff, max_attempts,
                     unreachable_after).run()


class _Delivery:
    """One :func:`deliver` call: the chunks still to send and the current failure streak."""

    def __init__(self, http, url, lines, on_final, on_retry, on_answer, stopped, wait, max_backoff, max_attempts,
                 unreachable_after) -> None:
        self.http, self.url, self.on_final, self.on_retry, self.on_answer = http, url, on_final, on_retry, on_answer
        self.stopped, self.wait, self.max_backoff = stopped, wait, max_backoff
        self.max_attempts, self.unreachable_after = max_attempts, unreachable_after
        self.pending = [lines]
        self.failures = 0
        self.server_errors = 0
        self.started = time.monotonic()
        self.answered = False

    def run(self) -> bool:
        """POST the last pending chunk until none is left (True) or ``stopped()`` (False)."""
        pending = self.pending
        while pending:
            if self.stopped():
                return False
            chunk = pending.pop()
            out = post_lines(self.http, self.url, chunk)
            if out.kind == "retry":
                if not self._retry(chunk, out):
                    return False
                continue
            self.answered = True
            self.failures = self.server_errors = 0
            if self.on_answer is not None:
                self.on_answer()
            _settle_answer(out, chunk, pending, self.on_final)
        return True

    def _retry(self, chunk: list[bytes], out: Outcome) -> bool:
        """After a transient failure: isolate a poison report once 500-class answers repeat,
        else count it, raise at the limits and put ``chunk`` back after the backoff.
        False when ``stopped()`` turned true during an isolation."""
        self.answered = self.answered or out.status is not None
        self.failures += 1
        self.server_errors = self.server_errors + 1 if out.server_error else 0
        if self.server_errors >= POISON_AFTER:
            self.server_errors = 0
            iso = _Isolation(self.http, self.url, chunk, self.pending, self.on_final, self.stopped)
            held, last = iso.run()
            if iso.answered and self.on_answer is not None:
                self.on_answer()
            if not held:
                self.failures = 0
                return True
            chunk, out = held, last or out  # an outage (or a stop): keep the rest whole
            if self.stopped():
                self.pending.append(chunk)
                return False
        if self.on_retry is not None:
            self.on_retry(out, self.failures)
        self._raise_at_limits(out)
        self.pending.append(chunk)
        self.wait(max(out.delay, backoff(self.failures, self.max_backoff)))
        return True

    def _raise_at_limits(self, out: Outcome) -> None:
        """:class:`DeliveryError` after ``max_attempts`` failures in a row, or when no POST got
        an HTTP answer for ``unreachable_after`` seconds since the call began."""
        if self.max_attempts is not None and self.failures >= self.max_attempts:
            raise DeliveryError(out, self.failures)
        if (self.unreachable_after is not None and not self.answered
                and time.monotonic() - self.started >= self.unreachable_after):
            raise DeliveryError(out, self.failures, unreachable=True)


def _settle_answer(out: Outcome, chunk: list[bytes], pending: list, on_final) -> None:
    """An answer that is not a transient failure: a split queues the halves, a partial
    rejection queues the rest, and ``on_final`` learns the outcome."""
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


#: Failed POSTs in a row, with no success in between, after which an isolation stops and
#: calls it an outage (bounds the extra requests a sick service gets per retry cycle).
OUTAGE_AFTER = 4


class _Isolation:
    """Bisection of a chunk that kept getting 500-class answers (see :func:`deliver`).

    The chunk is cut in halves, each POSTed once, in order. A success proves the service
    healthy for that input, so the failure of the *next* request is blamed on its content:
    a blamed sub-batch is cut again, and a blamed single report is convicted (rejected as
    poison) when the service still answers :func:`probe` right after. A failure not right
    after a success proves nothing: the sub-batch waits until something else succeeds
    (other sub-batches are tried first; when none is left, the first waiting one is cut,
    to find input that passes; when only single reports are left, each failed alone, they
    are poison if the service answers the probe — a batch of nothing but poison).
    :data:`OUTAGE_AFTER` failures in a row without a success, a 502/503/504, a
    ``Retry-After`` or a network error end it as an outage: :meth:`run` returns what is
    still undecided, in order, to be retried whole after a backoff.
    """

    def __init__(self, http, url, chunk, pending, on_final, stopped):
        self.http, self.url, self.pending, self.on_final, self.stopped = http, url, pending, on_final, stopped
        half = len(chunk) // 2
        self.work: list[list[bytes]] = [chunk[:half], chunk[half:]] if len(chunk) > 1 else [chunk]
        self.answered = False

    def _left(self) -> list[list[bytes]]:
        return self.pending + self.work[::-1]  # what on_final sees as still to send

    def _held(self) -> list[bytes]:
        return [line for c in self.work for line in c]

    def run(self) -> tuple[list[bytes], Outcome | None]:
        work = self.work
        waiting: set[int] = set()  # ids of sub-batches that failed since the last success
        last_ok = False  # the previous POST of this isolation succeeded
        misses = 0
        last: Outcome | None = None
        while work:
            if self.stopped():
                return self._held(), last
            fresh = [c for c in work if id(c) not in waiting]
            if not fresh:
                cut = next((c for c in work if len(c) > 1), None)
                if cut is not None:
                    i, half = _index(work, cut), len(cut) // 2
                    work[i:i + 1] = [cut[:half], cut[half:]]
                    continue
                # single reports only, each failed alone since the last success: if the service
                # answers the probe, each is tried once more as if after a success (a batch of
                # nothing but poison), else it is an outage
                if last is None or not probe(self.http, self.url):
                    return self._held(), last
                waiting.clear()
                last_ok, misses = True, 0
                continue
            c = fresh[0]
            out = post_lines(self.http, self.url, c)
            if out.kind == "retry":
                last = out
                self.answered = self.answered or out.status is not None
                if not out.server_error or out.delay > 0:
                    return self._held(), out  # the service is away (or asks for time)
                misses += 1
                blamed, last_ok = last_ok, False
                if blamed and len(c) > 1:
                    i, half = _index(work, c), len(c) // 2
                    work[i:i + 1] = [c[:half], c[half:]]
                elif blamed and probe(self.http, self.url):
                    del work[_index(work, c)]
                    self.on_final("rejected", c, self._left(),
                                  Outcome("rejected", message=f"poison: {out.message}", status=out.status))
                else:
                    waiting.add(id(c))
                if misses >= OUTAGE_AFTER:
                    return self._held(), out
                continue
            self.answered = True
            last_ok, misses = True, 0
            waiting.clear()
            i = _index(work, c)
            del work[i]
            rest: list = []
            _settle_answer(out, c, rest, lambda kind, ch, _p, o: self.on_final(kind, ch, self._left() + rest, o))
            work[i:i] = rest[::-1]
        return [], last


def _index(work: list[list[bytes]], chunk: list[bytes]) -> int:
    """Position of ``chunk`` itself (not an equal one: a spool may repeat a line) in ``work``."""
    return next(i for i, c in enumerate(work) if c is chunk)
