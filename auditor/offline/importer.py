"""``auditor import``: spools uploaded to a live service (:func:`upload`), batch by batch
through the trainer side's one delivery loop, each file's ``.offset`` sidecar advanced only
on a real ingest answer, the reports refused for good dead-lettered next to their spool."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import httpx

from auditor import bounded_http
from auditor.offline.skipped import SkippedLines, unread_message
from auditor.offline.spools import MAX_REPORT_LINE_BYTES, Progress, vet_spools
from auditor.offline_reader import SpoolError
from auditor.trainer.delivery import CONFIGURATION_ERRORS, DeliveryError, Outcome, deliver
from auditor.trainer.spool import SpoolReader, append_lines, dead_letter_path, read_offset, write_offset

log = logging.getLogger("auditor.spool")


class ServiceConfigError(ConnectionError):
    """The service answered as a wrong URL or token would (401/403/404/405), or not as an
    auditor at all (a 2xx that is no ingest answer, a redirect, an answer over the bound)."""


class Unreachable(ConnectionError):
    """No request of an import got any HTTP answer within its time bound."""


def upload(paths: Iterable[str | os.PathLike], url: str, *, token: str | None = None, batch_size: int = 10_000,
           timeout: float = 10.0, read_timeout: float = 120.0, unreachable_after: float | None = None,
           max_attempts: int = 8, restart: bool = False, dead_letters: Sequence[str | os.PathLike] = (),
           on_progress: Progress | None = None, follow_symlinks: bool = False) -> dict[str, Any]:
    """Upload spool files to the service at ``url`` (``auditor import``). Resumable and idempotent.

    The files are read from their offset sidecars for this destination (``restart`` ignores
    them; a spool imported into another service is sent whole), merged so that the reports
    of a step are sent together (:class:`~auditor.trainer.spool.SpoolReader`), and sent in
    requests of at most ``batch_size`` reports cut between steps. After every batch the
    service answered, each file's sidecar is advanced past its lines in that batch for
    ``url``, so an interrupted import continues where it stopped, and a batch sent twice is a
    no-op for the service. Reports the service refuses for good (409/422/413, or one report
    that makes a healthy service fail: :func:`auditor.trainer.delivery.deliver`) are counted
    ``rejected`` and appended to the dead-letter file next to the spool they came from
    (``<spool>.deadletter``); the import goes on after them. A service failing everything
    is an outage, never a reason to dead-letter. The next batch is read while one is on the
    wire (:func:`read_ahead`).

    ``dead_letters``: dead-letter files to retry as well (read whole, no sidecar); when the
    import completes, each keeps only the reports refused again (removed when none is).

    Timeouts, seconds: ``timeout`` to connect and for the first answer; once the service
    answered, ``read_timeout`` for an answer (a large batch may take the service a while).
    ``unreachable_after`` (default ``3 * timeout``): when no request got any HTTP answer for
    that long, give up (a host that accepts connections and never answers).

    Only an ingest answer adding up to the batch (:func:`auditor.trainer.delivery.post_lines`)
    delivers it and advances the sidecars; an answer that is not an auditor's (a junk 200, a
    redirect, one over the bound) is a :class:`ServiceConfigError` at once, nothing
    advanced. The files are vetted first (:func:`vet_spools`, ``follow_symlinks``); a
    sidecar offset past the end of its file (the file was truncated or replaced) is a
    :class:`SpoolError` (``restart`` sends it whole). Lines over
    :data:`MAX_REPORT_LINE_BYTES` are not sent: counted rejected, named, left in the spool.

    ``on_progress(done_bytes, total_bytes, reports_sent)`` is called after every batch.
    Returns counters ``files``, ``sent`` (delivered), ``duplicates`` (of those, already
    stored: an identical re-send), ``rejected``, ``retries``, ``skipped`` (spool files
    already delivered to ``url`` up to their end), and ``dead_lettered`` (dead-letter file →
    reports appended to it). Raises :class:`Unreachable` when no HTTP answer came,
    ``ConnectionError`` after ``max_attempts`` consecutive transient failures (the sidecars
    then mark where to resume), and :class:`ServiceConfigError` at once on 401/403/404/405
    (a wrong URL or token).
    """
    url = url.rstrip("/")
    spools = vet_spools(paths, follow_symlinks=follow_symlinks)
    job = _Import(url, spools, [Path(p) for p in dead_letters], restart=restart, timeout=timeout,
                  read_timeout=read_timeout, max_attempts=max_attempts,
                  give_up=3 * timeout if unreachable_after is None else unreachable_after, on_progress=on_progress)
    job.progress()
    try:
        with bounded_http.client(timeout=timeout, headers=_headers(token)) as job.http:
            for batch in read_ahead(job.reader.batches(batch_size)):
                job.send(batch)
                job.progress()
    except BaseException:
        job.retried.discard()  # interrupted: the dead-letter files stay as they were
        raise
    return job.finish()


def _headers(token: str | None) -> dict[str, str]:
    """The headers of every request of an import: JSON, and the bearer ``token`` if any."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


