"""On-disk spool of wire reports: one JSONL file per rank, plus an offset sidecar.

A spool is an append-only file of wire-contract reports (DESIGN.md §3), one JSON object per
line, exactly the bytes the client would have POSTed (``NaN``/``Infinity`` tokens allowed).
Next to it, ``<spool>.offset`` holds the byte offset up to which the lines were delivered to
a service (written atomically by rename). Replaying from the offset — by the client when the
service comes back, or by ``auditor import`` — is safe to repeat: the service treats an
identical re-send of a report as a no-op, so a crash between a POST and the sidecar update
only causes duplicates the service ignores.

Durability: appends are single ``write(2)`` calls of whole lines; :meth:`Spool.sync` fsyncs
(the client calls it on a timer, default every second, and on close). A crash can leave a
partial last line; readers stop at the last newline, and a torn line is skipped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger("auditor.spool")

SUFFIX = ".jsonl"
OFFSET_SUFFIX = ".offset"


def default_spool_name(rank: int | str | None = None) -> str:
    """``rank<RANK>-<host>-<pid>-<ms>.jsonl``: one file per rank and process, so concurrent
    ranks (and restarts) never write into one file. ``rank`` defaults to ``$RANK`` (torchrun)."""
    rank = rank if rank is not None else os.environ.get("RANK", "x")
    return f"rank{rank}-{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}{SUFFIX}"


def offset_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + OFFSET_SUFFIX)


def read_offset(path: str | os.PathLike) -> int:
    """Delivered byte offset of spool ``path`` (0 without a sidecar or if it is unreadable)."""
    try:
        return max(0, int(offset_path(path).read_text().strip() or 0))
    except (OSError, ValueError):
        return 0


def write_offset(path: str | os.PathLike, offset: int) -> None:
    """Record that ``path`` is delivered up to byte ``offset`` (atomic: temp file + rename)."""
    side = offset_path(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{offset}\n")
    os.replace(tmp, side)


def spool_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand ``paths``: files as given, directories into their ``*.jsonl`` files (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.glob(f"*{SUFFIX}")))
        else:
            out.append(p)
    return out


def read_lines(path: str | os.PathLike, start: int = 0, max_lines: int | None = None) -> tuple[list[bytes], int]:
    """Complete lines of ``path`` from byte ``start``: ``(lines without newline, end offset)``.

    Stops after ``max_lines`` lines; never returns a trailing line without its newline (it
    may still be being written, or was torn by a crash). Blank lines are consumed, not returned.
    """
    lines: list[bytes] = []
    for _report, line, end in _iter_lines(path, start, parse=False):
        lines.append(line)
        start = end
        if max_lines is not None and len(lines) >= max_lines:
            break
    else:
        start = _end_of_blank_tail(path, start)
    return lines, start


def _end_of_blank_tail(path, start: int) -> int:
    # consume trailing blank lines too, so that a spool ending in blank lines counts as delivered
    with open(path, "rb") as f:
        f.seek(start)
        for line in f:
            if line.strip() or not line.endswith(b"\n"):
                break
            start += len(line)
    return start


def _iter_lines(path, start: int, parse: bool) -> Iterator[tuple[dict | None, bytes, int]]:
    pos = start
    with open(path, "rb") as f:
        f.seek(start)
        for line in f:
            if not line.endswith(b"\n"):
                return  # torn or still being written
            pos += len(line)
            body = line.strip()
            if not body:
                continue
            report = None
            if parse:
                try:
                    report = json.loads(body)
                except ValueError:
                    report = None
            yield report, body, pos


def iter_reports(path: str | os.PathLike, start: int = 0) -> Iterator[tuple[dict | None, bytes, int]]:
    """Every complete line of ``path`` from byte ``start``: ``(report, or None if the line is not
    valid JSON; the raw line; the offset just past it)``."""
    return _iter_lines(path, start, parse=True)


class Spool:
    """Writer and replayer of one spool file (used by :class:`auditor.client.AuditorClient`).

    Thread-safe: :meth:`append` (spill thread), :meth:`read` / :meth:`commit` (sender thread)
    and :meth:`sync` may run concurrently; the internal lock is held for one ``write``/
    ``ftruncate`` at most, never across network I/O.

    Parameters
    ----------
    path:
        The JSONL file; created (with its directory) on the first append.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._offset = min(read_offset(self.path), self._size)
        self._dirty = False
        self.lines_written = 0

    # ------------------------------------------------------------------ writer side
    def append(self, lines: list[bytes]) -> None:
        """Append ``lines`` (each one JSON report, no newline) in one ``write``. Raises OSError."""
        if not lines:
            return
        data = b"\n".join(lines) + b"\n"
        with self._lock:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self._size += len(data)
            self._dirty = True
            self.lines_written += len(lines)

    def sync(self) -> None:
        """fsync the file if anything was appended since the last sync."""
        with self._lock:
            if self._fd is not None and self._dirty:
                os.fsync(self._fd)
                self._dirty = False

    # ---------------------------------------------------------------- replay side
    def pending(self) -> bool:
        """Whether lines beyond the delivered offset exist."""
        return self._offset < self._size

    def read(self, max_lines: int) -> tuple[list[bytes], int]:
        """Up to ``max_lines`` undelivered lines and the offset just past them."""
        return read_lines(self.path, self._offset, max_lines=max_lines)

    def commit(self, end: int) -> None:
        """Mark everything before byte ``end`` delivered. When that is the whole file, the file
        is truncated to empty (the spool never grows beyond what is undelivered)."""
        with self._lock:
            if end >= self._size and self._fd is not None:
                os.ftruncate(self._fd, 0)
                self._size = 0
                end = 0
            self._offset = end
        write_offset(self.path, end)

    def close(self, remove_if_delivered: bool = True) -> bool:
        """Sync and close. Returns True if nothing undelivered remains (files then removed)."""
        self.sync()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            delivered = self._offset >= self._size
        if delivered and remove_if_delivered:
            for p in (self.path, offset_path(self.path)):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
        return delivered


