"""AUDITOR_* settings a new user gets wrong, on a real gloo world of 2 (mp.spawn, the
audited hook, client_from_env): every invalid value is said once per rank, with the reason
and what applies instead, and never raises into the trainer or costs it per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.trainer.client import AuditorClient
from auditor.trainer.spool import default_spool_name, spool_files

pytestmark = pytest.mark.multiprocess

TRAINER = Path(__file__).parents[1] / "scripts" / "bad_settings_trainer.py"


def _train(env: dict, steps: int = 10) -> tuple[list[dict], str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_") and k != "RANK"}
    out = subprocess.run([sys.executable, str(TRAINER), str(steps)], env={**base, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return sorted((json.loads(ln) for ln in out.stdout.splitlines()), key=lambda r: r["rank"]), out.stderr


def test_bad_settings_warn_once_per_rank_and_fall_back(tmp_path):
    """AUDITOR_TOPOLOGY=dp=3,cp=5 in a world of 2, AUDITOR_URL=notaurl, AUDITOR_MAX_QUEUE=0
    and AUDITOR_FLUSH_TIMEOUT=-1, 10 steps: each rank says once why the topology cannot be
    used (15 ranks, the world has 2) and reports 'topology: unknown' — no traceback, no
    contradictory "no AUDITOR_TOPOLOGY" line (the repro printed 20 tracebacks); the URL is
    said once and the client writes the spool only (rank0-…/rank1-… files in the spool
    directory, every report kept); the numbers are said once and their defaults apply."""
    spool = tmp_path / "spool"
    ranks, err = _train({"AUDITOR_URL": "notaurl", "AUDITOR_SPOOL_DIR": str(spool), "AUDITOR_RUN_ID": "nu-bad",
                         "AUDITOR_TOPOLOGY": "dp=3,cp=5", "AUDITOR_MAX_QUEUE": "0", "AUDITOR_FLUSH_TIMEOUT": "-1"})
    assert "Traceback" not in err and "no topology known" not in err, err
    topo = [ln for ln in err.splitlines() if "AUDITOR_TOPOLOGY" in ln]
    assert len(topo) == 2, err
    assert all("AUDITOR_TOPOLOGY=dp=3,cp=5 cannot be used: dp=3,cp=5 has 15 ranks (dp·cp·tp·pp), the world has 2; "
               "reporting topology unknown" in ln for ln in topo), err
    assert err.count("'notaurl' is not the http(s) URL of an auditor service") == 2, err
    assert err.count("ignoring AUDITOR_MAX_QUEUE='0' (must be a number >= 1); using the default") == 2, err
    assert err.count("ignoring AUDITOR_FLUSH_TIMEOUT='-1' (must be a number >= 0); using the default") == 2, err
    for r in ranks:
        assert r["file_only"] and r["url"] == f"file://{spool}"
        assert (r["max_queue"], r["flush_timeout"]) == (10_000, 5.0)
        assert r["stats"]["enqueued"] == r["stats"]["spooled"] == 10 and r["stats"]["dropped"] == 0
    files = sorted(spool.glob("*.jsonl"))
    assert [f.name.split("-")[0] for f in files] == ["rank0", "rank1"]  # from the process group: no RANK set
    for f in files:
        reports = [json.loads(ln) for ln in f.read_text().splitlines()]
        assert [r["step"] for r in reports] == list(range(10))
        assert all(r["topology"] == "unknown" and "coords" not in r for r in reports)


def test_report_of_a_non_dict_is_dropped_and_counted(tmp_path, caplog):
    """client.report(None) (or any non-dict) writes nothing: counted dropped, said once."""
    client = AuditorClient(f"file://{tmp_path}", rank=0)
    for bad in (None, None, [1, 2], "x"):
        client.report(bad)
    client.report({"run_id": "r", "step": 0})
    client.close()
    assert client.stats["dropped"] == 4 and client.stats["spooled"] == 1
    assert sum("report() takes a dict" in r.getMessage() for r in caplog.records) == 1
    (spool,) = tmp_path.glob("*.jsonl")
    assert spool.read_text() == '{"run_id":"r","step":0}\n'


@pytest.mark.parametrize("kwargs", [{"max_queue": 0}, {"max_queue": -5}, {"batch_size": "x"},
                                    {"timeout": float("nan")}, {"flush_interval": -1}])
def test_client_arguments_that_cannot_work_fall_back_to_defaults(tmp_path, kwargs, caplog):
    """A numeric argument that would drop every report or never send (0, negative, NaN, not
    a number) is said once and replaced by its default; reports still flow."""
    client = AuditorClient(f"file://{tmp_path}", rank=0, **kwargs)
    (name, value), = kwargs.items()
    assert any(f"ignoring {name}={value!r}" in r.getMessage() for r in caplog.records)
    client.report({"run_id": "r", "step": 0})
    assert client.flush(timeout=10)
    client.close()
    assert client.stats["spooled"] == 1 and client.stats["dropped"] == 0
    assert (client.max_queue, client.batch_size) == (10_000, 1000)


def test_spool_of_an_unknown_rank_is_named_so_and_found(tmp_path, monkeypatch):
    """No RANK and no process group: the spool is rank-unknown-<host>-<pid>-<ms>.jsonl (not
    rankx-…), and `auditor import`/`audit` find it in its directory."""
    monkeypatch.delenv("RANK", raising=False)
    assert default_spool_name().startswith("rank-unknown-")
    client = AuditorClient(f"file://{tmp_path}")
    client.report({"run_id": "r", "step": 0})
    client.close()
    (found,) = spool_files([tmp_path])
    assert found.name.startswith("rank-unknown-") and f"-{os.getpid()}-" in found.name


def test_a_run_id_the_service_would_refuse_is_said_once_and_not_used(caplog):
    """AUDITOR_RUN_ID='my run #1' would have every report refused (422) and dead-lettered:
    it is said once and the ranks agree on a run id instead; a valid one is kept."""
    from auditor.trainer.settings import read_settings

    for _ in range(3):
        assert read_settings({"AUDITOR_RUN_ID": "my run #1"}).run_id is None
    assert sum("ignoring AUDITOR_RUN_ID='my run #1'" in r.getMessage() for r in caplog.records) == 1
    assert read_settings({"AUDITOR_RUN_ID": "qwen3-4b:grpo.0001"}).run_id == "qwen3-4b:grpo.0001"
    assert read_settings({"TORCHELASTIC_RUN_ID": "x" * 129}).elastic_run_id is None


def test_dot_run_ids_the_service_refuses_are_said_once_and_not_used(caplog):
    """AUDITOR_RUN_ID='.' or '..' (a URL path segment resolved away: the service answers 422)
    is said once and not used, like any other run id the service refuses; ids that merely
    hold dots are kept. The trainer's rule and the service's agree on every case."""
    from pydantic import TypeAdapter, ValidationError

    from auditor.contract.names import RunId
    from auditor.trainer.settings import read_settings

    service = TypeAdapter(RunId)
    for raw in (".", "..", "...", ".a", "a..", "..a..", "v1.2", "x" * 128, "x" * 129, "a/b"):
        try:
            service.validate_python(raw)
            refused = False
        except ValidationError:
            refused = True
        assert (read_settings({"AUDITOR_RUN_ID": raw}).run_id is None) == refused, raw
        assert (read_settings({"TORCHELASTIC_RUN_ID": raw}).elastic_run_id is None) == refused, raw
    for raw in (".", ".."):
        for _ in range(3):
            assert read_settings({"AUDITOR_RUN_ID": raw}).run_id is None
        assert sum(f"ignoring AUDITOR_RUN_ID={raw!r}" in r.getMessage() for r in caplog.records) == 1, raw
    assert read_settings({"AUDITOR_RUN_ID": "v1.2"}).run_id == "v1.2"


@pytest.mark.parametrize("token", ["t\u2603ken", "a\nb", "a\x00b"])
def test_a_token_that_is_no_header_value_makes_a_spool_only_client_not_an_exception(tmp_path, token, caplog):
    """AuditorClient(url, token="t☃ken") (AUDITOR_TOKEN pasted with a non-ASCII character)
    raised UnicodeEncodeError from the constructor - in the trainer, at start-up - and a
    control character made every request fail. Now the client writes the spool only,
    says why once, and every report is kept."""
    client = AuditorClient("http://127.0.0.1:9", token=token, spool_dir=tmp_path, rank=0)
    client.report({"run_id": "r", "step": 0})
    client.close()
    assert client.file_only and client.stats["spooled"] == 1 and client.stats["dropped"] == 0
    assert sum("the token is not printable ASCII" in r.getMessage() for r in caplog.records) == 1
    (spool,) = tmp_path.glob("*.jsonl")
    assert spool.read_text() == '{"run_id":"r","step":0}\n'


def test_a_host_no_request_can_encode_makes_a_spool_only_client(tmp_path):
    """A host label over 63 characters passed httpx.URL but failed IDNA encoding on every
    request: a UnicodeError traceback in the sender every second. Now it is not a service
    URL: the client writes the spool only."""
    client = AuditorClient("http://" + "a" * 64 + ":8000", spool_dir=tmp_path, rank=0)
    client.report({"run_id": "r", "step": 0})
    client.close()
    assert client.file_only and client.stats["spooled"] == 1


def test_waits_that_cannot_work_fall_back_instead_of_hanging_or_raising(tmp_path):
    """flush(timeout=nan) waited for ever (Condition.wait_for never times out on NaN), and
    flush/close with a timeout above threading.TIMEOUT_MAX, or flush_timeout=1e308 (also from
    AUDITOR_FLUSH_TIMEOUT), raised OverflowError - in close(), at the trainer's exit. Each
    now falls back to flush_timeout (said once) and returns."""
    import threading
    import time

    client = AuditorClient("http://127.0.0.1:9", spool_dir=tmp_path, rank=0, flush_timeout=0.3)
    client.report({"run_id": "r", "step": 0})
    out = {}
    for name, call in (("nan", lambda: client.flush(timeout=float("nan"))),
                       ("huge", lambda: client.flush(timeout=1e308))):
        t = threading.Thread(target=lambda n=name, c=call: out.__setitem__(n, (c(), time.monotonic())), daemon=True)
        start = time.monotonic()
        t.start()
        t.join(10)
        assert not t.is_alive(), f"flush(timeout={name}) still waiting after 10 s"
        assert out[name][0] is False and out[name][1] - start < 5
    client.close(timeout=1e308)
    assert client.stats["spooled"] == 1
    other = AuditorClient("http://127.0.0.1:9", spool_dir=tmp_path, rank=1, flush_timeout=1e308)
    assert other.flush_timeout == 5.0
    other.close(timeout=0.1)


def test_the_workload_label_goes_on_every_report(tmp_path, caplog):
    """AuditorClient(workload=...) (AUDITOR_WORKLOAD through client_from_env) puts the label
    on every report that names none — plain and deferred (built on the sender thread) — and
    leaves one a report names; AUDITOR_WORKLOAD the service would refuse is said once and
    not used."""
    import torch

    from auditor.trainer.settings import read_settings

    client = AuditorClient(f"file://{tmp_path}", rank=0, workload="wl-7")
    client.report({"run_id": "r", "step": 0})
    client.report({"run_id": "r", "step": 1, "workload": "own"})
    client.report_deferred(torch.tensor([2.0], dtype=torch.float64), lambda v: {"run_id": "r", "step": int(v[0])})
    client.close()
    (found,) = spool_files([tmp_path])
    lines = [json.loads(x) for x in found.read_text().splitlines()]
    assert sorted((x["step"], x["workload"]) for x in lines) == [(0, "wl-7"), (1, "own"), (2, "wl-7")]
    for _ in range(2):
        assert read_settings({"AUDITOR_WORKLOAD": "my workload"}).workload is None
    assert sum("ignoring AUDITOR_WORKLOAD='my workload'" in r.getMessage() for r in caplog.records) == 1
    assert read_settings({"AUDITOR_WORKLOAD": " qwen3-4b:grpo "}).workload == "qwen3-4b:grpo"
    assert read_settings({}).workload is None
