"""On-disk spool of wire reports: one JSONL file per rank, plus an offset sidecar.

A spool is an append-only file of wire-contract reports (DESIGN.md §3), one JSON object per
line, exactly the bytes the client would have POSTed (``NaN``/``Infinity`` tokens allowed).
Next to it, ``<spool>.offset`` holds, per destination service (its normalised base URL,
:func:`destination`), the byte offset up to which the lines were delivered to it — a JSON
object ``{"http://host:8000": 1234}``, written atomically by rename — so importing a spool
into a second service sends all of it there too. Replaying from the offset — by the client
when the service comes back, or by ``auditor import`` — is safe to repeat: the service
treats an identical re-send of a report as a no-op, so a crash between a POST and the
sidecar update only causes duplicates the service ignores. A sidecar of the older format
(one number, for no named destination) counts as nothing delivered anywhere: a re-import
re-sends duplicates, never skips reports.

Durability: appends are single ``write(2)`` calls of whole lines; :meth:`Spool.sync` fsyncs
(the client calls it on a timer, default every second, and on close). A crash can leave a
partial last line; readers stop at the last newline, and a torn line is skipped.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import re
import resource
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path

from auditor.trainer.settings import read_settings

log = logging.getLogger("auditor.spool")

SUFFIX = ".jsonl"
OFFSET_SUFFIX = ".offset"


def default_spool_dir() -> Path:
    """``$AUDITOR_SPOOL_DIR``, else ``~/.cache/auditor/spool``."""
    return read_settings().spool_dir


def default_spool_name(rank: int | str | None = None) -> str:
    """``rank<RANK>-<host>-<pid>-<ms>.jsonl``: one file per rank and process, so concurrent
    ranks (and restarts) never write into one file. ``rank`` defaults to ``$RANK`` (torchrun),
    else the rank in the initialised default process group (``mp.spawn`` sets no ``RANK``);
    when neither is known the name starts ``rank-unknown-``."""
    if rank is None:
        rank = read_settings().rank
    if rank is None:
        rank = _process_group_rank()
    prefix = "rank-unknown" if rank is None else f"rank{rank}"
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{int(time.time() * 1000)}{SUFFIX}"


def _process_group_rank() -> int | None:
    """The rank of an initialised ``torch.distributed`` default group, without importing
    torch (``auditor import`` runs where there is none)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a name is not worth an error
        return None


def offset_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + OFFSET_SUFFIX)


def destination(url: str) -> str:
    """The key of a service in offset sidecars: ``url`` with the scheme and host lower-cased,
    the default port and trailing slashes dropped (``HTTP://Host:80/`` → ``http://host``)."""
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None or (scheme, port) in (("http", 80), ("https", 443)) else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def read_offsets(path: str | os.PathLike) -> dict[str, int]:
    """Every destination's delivered offset of spool ``path`` (empty without a sidecar, if it
    is unreadable, not JSON - nested past the parser's limit included -, or in the older
    one-number format, which names no destination). An offset that is not a JSON integer
    (``true``, ``1.5``) is no offset."""
    try:
        data = json.loads(offset_path(path).read_text() or "{}")
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): max(0, v) for k, v in data.items() if type(v) is int}


def read_offset(path: str | os.PathLike, url: str) -> int:
    """Byte offset of spool ``path`` delivered to the service at ``url`` (0 if none)."""
    return read_offsets(path).get(destination(url), 0)


def write_offset(path: str | os.PathLike, url: str, offset: int, *, others: bool = True) -> None:
    """Record that ``path`` is delivered up to byte ``offset`` to the service at ``url``
    (atomic: temp file + rename); the other destinations' offsets are kept (``others=False``
    drops them: the file was truncated)."""
    offsets = read_offsets(path) if others else {}
    offsets[destination(url)] = offset
    side = offset_path(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(offsets) + "\n")
    os.replace(tmp, side)


#: Suffix of the dead-letter file next to a spool: reports the service refused for good
#: (409/422/413, or one report that kept making it fail), one JSON line each.
DEAD_LETTER_SUFFIX = ".deadletter"


def dead_letter_path(spool: str | os.PathLike) -> Path:
    """The dead-letter file of a spool: ``<spool>.deadletter`` (not ``*.jsonl``, so
    ``auditor import DIR`` does not pick it up again; import it explicitly after a fix)."""
    return Path(str(spool) + DEAD_LETTER_SUFFIX)