class _Import:
    """One :func:`upload` under way: its files (the spools, then the dead-letter files it
    retries) and where each stands, its counters, and what
    :func:`~auditor.trainer.delivery.deliver` is told to do with each answer."""

    http: httpx.Client  # set by upload once the client is open

    def __init__(self, url: str, spools: list[Path], retried: list[Path], *, restart: bool, timeout: float,
                 read_timeout: float, max_attempts: int, give_up: float, on_progress: Progress | None):
        """Read each spool's sidecar for ``url`` (none if ``restart``; a retried dead-letter
        file is read whole) and open the merged reader of all files."""
        self.url, self.spools, self.files = url, spools, spools + retried
        self.timeout, self.read_timeout, self.max_attempts, self.give_up = timeout, read_timeout, max_attempts, give_up
        self.on_progress = on_progress
        self.counts: dict[str, Any] = dict.fromkeys(("files", "sent", "duplicates", "rejected", "retries",
                                                     "skipped"), 0)
        self.counts["dead_lettered"] = defaultdict(int)
        self.counts["files"] = len(spools)
        starts = [0 if restart else _resume_at(p, url) for p in spools] + [0] * len(retried)
        self.counts["skipped"] = sum(1 for p, st in zip(spools, starts) if st and st >= p.stat().st_size)
        self.reader = SpoolReader(self.files, starts)
        self.written = list(starts)  # offset recorded in each spool's sidecar
        self.total = sum(self.reader.sizes)
        self.source: dict[int, int] = {}  # id(line) -> file index, for the lines of the batch in flight
        self.retried = _RetriedDeadLetters(retried)
        self.unread = SkippedLines(self.files, "unread")
        self.answered = False  # the service answered once: from then on, only max_attempts bounds the retries

    def progress(self) -> None:
        """Tell ``on_progress`` the bytes read so far and the reports sent or rejected (none
        before the first batch)."""
        if self.on_progress:
            self.on_progress(self.reader.done_bytes(), self.total, self.counts["sent"] + self.counts["rejected"])

    def send(self, batch: list) -> None:
        """Deliver one batch of merged lines (:data:`~auditor.trainer.spool.MergedLine`), all
        but those too long to be a report, then advance the sidecars of its spools."""
        self.name_unread()
        batch = self._sendable(batch)
        lines = [item[3] for item in batch]
        self.source = {id(item[3]): item[1] for item in batch}
        if lines:
            self._deliver(lines)
        ends = {item[1]: item[2] for item in batch}  # each file's lines come in file order
        for i, end in ends.items():
            if i < len(self.spools):
                write_offset(self.files[i], self.url, end)
                self.written[i] = end

    def _sendable(self, batch: list) -> list:
        """``batch`` without its lines over :data:`MAX_REPORT_LINE_BYTES`: never parsed nor
        sent, each counted rejected and named, left in the spool."""
        long = [item for item in batch if len(item[3]) > MAX_REPORT_LINE_BYTES]
        for item in long:
            self.unread.add(item[1], item[2], unread_message(len(item[3]) + 1, "over_report_limit")
                            .replace("skipped", "not sent, left in the spool"))
            self.counts["rejected"] += 1
        return [item for item in batch if len(item[3]) <= MAX_REPORT_LINE_BYTES] if long else batch

    def _deliver(self, lines: list[bytes]) -> None:
        """POST ``lines`` until the service took or refused each; no answer for long enough is
        :class:`Unreachable`, too many transient failures a ``ConnectionError``."""
        try:
            deliver(self.http, self.url, lines, on_final=self.on_final, on_retry=self.on_retry,
                    on_answer=self.on_answer, max_attempts=self.max_attempts,
                    unreachable_after=None if self.answered else self.give_up)
        except DeliveryError as e:
            if e.unreachable:
                raise Unreachable(f"{self.url} is unreachable: {e.outcome.message} — no HTTP answer within "
                                  f"{self.give_up:g} s (--timeout {self.timeout:g} s per attempt); nothing more was "
                                  "imported, re-run to resume") from None
            raise ConnectionError(f"{self.url}: {e}; the .offset sidecars next to the spools mark what was "
                                  "delivered, re-run to resume") from None

    def on_retry(self, out: Outcome, _failures: int) -> None:
        """A failed attempt: an answer no auditor at this URL and token gives ends the import
        (:class:`ServiceConfigError`); anything else is counted and retried."""
        if out.status in CONFIGURATION_ERRORS:
            raise ServiceConfigError(f"{out.message}: check --url and --token; nothing was imported from this batch")
        if out.foreign:
            raise ServiceConfigError(f"{out.message} — is --url an auditor service's base URL? Nothing of this batch "
                                     "counts as imported; the .offset sidecars are unchanged")
        self.counts["retries"] += 1
        if out.status is not None:
            self.on_answer()

    def on_answer(self) -> None:
        """The service answered: from the first answer on, wait ``read_timeout`` for one."""
        if not self.answered:
            self.answered = True
            self.http.timeout = httpx.Timeout(self.timeout, read=max(self.timeout, self.read_timeout))

    def on_final(self, kind: str, chunk: list[bytes], _pending: list, out: Outcome) -> None:
        """Count a chunk sent, or dead-letter its refused lines next to the file each came
        from (a retried dead-letter file's refused-again lines go to its ``.again`` file)."""
        if kind == "sent":
            self.counts["sent"] += len(chunk)
            self.counts["duplicates"] += out.duplicates
            return
        refused = [ln for i, ln in enumerate(chunk) if i in out.rejected] if kind == "partial" else chunk
        self.counts["rejected"] += len(refused)
        by_file: dict[int, list[bytes]] = defaultdict(list)
        for ln in refused:
            by_file[self.source[id(ln)]].append(ln)
        for i, lines in by_file.items():
            retried = i >= len(self.spools)
            dead = self.files[i] if retried else dead_letter_path(self.files[i])
            append_lines(self.retried.again[dead] if retried else dead, lines)
            self.counts["dead_lettered"][str(dead)] += len(lines)
            log.warning("%s: %d reports rejected, appended to %s: %s", self.files[i], len(lines), dead,
                        out.message[:300])

    def name_unread(self) -> None:
        """Name the lines the reader skipped (too long: never sendable, counted rejected) or
        left (torn)."""
        for i, start, n, why in self.reader.take_unread():
            self.unread.add(i, start + n, unread_message(n, why).replace("skipped", "not sent, left in the spool"),
                            torn=why == "torn")
            self.counts["rejected"] += why == "too_long"

    def finish(self) -> dict[str, Any]:
        """The import completed: name what is left unread, advance each spool's sidecar to its
        end (trailing blank lines, files with nothing to send), settle the retried
        dead-letter files; the counters."""
        self.name_unread()
        self.unread.summarise()
        for i, end in enumerate(self.reader.ends[:len(self.spools)]):
            if end > self.written[i]:
                write_offset(self.files[i], self.url, end)
        self.retried.finish()
        self.counts["dead_lettered"] = dict(self.counts["dead_lettered"])
        return self.counts


