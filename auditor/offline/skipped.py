"""How ``auditor import`` and ``auditor audit`` name the spool lines they skip: ``FILE:LINE:
why`` for the first :data:`MAX_INVALID_LOGGED` of each file, then how many more."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path

from auditor.offline.spools import MAX_REPORT_LINE_BYTES
from auditor.trainer.spool import MAX_LINE_BYTES

log = logging.getLogger("auditor.spool")

#: Invalid lines of one spool file named one by one (the rest are counted): a file that is
#: not a spool at all must not print one identical line per line.
MAX_INVALID_LOGGED = 5


def unread_message(n: int, why: str) -> str:
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


class SkippedLines:
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
        """Log, for each file with more skipped lines than were named, how many more."""
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