def dead_letter_files(paths: Iterable[str | os.PathLike]) -> list[tuple[Path, int]]:
    """The dead-letter files that go with ``paths`` (as given to ``auditor import``): next to
    each spool file, and every ``*.jsonl.deadletter`` of a directory (also when its spool is
    gone), with how many reports (lines) each holds. Sorted, each once."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        if p.is_dir():
            found.update(dict.fromkeys(sorted(p.glob(f"*{SUFFIX}{DEAD_LETTER_SUFFIX}"))))
        elif dead_letter_path(p).is_file():
            found[dead_letter_path(p)] = None
    out = []
    for d in found:
        with open(d, "rb") as f:
            out.append((d, sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))))
    return out


def append_lines(path: str | os.PathLike, lines: list[bytes]) -> None:
    """Append whole lines to ``path`` (created with its directory) in one write, fsync'd.
    Raises OSError."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"\n".join(lines) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


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
    for line, end in _iter_lines(path, start):
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


def _iter_lines(path, start: int) -> Iterator[tuple[bytes, int]]:
    pos = start
    with open(path, "rb") as f:
        f.seek(start)
        for line in f:
            if not line.endswith(b"\n"):
                return  # torn or still being written
            pos += len(line)
            body = line.strip()
            if body:
                yield body, pos


class Spool:
    """Writer and replayer of one spool file (used by :class:`auditor.trainer.client.AuditorClient`).

    Thread-safe: :meth:`append` (spill thread), :meth:`read` / :meth:`commit` (sender thread)
    and :meth:`sync` may run concurrently; the internal lock is held for one ``write``/
    ``ftruncate`` at most, never across network I/O.

    Parameters
    ----------
    path:
        The JSONL file; created (with its directory) on the first append.
    url:
        The service the client replays to: the key of its offset in the sidecar (None:
        file-only mode, nothing is replayed).
    """

    def __init__(self, path: str | os.PathLike, url: str | None = None):
        self.path = Path(path)
        self.url = url
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._offset = min(read_offset(self.path, url), self._size) if url else 0
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
        truncated = False
        with self._lock:
            if end >= self._size and self._fd is not None:
                os.ftruncate(self._fd, 0)
                self._size = 0
                end = 0
                truncated = True
            self._offset = end
        if self.url:
            write_offset(self.path, self.url, end, others=not truncated)

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


# ----------------------------------------------------------------------- merged reading
#: ``"run_id": "..."``, ``"statistic": "..."`` and ``"step": N`` of one encoded report, found
#: without decoding it. A JSON string cannot hold an unescaped ``"`` so a match is always a
#: key of some object of the line; the reports' other objects (coords, sizes, local, applied,
#: spec) have no keys of these names.
_KEY_FIELDS = re.compile(rb'"(run_id|statistic|step)"\s*:\s*("(?:[^"\\]|\\.)*"|\d+)')

#: Merge key of a line whose fields were not found: sorts before every report.
NO_KEY: tuple[bytes, int, bytes] = (b"", -1, b"")


def line_key(line: bytes) -> tuple[bytes, int, bytes] | None:
    """``(run_id, step, statistic)`` of an encoded report (the JSON strings still quoted), or
    None if one of them is missing or the step is not a number Python reads (more than
    ``sys.get_int_max_str_digits()`` digits: a garbage line, which the decoder then names).
    Only an ordering hint for :func:`SpoolReader`: nothing is validated, a wrong key only
    changes which batch a line travels in, and no line makes it raise."""
    try:  # the client's compact encoding: a few bytes.find, no regex
        r = line.index(b'"run_id":"') + 9
        s = line.index(b'"statistic":"') + 12
        t = line.index(b'"step":') + 7
        return (line[r:line.index(b'"', r + 1) + 1], int(line[t:line.index(b",", t)]),
                line[s:line.index(b'"', s + 1) + 1])
    except ValueError:  # other spacing, an escaped quote, "step" last, or not a report
        found = dict(reversed(_KEY_FIELDS.findall(line)))  # the first of each
        try:
            return found[b"run_id"], int(found[b"step"]), found[b"statistic"]
        except (KeyError, ValueError):  # ValueError: a step of more digits than int() reads
            return None


#: One line of a merged spool: ``(key, file index, offset just past the line, line)``.
MergedLine = tuple[tuple[bytes, int, bytes], int, int, bytes]

#: The longest spool line :class:`SpoolReader` reads, in bytes: the service's default
#: request body limit (``AUDITOR_MAX_BODY_BYTES``, 16 MiB), so a longer line could never be
#: delivered. A longer line is skipped without being held in memory.
MAX_LINE_BYTES = 16 << 20

#: A spool line :class:`SpoolReader` did not read: ``(file index, offset where the line
#: starts, its bytes, reason)``; reason ``"too_long"`` (over :data:`MAX_LINE_BYTES`, skipped)
#: or ``"torn"`` (the file ends inside it, no newline: still being written, or torn by a
#: crash; left unread).
UnreadLine = tuple[int, int, int, str]