class _RetriedDeadLetters:
    """The dead-letter files an import retries. The reports refused again are collected beside
    each (``<file>.again``); when the import completes, the file becomes those lines plus
    whatever was appended to it meanwhile (refusals of its spool, a trainer still writing).
    Interrupted: it stays as it is."""

    def __init__(self, files: list[Path]):
        """Note each file's size (the lines being retried) and drop any ``.again`` file left."""
        self.again = {p: p.with_name(p.name + ".again") for p in files}
        self.before = {p: p.stat().st_size for p in files}  # the lines being retried
        self.discard()

    def discard(self) -> None:
        """Drop the ``.again`` files: the dead-letter files stay as they are."""
        for tmp in self.again.values():
            tmp.unlink(missing_ok=True)

    def finish(self) -> None:
        """Replace each file by its lines refused again, then what was appended to it during
        the import (removed when nothing is left)."""
        for dead, tmp in self.again.items():
            with open(dead, "rb") as f:  # appended during the import: kept after the lines refused again
                f.seek(self.before[dead])
                appended = f.read()
            if appended:
                with open(tmp, "ab") as f:
                    f.write(appended)
            if tmp.exists():
                os.replace(tmp, dead)
            else:
                dead.unlink(missing_ok=True)


def _resume_at(path: Path, url: str) -> int:
    """Where the import of ``path`` into ``url`` resumes: its sidecar's offset. An offset past
    the end of the file is a :class:`SpoolError`: the file was truncated or replaced since,
    and "delivered up to there" says nothing of what it holds now."""
    offset, size = read_offset(path, url), path.stat().st_size
    if offset > size:
        raise SpoolError(f"{path}: its .offset sidecar says {offset:,} bytes were delivered to {url}, but the file "
                         f"has {size:,}: it was truncated or replaced since; --restart sends it whole (the service "
                         "ignores what it already has)")
    return offset


def read_ahead(batches: Iterator[list], depth: int = 1) -> Iterator[list]:
    """``batches``, read by a thread up to ``depth`` batches ahead of the consumer: the next
    batch is read and merged while the current one is on the wire (waiting for the answer
    releases the GIL). Holds up to ``depth`` + 2 batches (the consumer's, the queued ones, the
    one being read). An exception of the reader is raised in the consumer; a consumer that
    stops early stops the thread after the batch it is reading."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for b in batches:
                if not put(b):
                    return
            put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(exc)

    t = threading.Thread(target=run, name="spool-reader", daemon=True)
    t.start()
    try:
        while (b := q.get()) is not end:
            if isinstance(b, BaseException):
                raise b
            yield b
    finally:
        stop.set()
        t.join()
