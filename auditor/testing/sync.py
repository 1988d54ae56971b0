"""Catch host reads of tensor values on the current thread: each one is a host-device
synchronisation when the tensor is on a GPU (the training thread stops launching kernels
until the device has drained its queue).

:func:`count_host_syncs` records them for a block of code, :func:`no_host_sync` fails the
block if there was any. Both work on CPU tensors (a CPU run shows what a CUDA run would
synchronise on), only on the thread that entered the block (torch's dispatch and function
modes are thread-local: the auditor client's sender thread is not watched), and nest.

What counts as one host sync (each is one on a CUDA tensor):

* reading a value: ``aten._local_scalar_dense`` (``t.item()``, ``float(t)``, ``int(t)``,
  ``bool(t)``, ``if t:``), ``aten.is_nonzero``, ``aten.equal``;
* ``t.tolist()``, ``t.numpy()``, ``numpy.asarray(t)``;
* data-dependent output shapes: ``aten.nonzero``, ``aten.masked_select``, boolean-mask
  indexing (``t[mask]``, ``aten.index`` with a bool/uint8 index), ``aten.unique*``,
  ``aten.repeat_interleave`` of a tensor of repeats without ``output_size``;
* a blocking copy from another device to the CPU (``t.cpu()``, ``t.to("cpu")`` without
  ``non_blocking=True``).

Example: a framework maintainer asserting the auditor adds nothing to a step::

    from auditor.testing import count_host_syncs
    with count_host_syncs() as bare:
        step(model, batch)
    with count_host_syncs() as audited:
        step(model, batch, client=client)
    assert audited.count == bare.count, audited.report()
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Dispatcher ops that read a tensor value on the host.
_VALUE_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
#: Dispatcher ops whose output shape depends on the data (the host must learn it).
_DATA_SHAPES = {aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
                aten.unique_dim.default, aten.unique_consecutive.default, aten.unique_dim_consecutive.default}
#: Tensor methods that copy values to the host without going through the dispatcher on CPU.
_HOST_COPIES = {"tolist", "numpy", "__array__"}


@dataclass
class HostSyncs:
    """What :func:`count_host_syncs` saw: one entry per host sync, in order.

    ``ops``: the op names (``aten._local_scalar_dense.default``, ``Tensor.tolist``, ...);
    ``where``: for each, the innermost frame outside torch and this module, as
    ``file:line in function``.
    """

    ops: list[str] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Number of host syncs seen."""
        return len(self.ops)

    def report(self) -> str:
        """The syncs as text, one per line (empty when there were none)."""
        return "\n".join(f"{op} at {at}" for op, at in zip(self.ops, self.where))

    def _add(self, op: str) -> None:
        self.ops.append(op)
        self.where.append(_caller())


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if "/torch/" in name or name.endswith("auditor/testing/sync.py"):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "?"


def _is_sync(func, args, kwargs) -> bool:
    if func in _VALUE_READS or func in _DATA_SHAPES:
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        return (dev is not None and torch.device(dev).type == "cpu" and src.device.type != "cpu"
                and not kwargs.get("non_blocking", False))
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return dst.device.type == "cpu" and src.device.type != "cpu" and not non_blocking
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, log: HostSyncs, quiet: list[int]) -> None:
        super().__init__()
        self.log, self.quiet = log, quiet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.quiet[0] and _is_sync(func, args, kwargs):
            self.log._add(str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, log: HostSyncs, quiet: list[int]) -> None:
        super().__init__()
        self.log, self.quiet = log, quiet

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in _HOST_COPIES or not (args and isinstance(args[0], torch.Tensor)):
            return func(*args, **kwargs)
        if not self.quiet[0]:
            self.log._add(f"Tensor.{name}")
        self.quiet[0] += 1  # the copy it makes on CUDA is the same sync
        try:
            return func(*args, **kwargs)
        finally:
            self.quiet[0] -= 1


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Record every host read of a tensor value on this thread inside the block.

    Yields a :class:`HostSyncs` (``.count``, ``.ops``, ``.where``, ``.report()``), filled
    as the block runs. Other threads are not watched. Slows the block down (every torch op
    passes through Python): for tests, not for training.
    """
    log, quiet = HostSyncs(), [0]
    with _Function(log, quiet), _Dispatch(log, quiet):
        yield log


@contextlib.contextmanager
def no_host_sync(allowed: int = 0) -> Iterator[HostSyncs]:
    """Fail the block when it made more than ``allowed`` host syncs on this thread.

    Raises ``AssertionError`` when the block ends, listing each sync and where it was made
    (at the end, not at the op: code that catches every exception, like the auditor's
    hooks, cannot hide it). ``allowed``: syncs the code under test makes by itself (a
    whitening function's own ``.item()``), so that only added ones fail.
    """
    with count_host_syncs() as log:
        yield log
    if log.count > allowed:
        raise AssertionError(f"{log.count} host syncs on this thread (allowed {allowed}):\n{log.report()}")
