"""Usage errors of the `auditor` command: one line, exit 2, nothing created."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from auditor.server.run import free_port


def auditor(*args: str, cwd=None, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "auditor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_version_and_help_reflow():
    """`auditor --version` prints the package version; help paragraphs are reflowed, not cut
    where the docstring's lines end; --grace-seconds names its default and variable."""
    from auditor import __version__

    out = auditor("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"auditor {__version__}"
    out = subprocess.run([sys.executable, "-m", "auditor", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "NO_COLOR": "1"})
    assert "advisory lock, so replicas may start at once" in out.stdout, out.stdout
    grace = " ".join(ln for ln in out.stdout.splitlines() if "grace" in ln or "AUDITOR_GRACE" in ln)
    assert "[default: 60]" in grace and "AUDITOR_GRACE_SECONDS" in out.stdout


def test_the_command_line_is_declared_without_the_service_s_libraries():
    """Declaring the commands (what `auditor --help` and every command's start pay) imports
    none of SQLAlchemy, alembic, pydantic-settings, httpx or rich's console: each is imported
    by the command that uses it (they took 0.42 s of every command's start)."""
    heavy = ("sqlalchemy", "alembic", "pydantic_settings", "httpx", "rich.console", "auditor.config",
             "auditor.service", "auditor.reader")
    out = auditor(code=f"import sys, auditor.cli; print([m for m in {heavy!r} if m in sys.modules])")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("demo", "--database-url", "bogus://x"), "bad database URL: Can't load plugin: sqlalchemy.dialects:bogus"),
    (("demo", "--database-url", "sqlite:////nonexistent-dir/a.db"), "directory of SQLite database"),
    (("serve", "--database-url", "sqlite:////nonexistent-dir/a.db"), "directory of SQLite database"),
    (("runs", "--database-url", "sqlite:///typo/auditor.db"), "no auditor database at typo/auditor.db"),
    (("report", "r", "--database-url", "sqlite:///typo.db"), "no auditor database at typo.db"),
    (("db", "current", "--database-url", "sqlite:///typo.db"), "no auditor database at typo.db"),
    (("report", "r", "--url", "not-a-url"), "must be the http(s) URL of an auditor service"),
    (("runs", "--url", "ftp://host"), "must be the http(s) URL of an auditor service"),
    (("import", "x.jsonl", "--url", "not-a-url"), "must be the http(s) URL of an auditor service"),
    (("demo", "--layouts", "1x1,2"), "--layouts: layout '2' is not DPxCP (e.g. 2x1)"),
    (("demo", "--layouts", "1x1,2x1,1x1"), "--layouts: layout 1x1 given twice"),
    (("demo", "--layouts", "1x2,8x8"), "--dp × --cp is 8 × 8 = 64 workers; the demo runs at most 32"),
    (("runs", "--database-url", "mysql://u@h/db"), "the auditor stores in SQLite (sqlite:///path) or PostgreSQL"),
    (("serve", "--log-level", "bogus"), "--log-level 'bogus': expected one of critical, error, warning, info, debug"),
])
def test_mistakes_are_one_line_exit_2_and_create_nothing(tmp_path, args, message):
    """A bad database URL, a mistyped SQLite path or a non-HTTP service URL: one line naming
    the problem, exit 2, at once (no server start, no 30 s wait), and no file or directory
    left behind."""
    out = auditor(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [("runs",), ("report", "r"), ("check", "r"), ("compare", "a", "b"),
                                  ("import", "x.jsonl")])
