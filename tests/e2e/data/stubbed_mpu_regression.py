"""A framework's CPU regression test of advantage whitening, written as such tests are: no
Megatron, a stub ``megatron.core.mpu`` (tests/e2e/framework_stub.py), the trainer's own
whitening audited through ``import auditor.trainer.slime``, gloo ranks; run by
``pytest -p auditor.pytest_plugin`` (tests/e2e/test_pytest_plugin.py). The buggy group
fails the test with the diagnosis, the fixed one passes; a run whose values cannot settle
the group fails as UNVERIFIED unless the marker allows it."""

import json
import sys

import httpx
import pytest

sys.path.insert(0, "@E2E@")  # tests/e2e: framework_stub
from framework_stub import advantage_step  # noqa: E402

from auditor.testing.world import spawn_world  # noqa: E402


@pytest.mark.audited
@pytest.mark.parametrize("with_cp", [False, True], ids=["buggy", "fixed"])
def test_whitening(audited, with_cp):
    spawn_world(advantage_step, 2, (audited.url, [(f"stub-{'fixed' if with_cp else 'buggy'}", with_cp)], "full"),
                timeout=120)


BLIND = [{"run_id": "stub-blind", "statistic": "tokens", "step": 0, "rank": r, "world_size": 2,
          "topology": "unknown", "kind": "sum", "local": {"sum": 2.0}, "applied": {"sum": 4.0},
          "group_ranks": [0, 1]} for r in range(2)]


@pytest.mark.audited
def test_blind(audited):
    assert httpx.post(audited.url + "/v1/reports", json={"reports": BLIND}).status_code == 200


@pytest.mark.audited(allow_unverified=True)
def test_blind_allowed(audited):
    reports = [dict(r, run_id="stub-blind-allowed") for r in BLIND]
    assert httpx.post(audited.url + "/v1/reports", json={"reports": json.loads(json.dumps(reports))}).status_code == 200
