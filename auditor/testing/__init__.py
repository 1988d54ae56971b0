"""Harnesses shared by the tests, the demo and the benchmarks: a bounded gloo world
(:mod:`~auditor.testing.world`), an ``auditor serve`` process (:mod:`~auditor.testing.server`)
and throw-away PostgreSQL databases (:mod:`~auditor.testing.postgres`)."""
