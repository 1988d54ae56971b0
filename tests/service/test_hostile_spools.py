"""`auditor audit` and `auditor import` on files that are not spools (UTF-16, random bytes,
two million `{}` lines, a 15 MB line of a million keys, a symbolic link to /etc/passwd), run
in a child under RLIMIT_AS: refused in one line before anything is sent or stored, in
bounded memory and time."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
from factory import reference_reports

from auditor.testing.garbage import run_capped
from auditor.trainer.spool import read_offsets

MAX_RSS = 400 << 20


def _auditor(*args: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_")}
    return run_capped([sys.executable, "-m", "auditor", *args], timeout=120, env=env)


def _good(run_id: str = "h", steps: int = 2) -> str:
    return "".join(json.dumps(r) + "\n" for s in range(steps) for r in reference_reports(run_id, buggy=False, step=s))


def _files(tmp_path) -> dict:
    d = tmp_path / "bad"
    d.mkdir()
    (d / "utf16.jsonl").write_bytes(_good().encode("utf-16"))
    (d / "random.jsonl").write_bytes(random.Random(0).randbytes(10 << 20))
    (d / "braces.jsonl").write_bytes(b"{}\n" * 2_000_000)
    (d / "huge.jsonl").write_text(json.dumps({f"k{i}": i for i in range(1_000_000)}) + "\n")
    (d / "rank0.jsonl").symlink_to("/etc/passwd")
    return {
        "utf16.jsonl": "is UTF-16 text (its byte-order mark), not a spool",
        "random.jsonl": "not a spool",  # NUL bytes or not UTF-8, by where the first bad byte falls
        "braces.jsonl": "is not a spool: none of its first 1,000 line(s)",
        "huge.jsonl": "is not a spool: none of its first 1 line(s)",
        "rank0.jsonl": "is a symbolic link (to /etc/passwd): not followed; pass --follow-symlinks",
    }


@pytest.mark.parametrize("command", ["audit", "import"])
def test_files_that_are_not_spools_are_refused_in_one_line(tmp_path, command):
    """Each refused naming the file and why (a UTF-16 spool made `audit` raise "read length
    must be non-negative"; random bytes or 2 M `{}` kept `import` posting line by line for
    minutes; `import` followed a link to /etc/passwd and posted its lines); nothing sent
    (the URL answers nothing: a post would fail differently), no sidecar written."""
    files = _files(tmp_path)
    for name, why in files.items():
        path = tmp_path / "bad" / name
        args = ["--url", "http://127.0.0.1:9", "--timeout", "1"] if command == "import" else []
        out = _auditor(command, str(path), *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and lines == [lines[0]] and lines[0].startswith(f"error: {path}"), out.stderr
        assert why in lines[0], (name, lines[0])
        assert "Traceback" not in out.stderr and out.maxrss < MAX_RSS and out.seconds < 30, (name, out)
        assert not list((tmp_path / "bad").glob("*.offset")) and not list((tmp_path / "bad").glob("*.deadletter"))


def test_a_symlink_is_read_when_asked_and_a_huge_line_inside_a_spool_is_refused_before_parsing(tmp_path):
    """--follow-symlinks reads a linked spool. A 15 MB line of a million keys inside a real
    spool is refused before it is parsed (it took `audit` to 1.1 GB): named, counted invalid,
    the other reports audited."""
    real = tmp_path / "real.jsonl"
    huge = json.dumps({f"k{i}": i for i in range(850_000)})  # 15 MB: under the 16 MiB the reader holds at most
    real.write_text(_good() + huge + "\n" + _good(steps=3))
    d = tmp_path / "spool"
    d.mkdir()
    (d / "rank0.jsonl").symlink_to(real)
    assert _auditor("audit", str(d)).returncode == 2
    out = _auditor("audit", str(d), "--follow-symlinks", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert f"a line of {len(huge) + 1:,} bytes" in out.stderr and "longer than the 1 MiB a report may have (not parsed)" in out.stderr
    assert "1 invalid" in out.stderr and out.maxrss < MAX_RSS, out.maxrss
    (report,) = json.loads(out.stdout)
    assert report["statistics"][0]["steps_consistent"] == 3


def test_non_utf8_and_deadletter_only_directories_are_named(tmp_path):
    """A directory holding only dead-letter files names them and --include-deadletter
    (it said "no spool files"); an offset sidecar past the end of its file is an error, not
    "already delivered"."""
    d = tmp_path / "spool"
    d.mkdir()
    (d / "rank0.jsonl.deadletter").write_text(_good(steps=1))
    out = _auditor("import", str(d), "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and "holds only dead-letter files" in out.stderr and \
        f"{d / 'rank0.jsonl.deadletter'} (2)" in out.stderr and "--include-deadletter" in out.stderr, out.stderr
    spool = d / "rank1.jsonl"
    spool.write_text(_good(steps=1))
    (d / "rank1.jsonl.offset").write_text(json.dumps({"http://127.0.0.1:9": 10**6}))
    out = _auditor("import", str(spool), "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and "its .offset sidecar says 1,000,000 bytes were delivered" in out.stderr and \
        "--restart sends it whole" in out.stderr, out.stderr
    assert read_offsets(spool) == {"http://127.0.0.1:9": 10**6}
