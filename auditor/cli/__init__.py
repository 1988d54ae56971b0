"""The ``auditor`` command (typer): one module per command group, on the app of
:mod:`auditor.cli.root`.

============  =====================================================================
``serve``     :mod:`auditor.cli.serve`: the HTTP service
``db``        :mod:`auditor.cli.db`: schema migrations
``report``    :mod:`auditor.cli.report`: one run's report; ``check``, the CI verdict
``compare``   :mod:`auditor.cli.compare`: runs of one workload compared across layouts
``runs``      :mod:`auditor.cli.runs`: list runs, delete one
``demo``      :mod:`auditor.cli.demo`: the reference case on real gloo ranks
``import``    :mod:`auditor.cli.spools`: upload spools; ``audit``, audit them offline
============  =====================================================================

``report``, ``check`` and ``runs`` read through :func:`auditor.cli.sources.open_source`
(a service over HTTP, or the database). Errors a user can cause are one line and exit 2
(:mod:`auditor.cli.errors`).
"""

# Imported in the order `auditor --help` lists them: commands (serve, report, check, compare, demo,
# import, audit) in the order they register, then the groups (db, runs).
from auditor.cli import db, serve, report, compare, runs, demo, spools  # noqa: F401, I001  (registers the commands)
from auditor.cli.root import app, main
from auditor.cli.db import database_shown
from auditor.cli.errors import BROKEN_PIPE_EXIT, UsageError, database_url_hint, http_error_message
from auditor.cli.report import _report_html
from auditor.cli.sources import COMMAND_SECONDS, DELETE_SECONDS, READ_SECONDS, open_source

__all__ = ["app", "main", "open_source", "UsageError", "BROKEN_PIPE_EXIT", "COMMAND_SECONDS", "READ_SECONDS",
           "DELETE_SECONDS", "database_shown", "database_url_hint", "http_error_message"]
