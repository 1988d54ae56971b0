"""Harnesses shared by the tests, the demo and the benchmarks: a bounded gloo world
(:mod:`~auditor.testing.world`), an ``auditor serve`` process (:mod:`~auditor.testing.server`),
throw-away PostgreSQL databases (:mod:`~auditor.testing.postgres`), and, for users too,
:func:`no_host_sync` / :func:`count_host_syncs` (:mod:`~auditor.testing.sync`: fail a block
of code on any host read of a tensor value on the current thread) and the layout harness
(:mod:`~auditor.testing.layouts`: run a per-rank function at several (dp, cp) layouts and
require every run consistent and the workload invariant)."""

from __future__ import annotations

__all__ = ["count_host_syncs", "no_host_sync", "HostSyncs"]


def __getattr__(name: str):
    if name in __all__:  # imported on use: the service-side harnesses do not need torch
        from auditor.testing import sync

        return getattr(sync, name)
    raise AttributeError(f"module 'auditor.testing' has no attribute {name!r}")
