"""Spool files: torn lines, resumable idempotent `auditor import`, file-only mode by environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from auditor.trainer.client import client_from_env
from auditor.offline import upload
from auditor.trainer.spool import Spool, SpoolReader, line_key, read_lines, read_offset, write_offset
from factory import reference_reports


def test_torn_last_line_is_never_read(tmp_path):
    """A line without its newline (a crash mid-write) is not returned, and the offset stops
    before it; blank lines are consumed."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"a":1}\n\n{"a":2}\n{"a":3')
    lines, end = read_lines(path)
    assert lines == [b'{"a":1}', b'{"a":2}'] and end == len(b'{"a":1}\n\n{"a":2}\n')


def test_spool_commit_truncates_when_drained(tmp_path):
    """Committing everything empties the file (it never holds more than what is undelivered);
    close() then removes a delivered spool and its sidecar."""
    spool = Spool(tmp_path / "s.jsonl")
    spool.append([b'{"a":1}', b'{"a":2}'])
    lines, end = spool.read(10)
    assert lines == [b'{"a":1}', b'{"a":2}'] and spool.pending()
    spool.commit(end)
    assert not spool.pending() and (tmp_path / "s.jsonl").stat().st_size == 0
    assert spool.close() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_import_is_resumable_and_idempotent(live_server, tmp_path, run_id):
    """`auditor import` uploads a spool and records the offset; a second import sends nothing;
    with the sidecar rewound to the middle it resends only the rest, and the service stores
    each report once (the re-sent ones are duplicates); --restart re-sends everything and says
    that none of it was new."""
    reports = [r for s in range(5) for r in reference_reports(run_id, buggy=False, step=s)]
    path = tmp_path / "rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reports))
    cmd = [sys.executable, "-m", "auditor", "import", str(tmp_path), "--url", live_server.url, "--batch-size", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported 10 new report(s) from 1 file(s); 0 rejected" in out.stdout
    assert read_offset(path, live_server.url) == path.stat().st_size
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "imported 0 new report(s)" in out.stdout
    out = subprocess.run([*cmd, "--restart"], capture_output=True, text=True, timeout=120)
    assert "imported 0 new report(s) from 1 file(s) (10 already stored, not counted); 0 rejected" in out.stdout
    half = len("".join(json.dumps(r) + "\n" for r in reports[:4]))
    write_offset(path, live_server.url, half)
    counts = upload([path], live_server.url, batch_size=4)
    assert counts == {"files": 1, "sent": 6, "duplicates": 6, "rejected": 0, "retries": 0, "skipped": 0,
                      "dead_lettered": {}}
    (stat,) = live_server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert stat["steps_audited"] == stat["steps_consistent"] == 5


def test_file_only_mode_from_the_environment(tmp_path, monkeypatch):
    """AUDITOR_URL=file:///dir: the client opens no connection and writes each report to
    a JSONL spool in dir; flush means 'written'; the file is kept at close."""
    monkeypatch.setenv("AUDITOR_URL", f"file://{tmp_path}")
    client = client_from_env(rank=3)
    assert client.file_only and client._http is None
    for r in reference_reports("file-run", buggy=True):
        client.report(r)
    assert client.flush(timeout=10)
    client.close()
    (path,) = tmp_path.glob("rank3-*.jsonl")
    assert [json.loads(x)["rank"] for x in path.read_text().splitlines()] == [0, 1]
    assert client.stats["spooled"] == 2 and client.stats["dropped"] == 0


def _rank_files(tmp_path, ranks: int, steps: int, statistics=("advantages", "loss")) -> list:
    """One spool file per rank, as trainers leave them: each in step order, every statistic
    of a step (in the order the trainer reports them, not sorted) before the next step."""
    paths = []
    for rank in range(ranks):
        p = tmp_path / f"rank{rank}.jsonl"
        p.write_text("".join(json.dumps({"run_id": "r", "statistic": stat, "step": step, "rank": rank}) + "\n"
                             for step in range(steps) for stat in statistics))
        paths.append(p)
    return paths


def _keys(items):
    return [(json.loads(line)["step"], json.loads(line)["statistic"], json.loads(line)["rank"]) for *_, line in items]


def test_reader_merges_rank_files_so_the_ranks_of_a_step_follow_each_other(tmp_path):
    """The k-way merge of per-rank files yields every line once, each file's lines in file
    order, ordered by (run, step, statistic) with the ranks of one (step, statistic) next to
    each other in file order; batches are cut between steps (a full batch gives its last,
    unfinished step to the next one), and a step larger than a batch is cut."""
    paths = _rank_files(tmp_path, ranks=3, steps=3)
    reader = SpoolReader(paths)
    merged = list(reader.lines())
    assert _keys(merged) == [(step, stat, rank) for step in range(3) for stat in ("advantages", "loss")
                             for rank in range(3)]
    assert reader.ends == [p.stat().st_size for p in paths]
    batches = [_keys(b) for b in SpoolReader(paths).batches(5)]
    assert [len(b) for b in batches] == [3] * 6  # 5 would split a 3-rank group: whole groups only
    assert all(len({(s, st) for s, st, _ in b}) == 1 for b in batches)
    assert [len(b) for b in SpoolReader(paths).batches(2)] == [2, 1] * 6  # groups of 3 > 2: cut
    assert [len(b) for b in SpoolReader(paths).batches(7)] == [6, 6, 6]


def test_reader_resumes_from_offsets_and_keeps_bad_lines_with_their_neighbours(tmp_path):
    """Each file is read from its own start offset; a line without the key fields (not JSON)
    keeps its place after the line before it in its file; a torn last line is never read and
    trailing blank lines count as read once the file is exhausted."""
    a, b = _rank_files(tmp_path, ranks=2, steps=2, statistics=("advantages",))
    first = len(a.read_bytes().splitlines(keepends=True)[0])
    with open(b, "ab") as f:
        f.write(b"{not json\n\n")
    size_b = b.stat().st_size
    with open(b, "ab") as f:
        f.write(b'{"run_id":"r","statistic":"advantages","step":9')  # torn: no newline
    reader = SpoolReader([a, b], starts=[first, 0])
    items = list(reader.lines())
    assert [line for *_, line in items] == [b.read_bytes().splitlines()[0], a.read_bytes().splitlines()[1],
                                            b.read_bytes().splitlines()[1], b"{not json"]
    assert reader.ends == [a.stat().st_size, size_b]


def test_line_key_is_read_without_decoding():
    """The merge key (run_id, step, statistic) comes from the encoded line; a missing field
    gives None (the line then travels with its file's previous line)."""
    line = b'{"run_id": "run-1", "step": 12, "statistic": "adv", "rank": 3, "spec": {"x": "\\"step\\":1"}}'
    assert line_key(line) == (b'"run-1"', 12, b'"adv"')
    assert line_key(b'{"run_id":"r","statistic":"a"}') is None
    # a step of more digits than int() reads (4,300): no key, never a ValueError (it ended
    # `auditor audit` and `auditor import` with a traceback)
    for sep in (b"", b" "):
        huge = b'{"run_id":%s"r",%s"statistic":%s"a",%s"step":%s%s,"rank":0}' % (sep, sep, sep, sep, sep, b"9" * 5000)
        assert line_key(huge) is None


@pytest.mark.parametrize(("sidecar", "offset"), [
    ("[" * 100_000, 0),                                   # nested past json's limit: RecursionError before
    ('{"http://svc": true}', 0),                          # read as offset 1 before
    ('{"http://svc": 1.5}', 0),
    ('{"http://svc": 40, "http://other": "x"}', 40),
    ("\udcff", 0),                                        # not UTF-8
])
def test_a_damaged_offset_sidecar_means_nothing_delivered(tmp_path, sidecar, offset):
    """`auditor import` resumes from the .offset sidecar; a damaged one (an editor, a full
    disk) is read as "nothing delivered to that service" (import re-sends: idempotent), never
    an error - a sidecar of 100,000 '[' ended `auditor import` with "unexpected
    RecursionError", exit 2."""
    path = tmp_path / "rank-0.jsonl"
    path.write_text("")
    (tmp_path / "rank-0.jsonl.offset").write_bytes(sidecar.encode("utf-8", "surrogateescape"))
    assert read_offset(path, "http://svc") == offset
