"""What the commands print at their edges: `runs --status/--format json`, `serve` naming its
database, database-URL mistakes shown their right form, a closed stdout."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
from factory import reference_reports

from auditor.server.run import free_port
from auditor.testing.cli import run_auditor


auditor = functools.partial(run_auditor, clean=True)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_runs_filters_by_status_and_prints_json(live_server, run_id):
    """`auditor runs --status S --format json`: the runs of that status, as the API lists
    them (the API, the page and the Reader had the filter; the command had not)."""
    assert live_server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=True)}).status_code == 200
    out = auditor("runs", "--url", live_server.url, "--status", "inconsistent", "--format", "json")
    assert out.returncode == 0, out.stderr
    runs = {r["run_id"]: r for r in json.loads(out.stdout)}
    assert runs[run_id]["status"] == "inconsistent" and runs[run_id]["steps_inconsistent"] == 1
    out = auditor("runs", "--url", live_server.url, "--status", "consistent", "--format", "json")
    assert run_id not in {r["run_id"] for r in json.loads(out.stdout)}
    out = auditor("runs", "--url", live_server.url, "--status", "nope")
    assert out.returncode == 2 and "'nope' is not one of" in out.stderr


@pytest.mark.parametrize("url, said", [
    ("auditor.db", "'auditor.db' is a path, not a URL: a SQLite file is sqlite:///{cwd}/auditor.db"),
    ("postgres://me:secret@db/auditor", "SQLAlchemy spells PostgreSQL with its driver: "
                                        "postgresql+psycopg://me:***@db/auditor"),
    ("sqlite:///data/auditor.db", "sqlite:///data/auditor.db is relative to the current directory "
                                  "({cwd}/data/auditor.db); an absolute path takes four slashes: "
                                  "sqlite:////data/auditor.db"),
])
def test_database_url_mistakes_are_shown_the_right_form(tmp_path, url, said):
    """A bare path, `postgres://`, `sqlite:///` with a relative path: exit 2, one line that
    shows the URL meant (the password not repeated)."""
    out = auditor("runs", "--database-url", url, cwd=tmp_path)
    assert out.returncode == 2 and said.format(cwd=tmp_path) in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "secret" not in out.stderr


def test_serve_names_the_database_it_opened(tmp_path):
    """`auditor serve` with the default relative `./auditor.db` says which file that is
    (started from another directory, it served an empty one without a word)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_")}
    proc = subprocess.Popen([sys.executable, "-m", "auditor", "serve", "--port", str(free_port()), "--log-level",
                             "warning"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    try:
        line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(30)
    assert line == f"auditor serve: database sqlite:///{tmp_path}/auditor.db\n"


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    """`auditor ... | head` once head left: no BrokenPipeError traceback, no error line,
    exit 141 (128 + SIGPIPE, as a tool killed by SIGPIPE; it was 2, or 1 — `check`'s
    "inconsistent" — for `report`); `--help` is click's own: quiet, exit 1."""
    db = f"sqlite:///{tmp_path}/a.db"
    assert auditor("db", "upgrade", "--database-url", db).returncode == 0
    for args, code in ((("runs", "--database-url", db, "--format", "json"), 141), (("runs", "--database-url", db), 141),
                       (("--help",), 1)):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before anything is written
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_")}
        proc = subprocess.run([sys.executable, "-m", "auditor", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=env, cwd=tmp_path)
        os.close(w)
        assert (proc.returncode, proc.stderr) == (code, ""), (args, proc.stderr)
