"""Spools without a live service: ``auditor import`` (upload them) and ``auditor audit``
(audit them locally with the service's own flows).

Both stream the spool files through :class:`auditor.trainer.spool.SpoolReader`: the files
(one per rank, as trainers leave them, or one interleaved file) are merged line by line so
that the reports of a step travel together, and cut into batches between steps. A batch is
then what one ``POST /v1/reports`` carries: uploads go through the trainer side's one
delivery loop (:func:`auditor.trainer.delivery.deliver`), offline audits decode it as the
service decodes a request body (:func:`auditor.contract.parse.parse_report_batch`) and store it with
:meth:`auditor.service.Service.ingest` on a local database, which audits every step the batch
completes from the rows in hand. Memory is bounded by the batch size — one batch plus one
line per file; two with the reader process of ``audit``, three with the read-ahead thread
of ``import`` — whatever the size of the spools.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import os
import queue
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import httpx

from auditor import bounded_http
from auditor.db.engine import ensure_schema, make_engine
from auditor.contract.parse import parse_report_batch
from auditor.service import ConflictError, LimitError, NotFound, Service
from auditor.trainer.delivery import CONFIGURATION_ERRORS, DeliveryError, Outcome, deliver
from auditor.offline_reader import BODY_HEAD, BODY_TAIL, Batch, SpoolError, local_batches, piped_batches
from auditor.trainer.spool import MAX_LINE_BYTES, SpoolReader, append_lines, dead_letter_path, read_offset, spool_files, write_offset

log = logging.getLogger("auditor.spool")
_run_id = operator.attrgetter("run_id")

#: ``on_progress(done_bytes, total_bytes, reports)`` of :func:`upload` and :func:`audit_offline`.
Progress = Callable[[int, int, int], None]


class ServiceConfigError(ConnectionError):
    """The service answered as a wrong URL or token would (401/403/404/405), or not as an
    auditor at all (a 2xx that is no ingest answer, a redirect, an answer over the bound)."""


#: Longest spool line :func:`upload` and :func:`audit_offline` decode or send, bytes: the
#: largest valid report (``group_ranks`` of 65,536 ranks, ≈ 460 KB) fits. A longer line is
#: refused before it is parsed (counted, named, left in the spool).
MAX_REPORT_LINE_BYTES = 1 << 20
#: A file none of whose first lines (this many, or :data:`SNIFF_BYTES`) is a valid report
#: is not a spool: refused before anything of it is sent or stored.
SNIFF_LINES = 1000
SNIFF_BYTES = 4 << 20


def vet_spools(paths: Iterable[str | os.PathLike], *, follow_symlinks: bool = False) -> list[Path]:
    """The spool files of ``paths`` (files as given, directories' ``*.jsonl``), each checked
    before anything is read for real. Raises :class:`SpoolError`, in one line naming the
    file, for: a symbolic link (not followed unless ``follow_symlinks``: a ``rank0.jsonl``
    link to ``/etc/passwd`` was posted and copied into a dead-letter file), anything but a
    regular file, a file that is not UTF-8 (a UTF-16/32 byte-order mark, NUL bytes, bytes
    that no UTF-8 text holds — named with the offset), and a file none of whose first
    :data:`SNIFF_LINES` lines (at most :data:`SNIFF_BYTES`) is a valid report (random
    bytes, a log, two million ``{}``). An empty file passes (nothing to do). Reads at most
    :data:`SNIFF_BYTES` plus one line of each file."""
    files = spool_files(paths)
    for p in files:
        if p.is_symlink() and not follow_symlinks:
            raise SpoolError(f"{p} is a symbolic link (to {os.readlink(p)}): not followed; pass --follow-symlinks to "
                             "read what it points to")
        if not p.exists():
            raise SpoolError(f"no such spool file: {p}")
        if not p.is_file():
            raise SpoolError(f"{p} is not a regular file: a spool is a file of JSON lines")
        try:
            _sniff(p)
        except OSError as e:  # a read error names no file: name it
            if e.filename is None:
                raise type(e)(e.errno, e.strerror or str(e), str(p)) from e
            raise
    return files


_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
         b"\xfe\xff": "UTF-16", b"\xef\xbb\xbf": "UTF-8 with a byte-order mark"}


def _sniff(path: Path) -> None:
    """:func:`vet_spools` of one file."""
    with open(path, "rb") as f:
        head = f.read(4)
        for bom, name in _BOMS.items():
            if head.startswith(bom):
                raise SpoolError(f"{path} is {name} text (its byte-order mark), not a spool: a spool is UTF-8 JSON "
                                 "lines, as the trainer writes it")
        f.seek(0)
        seen = read = 0
        while seen < SNIFF_LINES and read < SNIFF_BYTES:
            line = f.readline(MAX_REPORT_LINE_BYTES + 1)
            if not line:
                if not seen:
                    return  # empty, or only blank lines, or one torn line: nothing to refuse
                break
            at, read = read, read + len(line)
            if (nul := line.find(b"\x00")) >= 0:
                raise SpoolError(f"{path} holds NUL bytes (byte {at + nul:,}), not a spool: a spool "
                                 "is UTF-8 JSON lines (UTF-16 or binary data?)")
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpoolError(f"{path} is not UTF-8 (byte {at + e.start:,} is {line[e.start:e.start + 1]!r}), not a "
                                 "spool: a spool is UTF-8 JSON lines") from None
            if not line.endswith(b"\n") or not line.strip():
                if len(line) > MAX_REPORT_LINE_BYTES:  # skip the rest of a line too long to be a report
                    while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                        read += len(more)
                    read += len(more)
                    seen += 1
                continue
            seen += 1
            reports, _errors, n = parse_report_batch(BODY_HEAD + line.strip() + BODY_TAIL, 1)
            if reports is not None and n == 1:
                return
    raise SpoolError(f"{path} is not a spool: none of its first {seen:,} line(s) ({read:,} bytes) is a valid report; "
                     "nothing of it was read further")


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
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    counts: dict[str, Any] = dict.fromkeys(("files", "sent", "duplicates", "rejected", "retries", "skipped"), 0)
    counts["dead_lettered"] = defaultdict(int)
    url = url.rstrip("/")
    spools = vet_spools(paths, follow_symlinks=follow_symlinks)
    counts["files"] = len(spools)
    retried = [Path(p) for p in dead_letters]
    files = spools + retried
    starts = [0 if restart else _resume_at(p, url) for p in spools] + [0] * len(retried)
    counts["skipped"] = sum(1 for p, st in zip(spools, starts) if st and st >= p.stat().st_size)
    reader = SpoolReader(files, starts)
    written = list(starts)  # offset recorded in each spool's sidecar
    total = sum(reader.sizes)
    source: dict[int, int] = {}  # id(line) -> file index, for the lines of the batch in flight
    # refused again, from a retried dead-letter file: collected beside it; when the import
    # completes, the file becomes those lines plus whatever was appended to it meanwhile
    # (refusals of its spool, a trainer still writing). Interrupted: it stays as it is.
    again = {p: p.with_name(p.name + ".again") for p in retried}
    before = {p: p.stat().st_size for p in retried}  # the lines being retried
    for tmp in again.values():
        tmp.unlink(missing_ok=True)

    give_up = 3 * timeout if unreachable_after is None else unreachable_after
    answered = False  # the service answered once: from then on, only max_attempts bounds the retries

    def on_retry(out: Outcome, _failures: int) -> None:
        if out.status in CONFIGURATION_ERRORS:
            raise ServiceConfigError(f"{out.message}: check --url and --token; nothing was imported from this batch")
        if out.foreign:
            raise ServiceConfigError(f"{out.message} — is --url an auditor service's base URL? Nothing of this batch "
                                     "counts as imported; the .offset sidecars are unchanged")
        counts["retries"] += 1
        if out.status is not None:
            on_answer()

    def on_answer() -> None:
        nonlocal answered
        if not answered:
            answered = True
            http.timeout = httpx.Timeout(timeout, read=max(timeout, read_timeout))

    def on_final(kind: str, chunk: list[bytes], _pending: list, out: Outcome) -> None:
        if kind == "sent":
            counts["sent"] += len(chunk)
            counts["duplicates"] += out.duplicates
            return
        refused = [ln for i, ln in enumerate(chunk) if i in out.rejected] if kind == "partial" else chunk
        counts["rejected"] += len(refused)
        by_file: dict[int, list[bytes]] = defaultdict(list)
        for ln in refused:
            by_file[source[id(ln)]].append(ln)
        for i, lines in by_file.items():
            dead = files[i] if i >= len(spools) else dead_letter_path(files[i])
            append_lines(again[dead] if i >= len(spools) else dead, lines)
            counts["dead_lettered"][str(dead)] += len(lines)
            log.warning("%s: %d reports rejected, appended to %s: %s", files[i], len(lines), dead,
                        out.message[:300])

    unread = _SkippedLines(files, "unread")

    def name_unread() -> None:  # lines the reader skipped (too long: never sendable) or left (torn)
        for i, start, n, why in reader.take_unread():
            unread.add(i, start + n, _unread_message(n, why).replace("skipped", "not sent, left in the spool"),
                       torn=why == "torn")
            counts["rejected"] += why == "too_long"

    if on_progress:
        on_progress(reader.done_bytes(), total, 0)
    try:
        with bounded_http.client(timeout=timeout, headers=headers) as http:
            for batch in read_ahead(reader.batches(batch_size)):
                name_unread()
                long = [item for item in batch if len(item[3]) > MAX_REPORT_LINE_BYTES]
                for item in long:  # never parsed nor sent: named, left in the spool
                    unread.add(item[1], item[2], _unread_message(len(item[3]) + 1, "over_report_limit")
                               .replace("skipped", "not sent, left in the spool"))
                    counts["rejected"] += 1
                batch = [item for item in batch if len(item[3]) <= MAX_REPORT_LINE_BYTES] if long else batch
                lines = [item[3] for item in batch]
                source = {id(item[3]): item[1] for item in batch}
                try:
                    if lines:
                        deliver(http, url, lines, on_final=on_final, on_retry=on_retry, on_answer=on_answer,
                                max_attempts=max_attempts, unreachable_after=None if answered else give_up)
                except DeliveryError as e:
                    if e.unreachable:
                        raise Unreachable(f"{url} is unreachable: {e.outcome.message} — no HTTP answer within "
                                          f"{give_up:g} s (--timeout {timeout:g} s per attempt); nothing more was "
                                          "imported, re-run to resume") from None
                    raise ConnectionError(f"{url}: {e}; the .offset sidecars next to the spools mark what was "
                                          "delivered, re-run to resume") from None
                ends = {item[1]: item[2] for item in batch}  # each file's lines come in file order
                for i, end in ends.items():
                    if i < len(spools):
                        write_offset(files[i], url, end)
                        written[i] = end
                if on_progress:
                    on_progress(reader.done_bytes(), total, counts["sent"] + counts["rejected"])
    except BaseException:
        for tmp in again.values():  # interrupted: the dead-letter files stay as they were
            tmp.unlink(missing_ok=True)
        raise
    name_unread()
    unread.summarise()
    for i, end in enumerate(reader.ends[:len(spools)]):  # trailing blank lines, files with nothing to send
        if end > written[i]:
            write_offset(files[i], url, end)
    for dead, tmp in again.items():
        with open(dead, "rb") as f:  # appended during the import: kept after the lines refused again
            f.seek(before[dead])
            appended = f.read()
        if appended:
            with open(tmp, "ab") as f:
                f.write(appended)
        if tmp.exists():
            os.replace(tmp, dead)
        else:
            dead.unlink(missing_ok=True)
    counts["dead_lettered"] = dict(counts["dead_lettered"])
    return counts


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


class Unreachable(ConnectionError):
    """No request of an import got any HTTP answer within its time bound."""


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


def audit_offline(paths: Iterable[str | os.PathLike], database_url: str | None = None, *,
                  run_id: str | None = None, bad_steps: int = 20, batch_size: int = 10_000,
                  on_progress: Progress | None = None, reader_process: bool | None = None,
                  follow_symlinks: bool = False) -> tuple[list[dict], dict]:
    """Audit spool files with no service (``auditor audit``): the service's own flows.

    The files are merged so that the reports of a step come together
    (:class:`~auditor.trainer.spool.SpoolReader`), cut into batches of at most ``batch_size``
    reports between steps, each batch decoded and validated as the service decodes a request
    body (:func:`auditor.contract.parse.parse_report_batch`; a batch with an invalid line is decoded
    line by line, and the invalid lines are logged as ``FILE:LINE`` with the wire field and
    skipped) and stored with :meth:`auditor.service.Service.ingest` into ``database_url``
    (default: a temporary SQLite file, deleted afterwards), which audits every step the batch
    completes exactly as the service does. A batch the service refuses (409: a report
    differs from a stored one, or contradicts its run's topology or spec) is bisected down
    to the reports it refuses, which are counted and skipped. Steps still incomplete at the
    end are audited by :meth:`Service.sweep` with a grace period of 0 (``missing_report``),
    as the service would after its grace period.

    The files are read and merged by a second process
    (:func:`auditor.offline_reader.piped_batches`) when ``reader_process`` is true — by default on a machine with more than one CPU when the
    spools hold at least :data:`READER_PROCESS_BYTES` — so that reading overlaps decoding,
    storing and auditing; memory is then two batches (the one being read, the one being
    stored). ``on_progress(done_bytes, total_bytes, reports_read)`` is called after every batch.
    Returns ``(reports, counts)``: one consistency report per run (the JSON of
    ``GET /v1/runs/{run_id}/report``; only ``run_id`` if given), and counters ``files``,
    ``reports`` (lines read), ``stored``, ``duplicates``, ``invalid`` (not JSON or not a valid
    report), ``conflicting`` (409 on the service: differs from a stored report, topology or spec).
    """
    counts = dict.fromkeys(("files", "reports", "stored", "duplicates", "invalid", "conflicting"), 0)
    files = vet_spools(paths, follow_symlinks=follow_symlinks)  # SpoolError: not a spool, a link, not UTF-8
    counts["files"] = len(files)
    total = sum(p.stat().st_size for p in files)
    tmp = None
    if database_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="auditor-audit-")
        database_url = f"sqlite:///{Path(tmp.name) / 'audit.db'}"
    engine = make_engine(database_url)
    stack = contextlib.ExitStack()
    try:
        ensure_schema(engine, database_url)
        service = Service.from_engine(engine)
        stack.enter_context(_few_collections())
        run_ids: dict[str, None] = {}  # in order of appearance
        invalid = _SkippedLines(files, "invalid")
        conflicting = _SkippedLines(files, "conflicting")

        def ingest(reports: Sequence, lines: Sequence[int], where) -> None:
            """Store ``reports`` (line ``lines[k]`` of the batch is ``reports[k]``); the service
            stores nothing of a batch it refuses: bisect down to the refused reports."""
            try:
                # count refusals once: on the single report the bisection ends at
                out = service.ingest(reports, record_refused=len(reports) == 1)
                counts["stored"] += out.accepted
                counts["duplicates"] += out.duplicates
            except (ConflictError, LimitError) as e:
                if len(reports) == 1:
                    conflicting.add(where[2 * lines[0]], where[2 * lines[0] + 1], f"conflicting report skipped: {e}")
                    return
                half = len(reports) // 2
                ingest(reports[:half], lines[:half], where)
                ingest(reports[half:], lines[half:], where)

        if on_progress:
            on_progress(0, total, 0)
        if reader_process is None:
            reader_process = (os.cpu_count() or 1) > 1 and total >= READER_PROCESS_BYTES
        with (piped_batches(files, batch_size) if reader_process else local_batches(files, batch_size)) as batches:
            for batch in batches:
                counts["reports"] += len(batch) + len(batch.unread)
                for i, start, n, why in batch.unread:
                    invalid.add(i, start + n, _unread_message(n, why), torn=why == "torn")
                reports, lines = _decode(batch, invalid)
                if run_id is not None:
                    keep = [k for k, r in enumerate(reports) if r.run_id == run_id]
                    reports, lines = [reports[k] for k in keep], [lines[k] for k in keep]
                run_ids.update(dict.fromkeys(map(_run_id, reports)))
                if reports:
                    ingest(reports, lines, batch.where)
                if on_progress:
                    on_progress(batch.done, total, counts["reports"])
        counts["invalid"] = invalid.total
        counts["conflicting"] = conflicting.total
        invalid.summarise()
        conflicting.summarise()
        now = time.time() + 1.0
        while service.sweep(grace_seconds=0.0, now=now):
            pass
        reports = [service.report(rid, bad_steps_limit=bad_steps) for rid in run_ids if _has_run(service, rid)]
        return reports, counts
    finally:
        stack.close()
        engine.dispose()
        if tmp is not None:
            tmp.cleanup()


#: Spools at least this large are read by a second process in :func:`audit_offline` (a
#: smaller one is read before that process would have started).
READER_PROCESS_BYTES = 32 << 20

#: Collector thresholds while :func:`audit_offline` runs: those of ``auditor serve``
#: (:data:`auditor.server.app.GC_THRESHOLDS`, where the reason is told): a batch allocates
#: ~10 objects per report that live until it is stored, and the default thresholds make
#: full collections walk them again and again (17 % of the audit's CPU here).
GC_THRESHOLDS = (50_000, 20, 100)


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """What ``auditor serve`` does at start-up (``tune_gc``), undone on exit: everything
    allocated so far frozen out of the collector's reach, and :data:`GC_THRESHOLDS`."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _decode(batch: Batch, invalid: "_SkippedLines") -> tuple[list, Sequence[int]]:
    """The valid reports of a batch of spool lines, decoded as the body of one
    ``POST /v1/reports`` would be, and the line (index in the batch) of each; if that fails
    (some line is invalid), line by line, and the invalid lines (file index and end offset
    in ``batch.where``) are handed to ``invalid``."""
    if not len(batch):
        return [], []
    too_long = max(batch.lengths) > MAX_REPORT_LINE_BYTES
    if not too_long:
        reports, _errors, n = parse_report_batch(batch.body, 1)
        if reports is not None and n == len(batch):
            return reports, range(n)
    good, lines = [], []
    where = batch.where
    for k, line in enumerate(batch.lines()):
        if len(line) > MAX_REPORT_LINE_BYTES:  # refused before it is parsed
            invalid.add(where[2 * k], where[2 * k + 1], _unread_message(len(line) + 1, "over_report_limit"))
            continue
        one, errors, n = parse_report_batch(BODY_HEAD + line + BODY_TAIL, 1000)
        if one is not None and n == 1:
            good.extend(one)
            lines.append(k)
        else:
            invalid.add(where[2 * k], where[2 * k + 1], "invalid report skipped: " + invalid_reason(
                errors if n == 1 else [{"loc": (), "msg": f"{n} JSON values on one line", "type": "value_error"}]))
    return good, lines


#: Invalid lines of one spool file named one by one (the rest are counted): a file that is
#: not a spool at all must not print one identical line per line.
MAX_INVALID_LOGGED = 5


def _unread_message(n: int, why: str) -> str:
    """What :class:`~auditor.trainer.spool.SpoolReader` did with a line it did not read
    (:data:`~auditor.trainer.spool.UnreadLine`: ``n`` bytes, ``why``)."""
    if why == "too_long":
        return (f"invalid report skipped: a line of {n:,} bytes, longer than {MAX_LINE_BYTES >> 20} MiB (the largest "
                "request body the service takes)")
    if why == "over_report_limit":
        return (f"invalid report skipped: a line of {n:,} bytes, longer than the {MAX_REPORT_LINE_BYTES >> 20} MiB a "
                "report may have (not parsed)")
    return f"last line not read: it has no newline ({n:,} bytes): torn by a crash, or still being written"


def invalid_reason(errors: list[dict]) -> str:
    """Why a spool line is not a report, naming the wire field (``local.count``,
    ``coords.cp``) as the service's 422 does: the first error, and how many more there are.
    ``errors``: of :func:`auditor.contract.parse.parse_report_batch` for a body of that one line
    (``loc`` ``("reports", 0, field...)``)."""
    if not errors:
        return "not a report"
    e = errors[0]
    if e["type"] == "json_invalid":
        return f"not JSON ({e['msg'].removeprefix('invalid JSON: ')})"
    loc = list(e["loc"])
    if loc[:2] == ["reports", 0]:
        loc = loc[2:]
    field = ""
    for part in loc:
        field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
    more = f" (+{len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{field or 'report'}: {e['msg']}{more}"


class _SkippedLines:
    """Counts spool lines skipped for one cause (``what``: invalid, conflicting) per file and
    logs the first :data:`MAX_INVALID_LOGGED` of each as ``FILE:LINE: <message>``;
    :meth:`summarise` logs how many more each file had. Lines of one file must be added in
    file order."""

    def __init__(self, files: list[Path], what: str):
        self.files, self.what = files, what
        self.per_file: dict[int, int] = defaultdict(int)
        self.numbers: dict[int, _LineNumbers] = {}
        self.total = 0

    def add(self, i: int, end: int, message: str, torn: bool = False) -> None:
        """The line of file ``i`` ending at byte ``end`` (``torn``: the file ends inside it,
        at ``end``) was skipped: log ``message`` with the file and line number."""
        self.total += 1
        self.per_file[i] += 1
        if self.per_file[i] <= MAX_INVALID_LOGGED:
            where = self.numbers.setdefault(i, _LineNumbers(self.files[i]))
            log.warning("%s:%d: %s", self.files[i], where.line_before(end) + torn, message)

    def summarise(self) -> None:
        for i, n in sorted(self.per_file.items()):
            if n > MAX_INVALID_LOGGED:
                log.warning("%s: %d more %s line(s) skipped (%d in all)", self.files[i], n - MAX_INVALID_LOGGED,
                            self.what, n)


class _LineNumbers:
    """1-based line numbers of byte offsets in one file, for offsets asked in increasing order
    (each byte is scanned once)."""

    def __init__(self, path: str | os.PathLike):
        self.path, self.offset, self.lines = path, 0, 0

    def line_before(self, end: int) -> int:
        """The number of the line that ends just before byte ``end``."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            self.lines += f.read(end - self.offset).count(b"\n")
        self.offset = end
        return self.lines


def _has_run(service: Service, run_id: str) -> bool:
    try:
        service.get_run(run_id)
        return True
    except NotFound:
        return False
