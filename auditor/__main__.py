"""``python -m auditor`` is the ``auditor`` command."""

from auditor.cli import app

app(prog_name="auditor")
