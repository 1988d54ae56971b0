"""How ``auditor audit`` reads spools: batches of whole steps, in this process
(:func:`local_batches`) or in a reader process that sends them over a connection
(:func:`piped_batches`), so that reading and merging (~3 µs per line: file iteration,
:func:`~auditor.trainer.spool.line_key`, the merge, joining the request body) run on another
core while this one decodes, stores and audits.

The reader process is this interpreter running :func:`reader_main`, which imports this
module and :mod:`auditor.trainer.spool` only (no database, pydantic or HTTP: it starts in
~40 ms). The batches travel through a :func:`multiprocessing.Pipe` (a socket pair) — one
pickled :class:`Batch` per message, framed by :class:`multiprocessing.connection.Connection`,
which writes and reads each message whole (looping over partial reads and writes) and raises
``EOFError`` (between messages) or ``OSError`` (mid-message) when the writer is gone. (The
pipe used to be framed by hand; under py-spy's ptrace, Python's buffered pipe objects lost
bytes — 9,934 of 10,000 lines of a batch arrived, docs/performance.md.) The process is
started with :mod:`subprocess`, not as a ``spawn`` child of :mod:`multiprocessing`: a spawn
child first re-imports the parent's ``__main__``, which for the ``auditor`` console script
is the whole CLI (+0.45 s of CPU and ~50 MiB per audit, measured).

Memory: the batch being stored, the one the reader process prepares, and what the socket
pair buffers (a few hundred KiB on Linux); the reader blocks while it is full, so it reads
at most one batch ahead, whatever the size of the spools.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
from array import array
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from auditor.trainer.spool import SpoolReader

#: What a batch of lines becomes as the body of ``POST /v1/reports``: ``{"reports":[`` +
#: the lines joined by commas + ``]}`` (the bytes :func:`auditor.trainer.delivery.post_lines` sends).
BODY_HEAD, BODY_TAIL = b'{"reports":[', b"]}"


class SpoolError(ValueError):
    """A file given as a spool that is not one (:func:`auditor.offline.vet_spools`), or whose
    offset sidecar cannot be right; nothing was sent or stored."""


class SpoolReaderError(OSError):
    """The reader process failed (its error, e.g. a spool that cannot be read) or died (its
    exit code or signal) before the end of the spools."""


class Batch:
    """One batch of spool lines: ``body`` (the request body of its lines, see
    :data:`BODY_HEAD`), ``where`` (int64; ``where[2k]``, ``where[2k + 1]``: file index and
    end offset of line ``k``), ``lengths`` (int64; bytes of each line), ``done`` (bytes of
    the spools read so far), ``unread`` (the lines the reader skipped or could not read since
    the batch before: :data:`~auditor.trainer.spool.UnreadLine`), and :meth:`lines` (cut
    from the body on demand). A batch may hold no line, only ``unread`` ones."""

    __slots__ = ("body", "where", "lengths", "done", "unread")

    def __init__(self, body: bytes, where: array, lengths: array, done: int, unread: list | None = None):
        self.body, self.where, self.lengths, self.done = body, where, lengths, done
        self.unread = unread or []

    @classmethod
    def of(cls, batch: list, done: int, unread: list | None = None) -> Batch:
        """From a list of :data:`~auditor.trainer.spool.MergedLine` of :meth:`SpoolReader.batches`."""
        lines = [item[3] for item in batch]
        where = array("q", [v for item in batch for v in (item[1], item[2])])
        return cls(BODY_HEAD + b",".join(lines) + BODY_TAIL, where, array("q", map(len, lines)), done, unread)

    def __len__(self) -> int:
        return len(self.lengths)

    def lines(self) -> list[bytes]:
        out, pos = [], len(BODY_HEAD)
        for n in self.lengths:
            out.append(self.body[pos:pos + n])
            pos += n + 1
        return out


def _batches(reader: SpoolReader, size: int) -> Iterator[Batch]:
    for batch in reader.batches(size):
        yield Batch.of(batch, reader.done_bytes(), reader.take_unread())
    if unread := reader.take_unread():  # found after the last line (a torn last line)
        yield Batch.of([], reader.done_bytes(), unread)


@contextlib.contextmanager
def local_batches(files: list[Path], size: int) -> Iterator[Iterator[Batch]]:
    """``SpoolReader(files).batches(size)`` read in this process, as :class:`Batch`."""
    yield _batches(SpoolReader(files), size)


@contextlib.contextmanager
def piped_batches(files: list[Path], size: int) -> Iterator[Iterator[Batch]]:
    """The same batches as :func:`local_batches`, read and merged by a reader process (see
    the module). The process is killed when the consumer stops early or fails; leaving the
    context always reaps it.

    Raises :class:`SpoolReaderError` from the iterator when the reader process raised (its
    error is in the message) or died before its end of stream (its exit code or signal):
    the batches before it were handed over, nothing after.
    """
    import auditor

    here, there = multiprocessing.Pipe()  # a socket pair: the arguments go there, the batches come back
    checkout = str(Path(auditor.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-c", f"from auditor.offline_reader import reader_main; reader_main({there.fileno()})"],
            stdin=subprocess.DEVNULL, pass_fds=(there.fileno(),), env=env)
    except BaseException:
        here.close()
        raise
    finally:
        there.close()  # the child's end: once the child is gone, a read here is end of file

    def died() -> SpoolReaderError:
        try:
            code = proc.wait(5.0)
        except subprocess.TimeoutExpired:
            code = None
        return SpoolReaderError(f"the spool reader process {_how_it_ended(code)} before the end of the spools; "
                                "the reports after the last batch were not read")

    def batches() -> Iterator[Batch]:
        try:
            here.send(([str(p) for p in files], size))
        except OSError:  # BrokenPipeError, ConnectionResetError: it did not start
            raise died() from None
        while True:
            try:
                item = here.recv()
            except (EOFError, OSError):  # EOFError between messages, OSError "end of file during message"
                raise died() from None
            if item is None:
                return
            if isinstance(item, str):
                raise SpoolReaderError(f"the spool reader process failed: {item}")
            yield item

    try:
        yield batches()
    finally:
        here.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "stopped sending (still running)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def reader_main(fd: int) -> None:
    """Entry point of the reader process (``python -c "from auditor.offline_reader import
    reader_main; reader_main(FD)"``): receives ``(paths, size)`` on the connection at file
    descriptor ``fd`` and sends the :class:`Batch` es of ``SpoolReader(paths).batches(size)``,
    then ``None`` (the end); on an error, its ``"Type: message"`` instead. Blocks while the
    connection is full. Ignores SIGINT: the parent decides when it stops (it kills it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # a batch's tuples live until it is sent: few collections
    with Connection(fd) as parent:
        try:
            paths, size = parent.recv()
            for batch in _batches(SpoolReader([Path(p) for p in paths]), size):
                parent.send(batch)
            parent.send(None)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the parent stopped (it kills this process anyway)
        except Exception as e:  # noqa: BLE001 - told to the parent, which raises it
            with contextlib.suppress(OSError):
                parent.send(f"{type(e).__name__}: {e}")
