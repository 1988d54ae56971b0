"""The spool files ``auditor import`` and ``auditor audit`` take: each vetted before anything
of it is sent or stored (:func:`vet_spools`), and the longest line either decodes or sends
(:data:`MAX_REPORT_LINE_BYTES`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from auditor.contract.parse import parse_report_batch
from auditor.offline_reader import BODY_HEAD, BODY_TAIL, SpoolError
from auditor.trainer.spool import spool_files

#: ``on_progress(done_bytes, total_bytes, reports)`` of :func:`~auditor.offline.upload` and
#: :func:`~auditor.offline.audit_offline`.
Progress = Callable[[int, int, int], None]

#: Longest spool line :func:`~auditor.offline.upload` and :func:`~auditor.offline.audit_offline`
#: decode or send, bytes: the largest valid report (``group_ranks`` of 65,536 ranks, ≈ 460 KB)
#: fits. A longer line is refused before it is parsed (counted, named, left in the spool).
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
