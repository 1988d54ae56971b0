"""Reports whose numbers are still on the device: handed from the training thread to the
client's background threads without reading a tensor value (issue 24).

A hook puts what a report needs (local moments, min/max, what the all-reduce returned,
what was applied) into one small float64 tensor on the values' device — masked reductions
only, no boolean indexing or ``nonzero`` — and calls
:meth:`auditor.trainer.client.AuditorClient.report_deferred` with it and a ``finish``
function. The client copies the tensor into a free slot of its :class:`Ring` (a fixed
number of rows of a host buffer, pinned on CUDA, with a non-blocking copy and a CUDA
event; on CPU the same path without pinning or events) and queues a :class:`Deferred`. The
sender (or spill) thread waits on the event, reads the row and calls ``finish(values)``,
which builds the wire dict there. Nothing on the training thread waits for the device. A
full ring drops the report (counted by the client), it never blocks.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import torch

#: float64 values one report may carry (a slot's width).
WIDTH = 16
#: Slots of a client's ring unless told otherwise (16 float64 each: 512 KiB).
RING_SIZE = 4096


class Ring:
    """``size`` slots of :data:`WIDTH` float64 values, taken by :meth:`put` on the training
    thread and given back by :meth:`take` on a background thread. The host buffers are made
    on first use: a plain one for CPU payloads, a pinned one (and one CUDA event per slot)
    for CUDA payloads. ``size`` < 1 raises ValueError."""

    def __init__(self, size: int = RING_SIZE) -> None:
        if size < 1:
            raise ValueError(f"ring size must be >= 1, got {size}")
        self.size = size
        self._free = collections.deque(range(size))  # append/popleft are atomic: no lock on the hot path
        self._host: dict[bool, torch.Tensor] = {}
        self._events: list = [None] * size
        self._make_lock = threading.Lock()
        #: held while a background thread reads a slot: a report is resolved once even
        #: when the sender and ``close`` both hold it (a batch in flight at exit)
        self.resolve_lock = threading.Lock()

    @property
    def in_use(self) -> int:
        """Slots holding a report not yet read."""
        return self.size - len(self._free)

    def put(self, payload: torch.Tensor) -> tuple[int, int, bool] | None:
        """Start copying ``payload`` (1-D float64, at most :data:`WIDTH` values, any device)
        into a free slot; returns the handle for :meth:`take`, or None when every slot is
        taken (the caller drops the report). More than :data:`WIDTH` values: ValueError. Never waits for the device: a CUDA payload is
        copied with ``non_blocking=True`` into pinned memory and an event is recorded on the
        current stream after it."""
        n = payload.numel()
        if n > WIDTH:
            raise ValueError(f"a deferred report carries at most {WIDTH} values, got {n}")
        try:
            slot = self._free.popleft()
        except IndexError:
            return None
        cuda = payload.device.type == "cuda"
        try:
            row = self._buffer(cuda)[slot, :n]
            if cuda:
                row.copy_(payload, non_blocking=True)
                event = self._events[slot]
                if event is None:
                    event = self._events[slot] = torch.cuda.Event()
                event.record(torch.cuda.current_stream(payload.device))
            else:
                row.copy_(payload)
        except BaseException:
            self._free.append(slot)
            raise
        return slot, n, cuda

    def take(self, handle: tuple[int, int, bool]) -> list[float]:
        """The values :meth:`put` copied (waiting, on this thread, for the copy to land); the
        slot is free again afterwards."""
        slot, n, cuda = handle
        try:
            if cuda:
                event, pause = self._events[slot], 5e-5
                while not event.query():  # polled, not cudaEventSynchronize: nothing a sync check flags
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
            return self._host[cuda][slot, :n].tolist()
        finally:
            self._free.append(slot)

    def release(self, handle: tuple[int, int, bool]) -> None:
        """Free the slot of a report that will not be read (not queued after all), without
        waiting for its copy."""
        self._free.append(handle[0])

    def _buffer(self, pinned: bool) -> torch.Tensor:
        buf = self._host.get(pinned)
        if buf is None:
            with self._make_lock:
                buf = self._host.get(pinned)
                if buf is None:
                    buf = torch.empty((self.size, WIDTH), dtype=torch.float64, pin_memory=pinned)
                    self._host[pinned] = buf
        return buf


class Deferred:
    """A queued report whose numbers sit in a :class:`Ring` slot: :meth:`resolve` (on a
    background thread) gives the wire dict ``finish(values)`` builds, or None. ``about``:
    what is known of the report on the training thread (a dict with its ``run_id``,
    ``statistic`` and ``step``), for counting it if it is dropped."""

    __slots__ = ("ring", "handle", "finish", "report", "about")

    def __init__(self, ring: Ring, handle: tuple[int, int, bool], finish: Callable[[list[float]], dict | None],
                 about: dict | None = None):
        self.ring, self.handle, self.finish, self.about = ring, handle, finish, about
        self.report: dict | None = None

    def resolve(self) -> tuple[dict | None, bool]:
        """(the report, whether this call built it): the slot is read and ``finish`` called
        on the first call only (later calls return the same report). Raises what ``finish``
        raises (the slot is free again either way)."""
        with self.ring.resolve_lock:
            if self.handle is None:
                return self.report, False
            handle, self.handle = self.handle, None
            self.report = self.finish(self.ring.take(handle))
            return self.report, True


def scalars(*values) -> torch.Tensor:
    """The 1-D float64 tensor of ``values`` (0-d or one-element tensors, on one device, or
    Python numbers), in order, on the first tensor's device (CPU if none), without reading
    any tensor on the host. Raises ValueError for a tensor of more than one element."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    parts = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"expected a one-element tensor, got shape {tuple(v.shape)}")
            parts.append(v.detach().reshape(1).to(device=device, dtype=torch.float64))
        else:
            parts.append(torch.full((1,), float(v), dtype=torch.float64, device=device))
    return torch.cat(parts)
