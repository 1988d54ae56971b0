"""The ``auditor`` typer app, its ``--version`` and the console script; the command groups
register on it from their modules (:mod:`auditor.cli` imports them in help order)."""

from __future__ import annotations

import typer

from auditor.cli.errors import quiet_broken_pipe

app = typer.Typer(help="Audit the statistics distributed trainers all-reduce across ranks.",
                  no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode="markdown")


def _version(value: bool) -> None:
    if value:
        from auditor import __version__

        typer.echo(f"auditor {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Audit the statistics distributed trainers all-reduce across ranks."""


def main() -> None:
    """The ``auditor`` console script: the typer app, and a closed stdout (``auditor runs |
    head``, ``--help | head``) ends it quietly (:data:`auditor.cli.errors.BROKEN_PIPE_EXIT`)."""
    try:
        app(prog_name="auditor")
    except BrokenPipeError:
        quiet_broken_pipe()
