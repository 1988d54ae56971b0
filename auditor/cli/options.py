"""What the commands share: their options (``--url``, ``--database-url``, ``--token``,
``--timeout``, the ``--allow-*`` flags), formats, settings and console."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import typer

from auditor import status as _status
from auditor.cli.errors import UsageError, quiet_broken_pipe
from auditor.defaults import DEFAULT_DATABASE_URL

if TYPE_CHECKING:  # imported where used: `auditor --help` needs neither pydantic nor a console
    from rich.console import Console

    from auditor.config import Settings

DatabaseUrl = typer.Option(
    None, "--database-url", envvar="AUDITOR_DATABASE_URL",
    help=f"SQLAlchemy URL [default: {DEFAULT_DATABASE_URL}]",
)
ServiceUrl = typer.Option(
    None, "--url", envvar="AUDITOR_URL",
    help="Base URL of a running auditor service; without it the database is read directly.",
)
Timeout = typer.Option(
    10.0, "--timeout", min=0.01, max=86400.0,
    help="Seconds for the service's first whole answer (connecting included: a host that accepts connections "
         "and never answers, or trickles its answer, fails after this); once it answered, each request may take "
         "max(--timeout, 60) s in all, and the command 600 s waiting on the service.")


def header_token(value: str | None) -> str | None:
    """``--token`` is sent as ``Authorization: Bearer <token>``: printable ASCII only (httpx
    raised UnicodeEncodeError for any other character: a traceback, "unexpected" exit 2)."""
    if not value:
        return value
    from auditor.reader import header_safe

    if not header_safe(value):
        raise typer.BadParameter("must be printable ASCII (it is sent in the Authorization header)")
    return value


ReadToken = typer.Option(
    None, "--token", envvar=["AUDITOR_READ_TOKEN", "AUDITOR_TOKEN"], callback=header_token,
    help="Bearer token for a service that requires one (env AUDITOR_READ_TOKEN, else AUDITOR_TOKEN).",
)

AllowIncomplete = typer.Option(
    False, "--allow-incomplete",
    help="Pass a run whose steps were audited with reports missing (a job known to lose ranks); an inconsistent "
         "step still fails.")
AllowUnverified = typer.Option(
    False, "--allow-unverified",
    help="Pass a run audited without a known layout (no topology: each rank checked only against the group it "
         "reduced over, so a reduction over the wrong group cannot be told apart); a fault still fails.")
AllowPending = typer.Option(
    False, "--allow-pending",
    help="Pass although some steps hold reports but no verdict yet (a check of a live run); without it they "
         "fail the check: the reports that did arrive may be wrong.")
AllowRefused = typer.Option(
    False, "--allow-refused",
    help="Pass a run although reports contradicting its stored ones were refused (409: the run id was reused, or "
         "a rank re-sent different values).")
AllowDropped = typer.Option(
    False, "--allow-dropped",
    help="Pass a run although the trainer's client dropped reports before sending them (its ring or queue was "
         "full: client stats['reports_dropped']); those steps' audits have gaps.")


class Format(str, Enum):
    table = "table"
    json = "json"


#: A run's status (:data:`auditor.status.STATUSES`, worst first), as ``--status`` takes it.
RunStatus = Enum("RunStatus", {s: s for s in _status.STATUSES}, type=str)


class ReportFormat(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def db_url(url: str | None) -> str:
    """``--database-url``, else the default (``./auditor.db``)."""
    return url or DEFAULT_DATABASE_URL


def load_settings(**values) -> Settings:
    """``Settings`` from the ``AUDITOR_*`` environment (and ``values``); a variable out of its
    range is a :class:`UsageError` naming each such variable, its value and the rule (it was
    pydantic's ValidationError: a traceback and "unexpected ValidationError")."""
    import pydantic

    from auditor.config import Settings

    try:
        return Settings(**values)
    except pydantic.ValidationError as e:
        raise UsageError("; ".join(
            f"AUDITOR_{'_'.join(map(str, err['loc'])).upper()}={err['input']!r}: {err['msg']}"
            for err in e.errors(include_url=False))) from None


def make_console() -> Console:
    """A console for tables; when output is piped (CI logs, grep), wide enough to cut nothing."""
    from rich.console import Console

    console = Console()
    console = console if console.is_terminal else Console(width=1000)  # a table takes its natural width
    console.on_broken_pipe = quiet_broken_pipe  # rich's own exits 1, which `check` reserves
    return console


#: How ``auditor runs`` and the report header print each status (auditor.status).
STATUS_STYLE = {"inconsistent": "[red bold]INCONSISTENT[/]", "unverified": "[magenta bold]UNVERIFIED[/]",
                "incomplete": "[yellow bold]INCOMPLETE[/]",
                "consistent": "[green]consistent[/]", "pending": "no step audited yet"}