class SpoolReader:
    """The lines of several spool files as one stream, each file read line by line from its
    own start offset, merged so that the reports of one step from all files come together.

    Trainers leave one file per rank, each in step order; a step is complete only once every
    rank's report of it was read. Reading the files one after another would hold every step
    open until the last file; :meth:`lines` instead merges them (a k-way merge, ``heapq``)
    by :func:`line_key` — ``(run_id, step, statistic)``, ties in file order — so the ranks of
    a step follow each other, and :meth:`batches` cuts the stream between steps.

    A file that is not in that order (several runs, statistics written in another order)
    still has every line read exactly once, in file order: only fewer steps are whole per
    batch. A line without the key fields (not JSON, not a report) takes the key of the line
    before it in its file and travels with it.

    Memory: one buffered line per file (the merge's heads) plus what the consumer holds;
    never a whole file, nor a whole line longer than :data:`MAX_LINE_BYTES` (skipped).
    ``ends[i]`` is the offset of file ``i`` up to which lines were read (the merge's head of
    that file included), trailing blank lines included once the file is exhausted (what an
    import then records as delivered); a torn last line (no newline) is never read. Both
    kinds of unread line are listed in :attr:`unread` (:data:`UnreadLine`), for the caller
    to name (:meth:`take_unread`).

    Parameters
    ----------
    paths:
        Spool files (see :func:`spool_files`).
    starts:
        Byte offset to start each file from (default 0 for every file).
    """

    def __init__(self, paths: list[Path], starts: list[int] | None = None):
        self.paths = list(paths)
        self.starts = list(starts) if starts is not None else [0] * len(self.paths)
        self.ends = list(self.starts)
        self.sizes = [p.stat().st_size for p in self.paths]
        self.unread: list[UnreadLine] = []

    def take_unread(self) -> list[UnreadLine]:
        """The lines found unread since the last call (see the class), in the order met."""
        out, self.unread = self.unread, []
        return out

    def _file(self, i: int) -> Iterator[MergedLine]:
        try:
            yield from self._lines_of(i)
        except OSError as e:  # a read error names no file: name it
            if e.filename is None:
                raise type(e)(e.errno, e.strerror or str(e), str(self.paths[i])) from e
            raise

    def _lines_of(self, i: int) -> Iterator[MergedLine]:
        pos = self.starts[i]
        ends = self.ends
        key = NO_KEY
        with open(self.paths[i], "rb") as f:
            f.seek(pos)
            while line := f.readline(MAX_LINE_BYTES + 1):
                if line[-1:] != b"\n":
                    n = len(line)
                    while line[-1:] != b"\n" and (line := f.readline(1 << 20)):
                        n += len(line)  # longer than MAX_LINE_BYTES: skip to its end, holding 1 MiB at most
                    self.unread.append((i, pos, n, "torn" if line[-1:] != b"\n" else "too_long"))
                    if line[-1:] != b"\n":
                        break  # torn or still being written: not read, the offset stays before it
                    pos += n
                    ends[i] = pos
                    continue
                pos += len(line)
                body = line.strip()
                if body:
                    key = line_key(body) or key
                    ends[i] = pos
                    yield key, i, pos, body
        ends[i] = pos

    def lines(self) -> Iterator[MergedLine]:
        """Every complete, non-blank line of every file, merged (see the class)."""
        group = _open_files_allowed()
        for lo in range(0, len(self.paths), group):
            files = [self._file(i) for i in range(lo, min(lo + group, len(self.paths)))]
            yield from heapq.merge(*files) if len(files) > 1 else files[0]

    def batches(self, size: int) -> Iterator[list[MergedLine]]:
        """:meth:`lines` in lists of at most ``size``, cut between steps: a full batch whose
        last step continues in the next line ends before that step instead, and the step
        opens the next batch (unless it fills the whole batch: a step larger than ``size``
        is cut). Holds one batch and one line of look-ahead."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        batch: list[MergedLine] = []
        for item in self.lines():
            if len(batch) >= size:
                last = batch[-1][0]
                cut = len(batch)
                if item[0] == last:  # the last step goes on: move it to the next batch
                    while cut > 0 and batch[cut - 1][0] == last:
                        cut -= 1
                    cut = cut or len(batch)
                yield batch[:cut]
                batch = batch[cut:]
            batch.append(item)
        if batch:
            yield batch

    def done_bytes(self) -> int:
        """Bytes of all files read so far (from offset 0: a resumed file counts as read up
        to where it resumes)."""
        return sum(self.ends)


def _open_files_allowed() -> int:
    """How many spool files may be open at once: the soft ``RLIMIT_NOFILE``, raised to the
    hard limit if needed, less room for the database, sockets and logs. Files beyond it are
    merged in groups one after another (a step split across groups completes later)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return max(1, (want if soft == resource.RLIM_INFINITY else soft) - 128)
