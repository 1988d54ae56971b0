"""Spools without a live service: ``auditor import`` (upload them) and ``auditor audit``
(audit them locally with the service's own flows).

The spool files are the trainer side's (:mod:`auditor.trainer.spool`); uploads go through the
trainer side's one delivery loop (:func:`auditor.trainer.delivery.deliver`); offline audits
through :class:`auditor.service.Service` on a local database.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import httpx
from pydantic import ValidationError

from auditor.db.engine import ensure_schema, make_engine
from auditor.schemas import Report
from auditor.service import ConflictError, LimitError, NotFound, Service
from auditor.trainer.delivery import CONFIGURATION_ERRORS, DeliveryError, Outcome, deliver
from auditor.trainer.spool import (
    append_lines, dead_letter_path, iter_lines, read_lines, read_offset, spool_files, write_offset,
)

log = logging.getLogger("auditor.spool")


class ServiceConfigError(ConnectionError):
    """The service answered as a wrong URL or token would (401/403/404/405)."""


def upload(paths: Iterable[str | os.PathLike], url: str, *, token: str | None = None, batch_size: int = 1000,
           timeout: float = 30.0, max_attempts: int = 8, restart: bool = False,
           on_progress: Callable[[Path, int, int], None] | None = None) -> dict[str, int]:
    """Upload spool files to the service at ``url`` (``auditor import``). Resumable and idempotent.

    Each file is sent from its offset sidecar (``restart`` ignores it) in batches of
    ``batch_size``; the sidecar is advanced after every batch the service answered, so an
    interrupted import continues where it stopped, and a batch sent twice is a no-op for the
    service. Reports the service refuses for good (409/422/413, or one report that keeps
    making it fail with a 500: :func:`auditor.trainer.delivery.deliver` bisects such batches)
    are counted ``rejected`` and appended to the dead-letter file next to the spool
    (``<spool>.deadletter``); the import goes on after them.

    ``on_progress(path, done_bytes, total_bytes)`` is called after every batch. Returns
    counters ``files``, ``sent`` (delivered), ``duplicates`` (of those, already stored: an
    identical re-send), ``rejected``, ``retries``. Raises ``ConnectionError`` after
    ``max_attempts`` consecutive transient failures (the sidecar then marks where to resume),
    and :class:`ServiceConfigError` at once on 401/403/404/405 (a wrong URL or token).
    """
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    counts = dict.fromkeys(("files", "sent", "duplicates", "rejected", "retries"), 0)
    url = url.rstrip("/")
    with httpx.Client(timeout=timeout, headers=headers) as http:
        for path in spool_files(paths):
            counts["files"] += 1
            size = path.stat().st_size
            offset = 0 if restart else min(read_offset(path), size)
            if on_progress:
                on_progress(path, offset, size)

            def on_retry(out: Outcome, _failures: int) -> None:
                if out.status in CONFIGURATION_ERRORS:
                    raise ServiceConfigError(f"{url}/v1/reports answered {out.message[:300]}: check --url and "
                                             "--token; nothing was imported from this batch")
                counts["retries"] += 1

            def on_final(kind: str, chunk: list[bytes], _pending: list, out: Outcome, path=path) -> None:
                if kind == "sent":
                    counts["sent"] += len(chunk)
                    counts["duplicates"] += out.duplicates
                    return
                refused = [ln for i, ln in enumerate(chunk) if i in out.rejected] if kind == "partial" else chunk
                counts["rejected"] += len(refused)
                dead = dead_letter_path(path)
                append_lines(dead, refused)
                log.warning("%s: %d reports rejected, appended to %s: %s", path, len(refused), dead,
                            out.message[:300])

            while True:
                lines, end = read_lines(path, offset, max_lines=batch_size)
                if not lines:
                    if end > offset:
                        write_offset(path, end)
                    break
                try:
                    deliver(http, url, lines, on_final=on_final, on_retry=on_retry, max_attempts=max_attempts)
                except DeliveryError as e:
                    raise ConnectionError(f"{url}: {e}; {path} is delivered up to byte {offset}, "
                                          "re-run to resume") from None
                offset = end
                write_offset(path, offset)
                if on_progress:
                    on_progress(path, offset, size)
    return counts


def audit_offline(paths: Iterable[str | os.PathLike], database_url: str | None = None, *,
                  run_id: str | None = None, bad_steps: int = 20, batch_size: int = 1000) -> tuple[list[dict], dict]:
    """Audit spool files with no service (``auditor audit``): the service's own flows.

    The reports are validated with the wire schema and stored with
    :meth:`auditor.service.Service.ingest` into ``database_url`` (default: a temporary SQLite
    file, deleted afterwards), which audits every completed step exactly as the service
    does; steps still incomplete are then audited by :meth:`Service.sweep` with a grace
    period of 0 (``missing_report``), as the service would after its grace period.

    Returns ``(reports, counts)``: one consistency report per run (the JSON of
    ``GET /v1/runs/{run_id}/report``; only ``run_id`` if given), and counters ``files``,
    ``reports`` (lines read), ``stored``, ``duplicates``, ``invalid`` (not JSON or not a valid
    report), ``conflicting`` (409 on the service: differs from a stored report, topology or spec).
    """
    counts = dict.fromkeys(("files", "reports", "stored", "duplicates", "invalid", "conflicting"), 0)
    tmp = None
    if database_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="auditor-audit-")
        database_url = f"sqlite:///{Path(tmp.name) / 'audit.db'}"
    engine = make_engine(database_url)
    try:
        ensure_schema(engine, database_url)
        service = Service.from_engine(engine)
        run_ids: list[str] = []

        def ingest(batch: list[Report]) -> None:
            try:
                out = service.ingest(batch)
                counts["stored"] += out.accepted
                counts["duplicates"] += out.duplicates
            except (ConflictError, LimitError):
                if len(batch) == 1:
                    counts["conflicting"] += 1
                    return
                for r in batch:
                    ingest([r])

        for path in spool_files(paths):
            counts["files"] += 1
            batch: list[Report] = []
            where = _LineNumbers(path)
            invalid = 0
            for line, end in iter_lines(path):
                counts["reports"] += 1
                try:
                    r = Report.model_validate_json(line)
                except ValidationError as exc:
                    counts["invalid"] += 1
                    invalid += 1
                    if invalid <= MAX_INVALID_LOGGED:
                        log.warning("%s:%d: invalid report skipped: %s", path, where.line_before(end),
                                    invalid_reason(exc))
                    continue
                if run_id is not None and r.run_id != run_id:
                    continue
                if r.run_id not in run_ids:
                    run_ids.append(r.run_id)
                batch.append(r)
                if len(batch) >= batch_size:
                    ingest(batch)
                    batch = []
            if batch:
                ingest(batch)
            if invalid > MAX_INVALID_LOGGED:
                log.warning("%s: %d more invalid line(s) skipped (%d in all)", path, invalid - MAX_INVALID_LOGGED,
                            invalid)
        now = time.time() + 1.0
        while service.sweep(grace_seconds=0.0, now=now):
            pass
        reports = [service.report(rid, bad_steps_limit=bad_steps) for rid in run_ids if _has_run(service, rid)]
        return reports, counts
    finally:
        engine.dispose()
        if tmp is not None:
            tmp.cleanup()


#: Invalid lines of one spool file named one by one (the rest are counted): a file that is
#: not a spool at all must not print one identical line per line.
MAX_INVALID_LOGGED = 5


def invalid_reason(exc: ValidationError) -> str:
    """Why a spool line is not a report, naming the wire field (``local.count``,
    ``coords.cp``) as the service's 422 does: the first error, and how many more there are."""
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return str(exc).splitlines()[0]
    e = errors[0]
    if e["type"] == "json_invalid":
        return f"not JSON ({e['msg']})"
    field = ""
    for part in e["loc"]:
        field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
    more = f" (+{len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{field or 'report'}: {e['msg']}{more}"


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
