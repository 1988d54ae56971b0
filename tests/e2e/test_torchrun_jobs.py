"""Back-to-back torchrun jobs with no run id (issue 10, §5): real `torchrun` launches, a live
service, the `auditor check` CI gate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.server import free_port

pytestmark = pytest.mark.multiprocess

JOB = Path(__file__).parents[1] / "scripts" / "torchrun_job.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _job(url: str, mode: str, spool: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("AUDITOR_RUN_ID", "TORCHELASTIC_RUN_ID")}
    env.update(AUDITOR_URL=url, AUDITOR_TOPOLOGY="cp=2", AUDITOR_SPOOL_DIR=str(spool))
    proc = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), str(JOB), mode],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = re.findall(r"auditor: run id (\S+)", proc.stderr)
    assert len(ids) == 1, proc.stderr[-3000:]  # logged once, by rank 0
    return ids[0]


def _check(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AUDITOR_RUN_ID"}
    return subprocess.run([sys.executable, "-m", "auditor", "check", *args, "--url", url], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_back_to_back_torchrun_jobs_get_distinct_runs_and_gate_correctly(live_server, tmp_path):
    """Two plain `torchrun --master-port P` jobs (TORCHELASTIC_RUN_ID=none, no AUDITOR_RUN_ID):
    each gets its own run id, agreed by both ranks through the store and logged once on rank
    0 (never "none"); both jobs' reports are accepted. `auditor check ID` exits 0 for the
    correct job and 1 for the buggy one; `auditor check` with no id (several runs stored)
    and `auditor check none` exit 2 saying why."""
    good = _job(live_server.url, "correct", tmp_path / "spool")
    bad = _job(live_server.url, "buggy", tmp_path / "spool")
    assert good != bad and "none" not in (good, bad) and good.startswith("auditor-")
    for run, steps in ((good, 2), (bad, 2)):
        rep = live_server.get(f"/v1/runs/{run}/report").json()
        assert rep["world_size"] == 2 and rep["statistics"][0]["steps_audited"] == steps
    ok, failed = _check(live_server.url, good), _check(live_server.url, bad)
    assert ok.returncode == 0 and "consistent (2 step(s) audited)" in ok.stdout
    assert failed.returncode == 1 and "INCONSISTENT" in failed.stdout and "cp_disagreement" in failed.stdout
    ambiguous = _check(live_server.url)
    assert ambiguous.returncode == 2 and "which run?" in ambiguous.stderr
    placeholder = _check(live_server.url, "none")
    assert placeholder.returncode == 2 and "is not a run id" in placeholder.stderr