def test_a_timeout_past_a_day_is_refused_naming_the_option(tmp_path, args):
    """``--timeout inf`` (or 1e10) was a 60-line traceback ("timestamp out of range for
    platform time_t") from the deadline arithmetic: the option takes at most 86,400 s."""
    out = auditor(*args, "--url", "http://127.0.0.1:9", "--timeout", "inf", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--timeout" in out.stderr and "86400" in out.stderr, out.stderr


@pytest.mark.parametrize("server", ["stranger", "html"])
def test_demo_against_a_url_that_is_no_auditor_exits_2_before_any_worker(tmp_path, server):
    """`auditor demo --url` at a service whose /healthz answers 200 but has no auditor API
    (it exited 0 with every report dead-lettered as poison), or that answers HTML: one
    line naming the URL, exit 2, no spool left."""
    from auditor.testing.garbage import GarbageServer, StrangerServer

    with (StrangerServer() if server == "stranger" else GarbageServer("html")) as srv:
        url = srv if isinstance(srv, str) else srv.url
        out = subprocess.run([sys.executable, "-m", "auditor", "demo", "--url", url], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 2 and out.stderr.startswith(f"error: {url} is not an auditor service"), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr and list(tmp_path.iterdir()) == []


def test_demo_on_a_missing_postgresql_database_exits_2_at_once(tmp_path):
    out = auditor("demo", "--database-url", "postgresql+psycopg://127.0.0.1:5432/no_such_db_here", cwd=tmp_path)
    assert out.returncode == 2 and 'database "no_such_db_here" does not exist' in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_demo_without_the_torch_extra_names_it_and_creates_nothing(tmp_path):
    """As in the Docker image (no torch): name the extra and how to install it; no
    ./auditor.db appears."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "from auditor.cli import app; app(['demo'], prog_name='auditor')")
    out = auditor(code=code, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "needs the torch extra" in out.stderr and "pip install 'auditor[torch]'" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_demo_with_cp_1_says_the_bug_needs_cp_2(tmp_path):
    """`--cp 1` cannot show the bug (without CP the DP group is the right one): the demo says
    so before it starts (here it then stops at the bad --url, exit 2)."""
    out = auditor("demo", "--cp", "1", "--url", "not-a-url", cwd=tmp_path)
    assert out.returncode == 2
    assert "the bug needs --cp 2 or more" in " ".join(out.stdout.split())


#: Stands for a port nobody listens on, chosen when the test runs: a fixed one (9) was taken
#: by the other xdist worker's `serve` of a neighbouring test ("Address already in use").
FREE_PORT = "<free port>"


def _ports(args: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(str(free_port()) if a == FREE_PORT else a for a in args)


@pytest.mark.parametrize("args", [("runs",), ("report", "r"), ("check", "r"), ("db", "current"), ("db", "upgrade"),
                                  ("serve", "--port", FREE_PORT), ("audit", "x.jsonl")])
def test_a_file_that_is_not_a_sqlite_database_is_one_line_and_left_as_it_was(tmp_path, args):
    """--database-url naming a file that is not SQLite (a log, a spool: a mistyped path) was a
    traceback of the first PRAGMA and "unexpected DatabaseError", exit 2, from every command;
    now it is one line naming the file, exit 2, and the file's bytes are unchanged."""
    log = tmp_path / "server.log"
    log.write_bytes(b"INFO: started\n")
    (tmp_path / "x.jsonl").write_text("")
    out = auditor(*_ports(args), "--database-url", f"sqlite:///{log}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: bad database URL: {log} is not a SQLite database (its first bytes are not " \
                         "SQLite's header); fix the path\n", out.stderr
    assert log.read_bytes() == b"INFO: started\n"


@pytest.mark.parametrize("args", [("runs",), ("report", "r"), ("check", "r"), ("db", "current")])
def test_a_read_only_command_leaves_an_empty_file_empty(tmp_path, args):
    """A read-only command on an empty file says there is no auditor database, as for a
    missing one; before, connecting turned the file into a 4,096-byte SQLite database (the
    WAL pragma writes the header) and then said there was none."""
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    out = auditor(*args, "--database-url", f"sqlite:///{empty}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: no auditor database at {empty} (an empty file; pass --database-url or --url)\n"
    assert empty.read_bytes() == b"" and sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


@pytest.mark.parametrize("args", [("report", "r"), ("check", "r"), ("runs", "delete", "r"), ("import", "x.jsonl")])
def test_a_token_that_is_no_header_value_is_a_usage_error_naming_it(tmp_path, args):
    """--token (or AUDITOR_TOKEN) with a character an HTTP header cannot carry was a traceback
    and "unexpected UnicodeEncodeError", exit 2; now it is the option's usage error: exit 2,
    naming --token, no traceback, nothing contacted."""
    (tmp_path / "x.jsonl").write_text("")
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "auditor", *args, "--url", "http://127.0.0.1:9", "--token", "t\u2603"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert "Invalid value for '--token'" in out.stderr and "must be printable ASCII" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_reader_refuses_a_token_no_header_can_carry():
    from auditor import Reader

    with pytest.raises(ValueError, match="token must be printable ASCII"):
        Reader("http://127.0.0.1:9", token="t\u2603")


@pytest.mark.parametrize("args", [("serve", "--port", FREE_PORT), ("demo",)])
def test_a_setting_out_of_range_is_one_line_naming_each_variable(tmp_path, args):
    """AUDITOR_* variables outside their range (AUDITOR_MAX_BODY_BYTES=0, a NaN interval)
    were pydantic's ValidationError: a traceback and "unexpected ValidationError", exit 2.
    Now one line names each variable, its value and the rule; nothing is created."""
    env = {**os.environ, "AUDITOR_MAX_BODY_BYTES": "0", "AUDITOR_SWEEP_INTERVAL_SECONDS": "nan"}
    out = subprocess.run([sys.executable, "-m", "auditor", *_ports(args)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr == ("error: AUDITOR_SWEEP_INTERVAL_SECONDS='nan': Input should be greater than 0; "
                          "AUDITOR_MAX_BODY_BYTES='0': Input should be greater than or equal to 1024\n"), out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("var", "value", "limit"), [("AUDITOR_SHUTDOWN_TIMEOUT_SECONDS", "1e308", "9.22337e+09"),
                                                    ("AUDITOR_DB_LOCK_TIMEOUT_SECONDS", "inf", "9.22337e+09"),
                                                    ("AUDITOR_RUN_RETENTION_DAYS", "1e300", "106752")])
def test_a_duration_no_wait_can_take_is_refused_at_start(tmp_path, var, value, limit):
    """AUDITOR_SHUTDOWN_TIMEOUT_SECONDS=1e308 started the service, whose shutdown thread then
    died of OverflowError (a wait past threading.TIMEOUT_MAX); an infinite lock timeout
    overflowed SQLite's busy timeout. A duration is at most threading.TIMEOUT_MAX seconds:
    past it, one line naming the variable, exit 2, before anything starts."""
    env = {**os.environ, var: value}
    out = subprocess.run([sys.executable, "-m", "auditor", "serve", "--port", str(free_port())], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: {var}={value!r}: Value error, at most {limit} (a wait of ~292 years)\n", out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("dp", "cp", "workers"), [("17", "2", "34"), ("100000", "2", "200,000"), ("1", "33", "33")])
def test_demo_refuses_a_world_it_cannot_spawn_before_starting_anything(tmp_path, dp, cp, workers):
    """Every demo rank is a process holding torch (~0.36 GiB): `--dp 100000` spawned 200,000
    of them (a fork bomb on any machine). Above 32 workers it is one line naming the
    options, the product and the limit, exit 2, before any service, worker or ./auditor.db
    (checked before --url too: nothing is contacted)."""
    out = auditor("demo", "--dp", dp, "--cp", cp, "--url", "http://127.0.0.1:9", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: --dp × --cp is {dp} × {cp} = {workers} workers; the demo runs at most 32 " \
                         "(each is a process holding torch, ~0.36 GiB)\n", out.stderr
    assert list(tmp_path.iterdir()) == []


def test_run_workers_refuses_a_world_above_the_demo_limit_without_spawning():
    from auditor.demo import reference

    with pytest.raises(ValueError, match=r"4 × 9 = 36 workers; the demo runs at most 32"):
        reference.run_workers(reference.REFERENCE_SAMPLES, 4, 9, ("a", "b"))


def test_audit_names_file_line_and_field_of_bad_lines(tmp_path):
    """`auditor audit` on a file with bad lines says, per line, FILE:LINE and the wire field
    (or "not JSON"), names at most 5 per file and counts the rest — not 30 identical lines
    of "7 validation errors"."""
    import json

    bad = {"run_id": "r", "statistic": "a", "step": 0, "rank": 0, "world_size": 2,
           "coords": {"dp": 0, "cp": 0, "tp": 0, "pp": 0}, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
           "local": {"count": 3, "sum": 1, "sum_sq": 1}, "applied": None, "dtype": "float99"}
    from factory import reference_reports

    lines = ["this is not a report"] * 30
    lines[2] = json.dumps(bad)
    lines += [json.dumps(r) for r in reference_reports("r2", buggy=False)]  # a spool: it holds reports
    spool = tmp_path / "x.jsonl"
    spool.write_text("\n".join(lines) + "\n")
    out = auditor("audit", str(spool))
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "invalid report skipped" in ln]
    assert len(warnings) == 5
    assert warnings[0].startswith(f"{spool}:1: invalid report skipped: not JSON")
    assert warnings[2].startswith(f"{spool}:3: invalid report skipped: dtype: ")
    assert f"{spool}: 25 more invalid line(s) skipped (30 in all)" in out.stderr


def test_audit_of_a_spool_that_cannot_be_read_names_it_in_one_line(tmp_path):
    """A spool whose reading fails (here an I/O error: /proc/self/mem read at offset 0; a
    permission error takes the same path) is one line naming the file and what failed,
    exit 2, no traceback."""
    spool = tmp_path / "rank0.jsonl"
    spool.symlink_to("/proc/self/mem")
    out = auditor("audit", str(spool), "--follow-symlinks")  # without it: refused, "a symbolic link"
    assert (out.returncode, out.stderr.strip()) == (2, f"error: Input/output error: {spool}")