# --------------------------------------------------------------------------- import / audit
def upload(paths: Iterable[str | os.PathLike], url: str, *, token: str | None = None, batch_size: int = 1000,
           timeout: float = 30.0, max_attempts: int = 8, restart: bool = False, on_progress=None) -> dict[str, int]:
    """Upload spool files to the service at ``url`` (``auditor import``). Resumable and idempotent.

    Each file is sent from its offset sidecar (``restart`` ignores it) in batches of
    ``batch_size``; the sidecar is advanced after every batch the service answered, so an
    interrupted import continues where it stopped, and a batch sent twice is a no-op for the
    service. Reports the service refuses (409/422) are counted ``rejected`` and skipped.

    ``on_progress(path, done_bytes, total_bytes)`` is called after every batch. Returns
    counters ``files``, ``sent``, ``rejected``, ``retries``. Raises ``ConnectionError`` after
    ``max_attempts`` consecutive transient failures (the sidecar then marks where to resume).
    """
    import httpx

    from auditor.client import _backoff, post_lines

    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    counts = dict.fromkeys(("files", "sent", "rejected", "retries"), 0)
    url = url.rstrip("/")
    with httpx.Client(timeout=timeout, headers=headers) as http:
        for path in spool_files(paths):
            counts["files"] += 1
            size = path.stat().st_size
            offset = 0 if restart else min(read_offset(path), size)
            if on_progress:
                on_progress(path, offset, size)
            while True:
                lines, end = read_lines(path, offset, max_lines=batch_size)
                if not lines:
                    if end > offset:
                        write_offset(path, end)
                    break
                pending, failures = [lines], 0
                while pending:
                    chunk = pending.pop()
                    out = post_lines(http, url, chunk)
                    if out.kind == "retry":
                        failures += 1
                        counts["retries"] += 1
                        if failures >= max_attempts:
                            raise ConnectionError(f"{url}: {out.message} ({failures} attempts); "
                                                  f"{path} is delivered up to byte {offset}, re-run to resume")
                        pending.append(chunk)
                        time.sleep(max(out.delay, _backoff(failures)))
                        continue
                    failures = 0
                    if out.kind == "sent":
                        counts["sent"] += len(chunk)
                    elif out.kind == "split":
                        half = len(chunk) // 2
                        pending += [chunk[half:], chunk[:half]]
                    elif out.kind == "partial":
                        log.warning("%s: %d reports rejected: %s", path, len(out.rejected), out.message)
                        counts["rejected"] += len(out.rejected)
                        rest = [ln for i, ln in enumerate(chunk) if i not in out.rejected]
                        if rest:
                            pending.append(rest)
                    else:
                        log.warning("%s: %d reports rejected: %s", path, len(chunk), out.message)
                        counts["rejected"] += len(chunk)
                offset = end
                write_offset(path, offset)
                if on_progress:
                    on_progress(path, offset, size)
    return counts


