"""``auditor audit``: spools audited with no service (:func:`audit_offline`), each batch
decoded as the service decodes a request body and stored with the service's own ingest on a
local database, the steps still incomplete at the end swept as after the grace period."""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Iterable, Sequence

from auditor.contract.parse import parse_report_batch
from auditor.db.engine import ensure_schema, make_engine
from auditor.offline.skipped import SkippedLines, invalid_reason, unread_message
from auditor.offline.spools import MAX_REPORT_LINE_BYTES, Progress, vet_spools
from auditor.offline_reader import BODY_HEAD, BODY_TAIL, Batch, local_batches, piped_batches
from auditor.service import ConflictError, LimitError, NotFound, Service

_run_id = operator.attrgetter("run_id")

#: Spools at least this large are read by a second process in :func:`audit_offline` (a
#: smaller one is read before that process would have started).
READER_PROCESS_BYTES = 32 << 20

#: Collector thresholds while :func:`audit_offline` runs: those of ``auditor serve``
#: (:data:`auditor.server.app.GC_THRESHOLDS`, where the reason is told): a batch allocates
#: ~10 objects per report that live until it is stored, and the default thresholds make
#: full collections walk them again and again (17 % of the audit's CPU here).
GC_THRESHOLDS = (50_000, 20, 100)


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
    files = vet_spools(paths, follow_symlinks=follow_symlinks)  # SpoolError: not a spool, a link, not UTF-8
    total = sum(p.stat().st_size for p in files)
    with _local_service(database_url) as service, _few_collections():
        audit = _Audit(service, files, run_id)
        if on_progress:
            on_progress(0, total, 0)
        if reader_process is None:
            reader_process = (os.cpu_count() or 1) > 1 and total >= READER_PROCESS_BYTES
        with (piped_batches(files, batch_size) if reader_process else local_batches(files, batch_size)) as batches:
            for batch in batches:
                audit.store(batch)
                if on_progress:
                    on_progress(batch.done, total, audit.counts["reports"])
        return audit.finish(bad_steps)


@contextlib.contextmanager
def _local_service(database_url: str | None) -> Iterator[Service]:
    """A :class:`Service` on ``database_url`` (its schema made or checked), or on a temporary
    SQLite file deleted on exit; its engine disposed on exit."""
    tmp = None
    if database_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="auditor-audit-")
        database_url = f"sqlite:///{Path(tmp.name) / 'audit.db'}"
    engine = make_engine(database_url)
    try:
        ensure_schema(engine, database_url)
        yield Service.from_engine(engine)
    finally:
        engine.dispose()
        if tmp is not None:
            tmp.cleanup()


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


class _Audit:
    """One :func:`audit_offline` under way: its counters, the runs seen (in order of
    appearance), and the lines skipped as invalid or conflicting."""

    def __init__(self, service: Service, files: list[Path], run_id: str | None):
        self.service, self.run_id = service, run_id
        self.counts = dict.fromkeys(("files", "reports", "stored", "duplicates", "invalid", "conflicting"), 0)
        self.counts["files"] = len(files)
        self.run_ids: dict[str, None] = {}  # in order of appearance
        self.invalid = SkippedLines(files, "invalid")
        self.conflicting = SkippedLines(files, "conflicting")

    def store(self, batch: Batch) -> None:
        """Decode one batch (its invalid and unread lines named), keep the reports of
        ``run_id`` if given, and ingest them."""
        self.counts["reports"] += len(batch) + len(batch.unread)
        for i, start, n, why in batch.unread:
            self.invalid.add(i, start + n, unread_message(n, why), torn=why == "torn")
        reports, lines = _decode(batch, self.invalid)
        if self.run_id is not None:
            keep = [k for k, r in enumerate(reports) if r.run_id == self.run_id]
            reports, lines = [reports[k] for k in keep], [lines[k] for k in keep]
        self.run_ids.update(dict.fromkeys(map(_run_id, reports)))
        if reports:
            self.ingest(reports, lines, batch.where)

    def ingest(self, reports: Sequence, lines: Sequence[int], where) -> None:
        """Store ``reports`` (line ``lines[k]`` of the batch is ``reports[k]``); the service
        stores nothing of a batch it refuses: bisect down to the refused reports."""
        try:
            # count refusals once: on the single report the bisection ends at
            out = self.service.ingest(reports, record_refused=len(reports) == 1)
            self.counts["stored"] += out.accepted
            self.counts["duplicates"] += out.duplicates
        except (ConflictError, LimitError) as e:
            if len(reports) == 1:
                self.conflicting.add(where[2 * lines[0]], where[2 * lines[0] + 1], f"conflicting report skipped: {e}")
                return
            half = len(reports) // 2
            self.ingest(reports[:half], lines[:half], where)
            self.ingest(reports[half:], lines[half:], where)

    def finish(self, bad_steps: int) -> tuple[list[dict], dict]:
        """Sum up the skipped lines, sweep the steps still incomplete with no grace period,
        and report each run seen (``bad_steps`` per statistic); ``(reports, counts)``."""
        self.counts["invalid"] = self.invalid.total
        self.counts["conflicting"] = self.conflicting.total
        self.invalid.summarise()
        self.conflicting.summarise()
        now = time.time() + 1.0
        while self.service.sweep(grace_seconds=0.0, now=now):
            pass
        reports = [self.service.report(rid, bad_steps_limit=bad_steps).to_json() for rid in self.run_ids
                   if _has_run(self.service, rid)]
        return reports, self.counts


def _decode(batch: Batch, invalid: SkippedLines) -> tuple[list, Sequence[int]]:
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
            invalid.add(where[2 * k], where[2 * k + 1], unread_message(len(line) + 1, "over_report_limit"))
            continue
        one, errors, n = parse_report_batch(BODY_HEAD + line + BODY_TAIL, 1000)
        if one is not None and n == 1:
            good.extend(one)
            lines.append(k)
        else:
            invalid.add(where[2 * k], where[2 * k + 1], "invalid report skipped: " + invalid_reason(
                errors if n == 1 else [{"loc": (), "msg": f"{n} JSON values on one line", "type": "value_error"}]))
    return good, lines


def _has_run(service: Service, run_id: str) -> bool:
    """Whether the database holds run ``run_id`` (none when no report of it was stored)."""
    try:
        service.get_run(run_id)
        return True
    except NotFound:
        return False
