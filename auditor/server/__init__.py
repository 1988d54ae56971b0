"""The HTTP process: :mod:`~auditor.server.app` (the FastAPI app factory) over
:mod:`~auditor.server.routes` (the routers), :mod:`~auditor.server.errors` (every error's
problem details), :mod:`~auditor.server.metrics` (Prometheus) and :mod:`~auditor.server.run` (uvicorn:
``auditor serve``, a server in a background thread, health polling)."""

from auditor.server.run import BackgroundServer, free_port, serve, wait_healthy

__all__ = ["BackgroundServer", "free_port", "serve", "wait_healthy"]
