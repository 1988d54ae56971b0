"""The HTTP process: :mod:`~auditor.server.app` (FastAPI routes and error shapes),
:mod:`~auditor.server.metrics` (Prometheus) and :mod:`~auditor.server.run` (uvicorn:
``auditor serve``, a server in a background thread, health polling)."""

from auditor.server.run import BackgroundServer, free_port, serve, wait_healthy

__all__ = ["BackgroundServer", "free_port", "serve", "wait_healthy"]
