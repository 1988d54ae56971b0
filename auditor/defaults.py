"""The defaults the command line shows before it parses anything: standard library only, so
``auditor --help`` and ``auditor check --url …`` start without importing pydantic
(:mod:`auditor.config`, which uses them as its fields' defaults)."""

#: The database a command or the service uses without ``--database-url`` /
#: ``AUDITOR_DATABASE_URL``: ``auditor.db`` in the current directory (SQLite).
DEFAULT_DATABASE_URL = "sqlite:///./auditor.db"
#: Seconds a step may stay incomplete before it is audited with ``missing_report``
#: (``AUDITOR_GRACE_SECONDS``).
DEFAULT_GRACE_SECONDS = 60.0