def audit_offline(paths: Iterable[str | os.PathLike], database_url: str | None = None, *,
                  run_id: str | None = None, bad_steps: int = 20, batch_size: int = 1000) -> tuple[list[dict], dict]:
    """Audit spool files with no service (``auditor audit``): the service's own engine.

    The reports are validated with the wire schema and stored with
    :meth:`auditor.db.store.Store.ingest` into ``database_url`` (default: a temporary SQLite
    file, deleted afterwards), which audits every completed step exactly as the service
    does; steps still incomplete are then audited by :meth:`Store.sweep` with a grace period
    of 0 (``missing_report``), as the service would after its grace period.

    Returns ``(reports, counts)``: one consistency report per run (the JSON of
    ``GET /v1/runs/{run_id}/report``; only ``run_id`` if given), and counters ``files``,
    ``reports`` (lines read), ``stored``, ``duplicates``, ``invalid`` (not JSON or not a valid
    report), ``conflicting`` (409 on the service: differs from a stored report, topology or spec).
    """
    import tempfile

    from pydantic import ValidationError

    from auditor.db.engine import ensure_schema, make_engine
    from auditor.db.store import ConflictError, Store
    from auditor.schemas import Report

    counts = dict.fromkeys(("files", "reports", "stored", "duplicates", "invalid", "conflicting"), 0)
    tmp = None
    if database_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="auditor-audit-")
        database_url = f"sqlite:///{Path(tmp.name) / 'audit.db'}"
    engine = make_engine(database_url)
    try:
        ensure_schema(engine, database_url)
        store = Store(engine)
        run_ids: list[str] = []

        def ingest(batch: list[Report]) -> None:
            try:
                out = store.ingest(batch)
                counts["stored"] += out.accepted
                counts["duplicates"] += out.duplicates
            except ConflictError:
                if len(batch) == 1:
                    counts["conflicting"] += 1
                    return
                for r in batch:
                    ingest([r])

        for path in spool_files(paths):
            counts["files"] += 1
            batch: list[Report] = []
            for _report, line, _end in _iter_lines(path, 0, parse=False):
                counts["reports"] += 1
                try:
                    r = Report.model_validate_json(line)
                except ValidationError as exc:
                    counts["invalid"] += 1
                    log.warning("%s: invalid report skipped: %s", path, str(exc).splitlines()[0])
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
        now = time.time() + 1.0
        while store.sweep(grace_seconds=0.0, now=now):
            pass
        reports = [store.report(rid, bad_steps_limit=bad_steps) for rid in run_ids if _has_run(store, rid)]
        return reports, counts
    finally:
        engine.dispose()
        if tmp is not None:
            tmp.cleanup()


def _has_run(store, run_id: str) -> bool:
    from auditor.db.store import NotFound

    try:
        store.get_run(run_id)
        return True
    except NotFound:
        return False
