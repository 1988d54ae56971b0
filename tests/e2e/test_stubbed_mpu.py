"""The seed's bug in a framework's own CPU test harness: Megatron not initialised, a stub
``megatron.core.mpu`` (tests/e2e/framework_stub.py), slime's whitening audited through the
one-import hook, real gloo ranks, a real service on each database. Before the change this
reported ``consistent`` (the layout unknown, each rank judged against the group it reduced
over); now the buggy run is inconsistent on the report, ``auditor check`` and the page, with
the seed's numbers, and the fixed one consistent: with the stub's four accessors from the
layout they state, with only ``get_data_parallel_group`` from what the values prove."""

from __future__ import annotations

import subprocess
import sys

import pytest

from auditor.testing.wait import wait_until
from auditor.testing.world import spawn_world
from framework_stub import advantage_step

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("stub", ["full", "groups"])
def test_a_stubbed_mpu_run_is_judged_never_green_by_default(live_server, run_id, stub):
    runs = {f"{run_id}-buggy": False, f"{run_id}-fixed": True}
    out = spawn_world(advantage_step, 2, (live_server.url, list(runs.items()), stub), timeout=120)
    for run, with_cp in runs.items():
        _check_run(live_server, run, stub, with_cp, [out[0][run], out[1][run]])


def _check_run(live_server, run_id, stub, with_cp, out):
    # the framework's own whitening, unchanged by the hook: seq0's first token per CP rank
    assert out[0][0] == (1.439168 if with_cp else 1.707037) and out[1][0] == (1.439168 if with_cp else 1.273883)
    rep = wait_until(lambda: (r := live_server.get(f"/v1/runs/{run_id}/report").json()).get("status")
                     not in (None, "pending") and r, what="the step's verdict")
    (st,) = rep["statistics"]
    if stub == "full":  # cp=2 and the dp group stated: a known layout
        assert rep["topology_source"] == "megatron.core.mpu accessors (dp=1, cp=2; tp, pp = 1: the stated sizes fill the world)"
        assert rep["sizes"] == {"dp": 1, "cp": 2, "tp": 1, "pp": 1}
    else:  # dp=1 stated, cp not: partial, judged from what the values prove
        assert rep["topology"] == "unknown" and rep["topology_source"].startswith("megatron.core.mpu (partial: dp=1")
    check = subprocess.run([sys.executable, "-m", "auditor", "check", run_id, "--url", live_server.url],
                           capture_output=True, text=True, timeout=120)
    page = live_server.get(f"/runs/{run_id}").text
    if with_cp:
        assert (rep["status"], st["steps_consistent"], st["faults"]) == ("consistent", 1, {})
        assert check.returncode == 0 and check.stdout.startswith(f"{run_id}: consistent"), check.stdout
        assert 'id="run-verdict">consistent<' in page
        return
    assert rep["status"] == "inconsistent" and st["steps_inconsistent"] == 1
    assert {"group_mismatch", "wrong_group"} <= set(st["faults"]), st["faults"]
    if stub == "full":
        assert "cp_disagreement" in st["faults"]
    (step,) = st["bad_steps"]
    wrong = next(f for f in step["faults"] if f["kind"] == "wrong_group")
    assert "reduced local only" in wrong["message"] and wrong["ranks"] == [0, 1]
    assert check.returncode == 1 and check.stdout.startswith(f"{run_id}: INCONSISTENT"), check.stdout
    assert 'id="run-verdict">INCONSISTENT<' in page
