"""A bounded gloo world: spawn ranks, collect what each returns, never hang.

Used by the demo (:mod:`auditor.demo`), the fault injection, the tests and the benchmarks.
"""

from __future__ import annotations

import queue
import time
import traceback
from typing import Any, Callable, Sequence

from auditor.server.run import free_port


def spawn_world(body: Callable[..., Any], world: int, args: tuple, timeout: float,
                preload: Sequence[str] | None = None) -> list:
    """Run ``body(rank, world, master_port, *args)`` in ``world`` spawned processes and return
    what each returned, sorted by rank. ``body`` must be a module-level function (it is
    pickled); ``master_port`` is a free TCP port for ``init_process_group``.

    ``preload``: modules (e.g. ``torch``, ``megatron.core.parallel_state``) imported once by a
    fork server that then forks every rank of this and later worlds (multiprocessing's
    ``forkserver`` start method): a rank starts in well under a second instead of paying the
    ~8 s import of torch and Megatron-core each (measured on 2 cores: 6 worlds of 1–4 ranks
    140 s spawned, 12 s forked). The list is the fork server's once it runs (the first call
    with ``preload`` starts it); its ranks see the environment of that moment, so pass what
    they need as ``args``. ``None``: a fresh ``spawn`` interpreter per rank.

    The join is bounded: a rank blocked in a collective another rank skipped fails the call
    instead of hanging it. The port is free when chosen but not held (the ranks bind it), so
    another process may take it first (parallel test workers): a world whose rendezvous store
    failed to listen (``EADDRINUSE``, before any collective ran) is started again on a new port,
    at most ``ADDRESS_IN_USE_TRIES`` times in all.

    Raises
    ------
    RuntimeError
        A rank raised (the message holds its traceback) or died (its exit code).
    TimeoutError
        Not every rank finished within ``timeout`` seconds; all ranks are killed first.
    """
    for attempt in range(1, ADDRESS_IN_USE_TRIES + 1):
        try:
            return _run_world(body, world, args, timeout, preload)
        except RuntimeError as e:
            if attempt == ADDRESS_IN_USE_TRIES or "EADDRINUSE" not in str(e):
                raise
    raise AssertionError("unreachable")


ADDRESS_IN_USE_TRIES = 3


def _run_world(body: Callable[..., Any], world: int, args: tuple, timeout: float,
               preload: Sequence[str] | None) -> list:
    import torch.multiprocessing as mp

    if preload is None:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))  # no effect once the fork server runs
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(body, r, world, port, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        return _collect(procs, out, deadline, timeout)
    finally:
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()


def _rank_main(body, rank: int, world: int, port: int, args: tuple, out) -> None:
    try:
        out.put(("ok", rank, body(rank, world, port, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        out.put(("error", rank, traceback.format_exc()))


def _collect(procs, out, deadline: float, timeout: float) -> list:
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(results))
            raise TimeoutError(
                f"ranks {missing} did not finish within {timeout:.0f}s: a rank is likely blocked in "
                "a collective that another rank skipped; all workers were killed"
            )
        try:
            status, rank, payload = out.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"worker rank {dead[0][0]} died with exit code {dead[0][1]}") from None
            continue
        if status == "error":
            raise RuntimeError(f"worker rank {rank} failed:\n{payload}")
        results[rank] = payload
    return [results[r] for r in sorted(results)]


#: ``preload`` of the Megatron-core worlds of the tests, the demo's fault injection and the
#: benchmarks: what their ranks import (torch alone ~2 s, Megatron-core ~6 s of CPU per rank).
#: A world that must run without Megatron imported (the DeviceMesh worlds assert it) is spawned.
MEGATRON_PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state",
                    "auditor.trainer.client", "auditor.trainer.hooks")
