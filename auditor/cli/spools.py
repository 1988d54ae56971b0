"""``auditor import`` and ``auditor audit``: trainer spools uploaded to a service, or audited
offline with no service."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Optional

import typer

from auditor.cli.root import app
from auditor.cli.errors import UsageError, errors_as_exit_2
from auditor.cli.options import (AllowDropped, AllowIncomplete, AllowRefused, AllowUnverified, Format, Timeout,
                                 header_token, make_console)
from auditor.cli.sources import service_url

SpoolPaths = typer.Argument(..., help="Spool files (*.jsonl) or directories holding them.", show_default=False)
Quiet = typer.Option(False, "--quiet", "-q", help="No progress bar (there is none when stderr is not a terminal).")


FollowSymlinks = typer.Option(
    False, "--follow-symlinks",
    help="Read spool files that are symbolic links (refused by default: a link may point anywhere, e.g. /etc/passwd).")


def _spool_files(spools: list[str], follow_symlinks: bool = False, dead: list | None = None):
    """The spool files of SPOOL... vetted (:func:`auditor.offline.vet_spools`): exit 2 naming
    a missing file, a link, a file that is not a spool or not UTF-8 — and, for none at all,
    the dead-letter files found there (``dead``) with --include-deadletter."""
    from auditor.offline import vet_spools

    files = vet_spools(spools, follow_symlinks=follow_symlinks)
    if not files:
        held = (f"; it holds only dead-letter files ({', '.join(f'{p} ({n})' for p, n in dead)}): retry them with "
                "--include-deadletter" if dead else "")
        raise UsageError(f"no spool files (*.jsonl) in {' '.join(spools)}{held}")
    return files


@contextlib.contextmanager
def _spool_progress(what: str, quiet: bool):
    """A progress bar on stderr over the bytes of the spools (with reports and reports/s),
    yielding the ``on_progress(done_bytes, total_bytes, reports)`` callback of
    :mod:`auditor.offline`. Off with ``--quiet`` and when stderr is not a terminal (CI logs,
    pipes: the callback is then a no-op)."""
    from rich.console import Console

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn(f"[bold]{what}"), BarColumn(), DownloadColumn(),
                  TextColumn("{task.fields[reports]:,} reports ({task.fields[rate]:,.0f}/s)"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as progress:
        task = progress.add_task(what, total=None, reports=0, rate=0.0)
        t0 = time.perf_counter()

        def on_progress(done: int, total: int, reports: int) -> None:
            rate = reports / max(time.perf_counter() - t0, 1e-9)
            progress.update(task, completed=done, total=total, reports=reports, rate=rate)

        yield on_progress


@app.command("import")
@errors_as_exit_2
def import_spools(
    spools: list[str] = SpoolPaths,
    url: str = typer.Option(..., "--url", envvar="AUDITOR_URL", help="Base URL of the auditor service."),
    token: Optional[str] = typer.Option(None, "--token", envvar="AUDITOR_TOKEN", callback=header_token,
                                      help="Bearer token."),
    batch_size: int = typer.Option(10_000, min=1, help="Reports per request, cut between steps (10,000: the "
                                                        "service's largest; a service or proxy answering 413 "
                                                        "gets halves)."),
    restart: bool = typer.Option(False, help="Ignore the .offset sidecars and upload from the start."),
    include_deadletter: bool = typer.Option(
        False, "--include-deadletter",
        help="Also retry the reports of the `.deadletter` files next to the spools; those delivered leave them."),
    timeout: float = Timeout,
    follow_symlinks: bool = FollowSymlinks,
    quiet: bool = Quiet,
) -> None:
    """Upload trainer spools to a service: the files (one per rank) are merged so that each
    request carries whole steps. Resumable (each file's `.offset` sidecar records, per
    service URL, what was delivered there) and idempotent (the service ignores identical
    re-sends). Reports the service refuses go to `<spool>.deadletter`; dead-letter files
    found are named (retry them with --include-deadletter). Exit 0: all delivered; 1: some
    refused (dead-lettered); 2: service unreachable (no answer within 3 × --timeout), or a
    wrong URL or token (401/403/404/405)."""
    url = service_url(url)
    from auditor.offline import upload, vet_spools
    from auditor.trainer.spool import dead_letter_files

    dead = dead_letter_files(spools)
    files = (vet_spools(spools, follow_symlinks=follow_symlinks) if include_deadletter and dead
             else _spool_files(spools, follow_symlinks, dead))
    with _spool_progress("import", quiet) as on_progress:
        try:
            counts = upload(files, url, token=token, batch_size=batch_size, restart=restart, timeout=timeout,
                            dead_letters=[p for p, _ in dead] if include_deadletter else (),
                            on_progress=on_progress, follow_symlinks=follow_symlinks)
        except ConnectionError as e:  # unreachable, or a wrong URL/token: 2 (1 means refused reports)
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    new = counts["sent"] - counts["duplicates"]
    where = ", ".join(f"{p} (+{n})" for p, n in counts["dead_lettered"].items())
    typer.echo(f"imported {new} new report(s) from {counts['files']} file(s)"
               + (f" ({counts['duplicates']} already stored, not counted)" if counts["duplicates"] else "")
               + f"; {counts['rejected']} rejected" + (f" (appended to {where})" if where else "")
               + f", {counts['retries']} retried request(s)")
    if counts["skipped"]:
        typer.echo(f"{counts['skipped']} file(s) were already delivered to {url} (their .offset sidecars say so; "
                   "--restart sends them again)")
    if dead and include_deadletter:
        left = [(p, n) for p, n in dead_letter_files(spools)]
        typer.echo(f"retried {sum(n for _, n in dead)} dead-lettered report(s) from {len(dead)} file(s): "
                   + (f"{sum(n for _, n in left)} still refused, kept in {', '.join(str(p) for p, _ in left)}"
                      if left else "all delivered, the dead-letter files are removed"))
    elif dead:
        typer.echo(f"not retried: {sum(n for _, n in dead)} dead-lettered report(s) in "
                   + ", ".join(f"{p} ({n})" for p, n in dead) + " — retry them with --include-deadletter")
    if counts["rejected"]:
        raise typer.Exit(1)


@app.command("audit")
@errors_as_exit_2
def audit_spools(
    spools: list[str] = SpoolPaths,
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Audit only this run."),
    format: Format = typer.Option(Format.table, "--format", "-f", help="table, or json (a list of run reports)."),
    bad_steps: int = typer.Option(20, help="Bad steps shown per statistic."),
    keep_database: Optional[str] = typer.Option(
        None, "--database-url", help="Store into this database instead of a temporary SQLite file."),
    check: bool = typer.Option(False, "--check", help="Exit 1 unless every audited run passes `auditor check`: "
                                                      "no inconsistent, unverified or incomplete step, no refused "
                                                      "or dropped report."),
    allow_incomplete: bool = AllowIncomplete,
    allow_refused: bool = AllowRefused,
    allow_dropped: bool = AllowDropped,
    allow_unverified: bool = AllowUnverified,
    batch_size: int = typer.Option(10_000, min=1, max=100_000,
                                   help="Reports stored and audited per transaction (cut between steps); "
                                        "memory grows with it, not with the spools."),
    follow_symlinks: bool = FollowSymlinks,
    quiet: bool = Quiet,
) -> None:
    """Audit trainer spools offline, with no service: the same engine and report as the service
    (steps still incomplete at the end are audited as after the grace period). The files (one
    per rank) are merged and streamed in batches of whole steps: memory stays flat."""
    from auditor.offline import audit_offline

    files = _spool_files(spools, follow_symlinks)
    with _spool_progress("audit", quiet) as on_progress:
        reports, counts = audit_offline(files, keep_database, run_id=run_id, bad_steps=bad_steps,
                                        batch_size=batch_size, on_progress=on_progress,
                                        follow_symlinks=follow_symlinks)
    typer.echo(f"read {counts['reports']} report(s) from {counts['files']} file(s): {counts['stored']} stored, "
               f"{counts['duplicates']} duplicate(s), {counts['invalid']} invalid, "
               f"{counts['conflicting']} conflicting", err=True)
    if format is Format.json:
        typer.echo(json.dumps(reports, indent=2))
    else:
        from auditor.render import render_report

        console = make_console()
        for data in reports:
            render_report(data, console)
    if not reports:
        raise UsageError("no valid reports in the spools" + (f" for run {run_id!r}" if run_id else ""))
    if check:
        from auditor import status

        failed = False
        for data in reports:
            passed, lines = status.check(data, allow_incomplete=allow_incomplete, allow_refused=allow_refused,
                                         allow_unverified=allow_unverified, allow_dropped=allow_dropped)
            for line in lines:
                typer.echo(line, err=format is Format.json)  # JSON on stdout stays parseable
            failed |= not passed
        if failed:
            raise typer.Exit(1)
