"""A ``fingerprint`` statistic is ``unverified`` when a replica group holds one rank (a
world of one, a dim of size 1): its line said "audited without a known layout ... To check
it: AUDITOR_TOPOLOGY=dp=4,cp=2", advice that cannot make such a run verifiable. The line
names the fingerprint statistics and the reason (no replica to compare with) apart from
the layout advice of the reduction kinds, which stays as it was for them."""

from __future__ import annotations

from auditor import status


def _stat(name: str, kind: str, unverified: int, audited: int) -> dict:
    return {"statistic": name, "kind": kind, "steps_unverified": unverified, "steps_audited": audited}


def test_fingerprint_only_names_the_single_replica_not_the_layout():
    report = {"run_id": "wr1", "topology_source": "a single rank",
              "statistics": [_stat("params/0.weight:4", "fingerprint", 3, 3), _stat("grads/0.weight:4", "fingerprint", 3, 3)]}
    line = status.unverified_line(report)
    assert line == ("6 step(s) of fingerprint statistics (params/0.weight:4 3 of 3, grads/0.weight:4 3 of 3) "
                    "audited with a replica group of one rank: the tensor had no replica to compare it with, so "
                    "its drift was not checked (a world of one, or replica dims of size 1)")
    assert "To check it" not in line and "AUDITOR_TOPOLOGY" not in line


def test_mixed_kinds_keep_the_layout_advice_after_the_fingerprint_part():
    report = {"run_id": "r", "topology_source": None,
              "statistics": [_stat("adv", "moments", 2, 4), _stat("w", "fingerprint", 1, 1)]}
    line = status.unverified_line(report)
    assert line.startswith("1 step(s) of fingerprint statistics (w 1 of 1) audited with a replica group of one rank")
    assert "; 2 step(s) audited without a known layout (adv 2 of 4): no fault found" in line
    assert line.split(". To check it:")[1].startswith(" Megatron-core")


def test_reduction_kinds_alone_are_unchanged():
    report = {"run_id": "r", "statistics": [_stat("adv", "moments", 1, 1)]}
    assert status.unverified_line(report).startswith("1 step(s) audited without a known layout (adv 1 of 1): no fault")
