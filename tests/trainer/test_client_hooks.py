"""wrap_distributed_whiten on real gloo ranks: a trainer's own whitening function, audited
without changing its code, reports what its all-reduce returned and the group it used."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from auditor.testing.world import spawn_world

pytestmark = pytest.mark.multiprocess

TESTS = str(Path(__file__).parents[1])  # factory.py
TIMEOUT = 120.0


def _worker(rank: int, world: int, port: int, spool: str, run_id: str, variant: str) -> dict:
    sys.path.insert(0, TESTS)
    import torch
    import torch.distributed as dist

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.wrap import set_step, wrap_distributed_whiten
    from auditor.trainer.hooks import distributed_masked_whiten as slime_whiten
    from factory import ADVANTAGES, REFERENCE_TOKENS

    os.environ["AUDITOR_TOPOLOGY"] = "cp=2"  # no Megatron here: the two ranks are the CP slices of one sequence
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    own = [dist.new_group([0]), dist.new_group([1])][rank]  # slime's bug: a group without the CP peer
    values = torch.tensor([a for a, n in zip(ADVANTAGES, REFERENCE_TOKENS[rank]) for _ in range(n)] + [9.0])
    mask = torch.ones_like(values)
    mask[-1] = 0  # a masked-out value must not count

    if variant == "bound":  # reaches all_reduce through a name bound before the wrapper: unobservable
        from torch.distributed import all_reduce as bound_all_reduce

        def fn(v, m, process_group=None, shift_mean=True, epsilon=1e-8):
            s = torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()]).float()
            bound_all_reduce(s, group=process_group)
            mean = s[0] / s[2]
            var = (s[1] / s[2] - mean**2) * s[2] / (s[2] - 1)
            return (v - mean) * torch.rsqrt(var + epsilon)
    else:
        fn = slime_whiten

    client = AuditorClient(f"file://{spool}", rank=rank)
    audited = wrap_distributed_whiten(fn, client=client, run_id=run_id)
    results = {}
    for step, group in ((0, own), (1, None)):  # step 0 buggy, step 1 over WORLD (correct)
        set_step(step)
        out = audited(values, mask, process_group=group)
        results[step] = torch.equal(out, fn(values, mask, process_group=group))
    client.close()
    dist.destroy_process_group()
    return results


def _run(tmp_path, run_id, variant):
    unchanged = spawn_world(_worker, 2, (str(tmp_path), run_id, variant), TIMEOUT)
    assert unchanged == [{0: True, 1: True}] * 2  # each rank's output, both steps, bit-identical
    return {(x["step"], x["rank"]): x for f in tmp_path.glob("*.jsonl") for x in map(json.loads, f.read_text().splitlines())}


@pytest.mark.parametrize("variant", ["observed", "bound"])
def test_wrapped_whiten_reports_what_was_applied(tmp_path, variant):
    """Two gloo ranks holding the reference case's CP slices whiten through the audited
    wrapper over their own group (step 0, the bug) and over WORLD (step 1). The wrapped
    function's output is bit-identical to the unwrapped one; each report's local moments are
    the rank's masked data; applied count/sum/sum_sq are what the reduction returned, the
    applied mean equals the reference numbers to 1e-6 (−0.076923 / +0.235294 buggy, +0.1
    fixed), and group_ranks names the group actually used ([rank] vs [0, 1]) — also when
    the function's all_reduce cannot be observed and the wrapper re-reduces ("bound")."""
    from factory import local_moments

    reports = _run(tmp_path, "hooks-run", variant)
    assert sorted(reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (step, rank), rep in reports.items():
        loc = local_moments(rank)
        assert rep["local"]["count"] == loc["count"] and rep["local"]["sum"] == pytest.approx(loc["sum"])
        assert rep["local"]["max"] == 1.5  # the masked-out 9.0 is excluded
        if step == 0:
            expected_mean = [-0.076923, 0.235294][rank]
            assert rep["applied"]["count"] == loc["count"]
            if variant == "observed":
                assert rep["group_ranks"] == [rank]
        else:
            expected_mean = 0.1
            assert rep["applied"]["count"] == 150.0 and rep["group_ranks"] == [0, 1]
        assert rep["applied"]["mean"] == pytest.approx(expected_mean, abs=1e-6)
        assert rep["applied"]["var"] > 0


def test_offline_audit_of_wrapped_reports_flags_only_the_buggy_step(tmp_path):
    """The spools written through the wrapper (topology from AUDITOR_TOPOLOGY=cp=2: the
    reports carry cp coordinates and Megatron's default order), audited offline: step 0
    (reduced over each rank alone) is inconsistent with group_mismatch and cp_disagreement,
    step 1 (over WORLD) is consistent."""
    _run(tmp_path, "hooks-audit", "observed")
    from auditor.offline import audit_offline

    (report,), counts = audit_offline([tmp_path])
    (stat,) = report["statistics"]
    assert counts["invalid"] == counts["conflicting"] == 0
    assert (stat["steps_consistent"], stat["steps_inconsistent"]) == (1, 1)
    (bad,) = stat["bad_steps"]
    assert bad["step"] == 0 and {"group_mismatch", "cp_disagreement"} <= {f["kind"] for f in bad["faults"]}


# ------------------------------------------------------------------ weighted masks
def _weighted_worker(rank: int, world: int, port: int, url: str, spool: str, run_id: str) -> dict:
    import torch
    import torch.distributed as dist

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import distributed_masked_whiten

    os.environ["AUDITOR_TOPOLOGY"] = "dp=2"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # rank 0: the wire contract's example (max 3, sum_sq 4.5 < 3²); rank 1: weights summing to 2
    values = [torch.tensor([3.0, 0.0]), torch.tensor([1.0, 2.0, -1.0, 7.0])][rank]
    mask = [torch.tensor([0.5, 0.5]), torch.tensor([0.25, 1.0, 0.75, 0.0])][rank]
    client = AuditorClient(url, rank=rank, spool_dir=spool)
    distributed_masked_whiten(values, mask, client=client, run_id=run_id, step=0)
    delivered = client.flush(timeout=60)
    stats = dict(client.stats)
    client.close()
    dist.destroy_process_group()
    return {"delivered": delivered, "stats": stats}


def test_weighted_mask_reports_from_a_gloo_world_are_accepted_and_consistent(live_server, run_id, tmp_path):
    """Two gloo ranks whiten with weighted (floating, non-0/1) masks over WORLD: the hooks
    mark their local blocks ``weighted``, the service accepts both reports although rank 0's
    max² (9) is above its sum_sq (4.5), nothing is dead-lettered, and the step is audited
    consistent with the weighted global count 1 + 2 = 3, mean 1.000000, std 1.802776."""
    results = spawn_world(_weighted_worker, 2, (live_server.url, str(tmp_path), run_id), TIMEOUT)
    assert all(r["delivered"] and r["stats"]["rejected"] == 0 for r in results), results
    assert not list(tmp_path.rglob("*dead*")), list(tmp_path.rglob("*"))
    (stat,) = live_server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert (stat["steps_consistent"], stat["steps_inconsistent"]) == (1, 0), stat
    step = live_server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").json()
    assert (step["verdict"], step["reports"], step["expected"], step["faults"]) == ("consistent", 2, 2, []), step
    # global: count 3, sum 1.5 + 0.25 + 2 − 0.75 = 3, sum_sq 4.5 + 0.25 + 4 + 0.75 = 9.5 →
    # mean 1.000000, sample std √((9.5/3 − 1)·3/2) = 1.802776; rank 0's local mean 1.5, rank 1's 0.75
    rows = {r["rank"]: r for r in step["ranks"]}
    assert (rows[0]["local_count"], rows[1]["local_count"]) == (1.0, 2.0)
    assert (round(rows[0]["local_mean"], 6), round(rows[1]["local_mean"], 6)) == (1.5, 0.75)
    for r in rows.values():
        assert round(r["correct_mean"], 6) == round(r["applied_mean"], 6) == 1.0
        assert round(r["correct_std"], 6) == round(r["applied_std"], 6) == 1.802776
        assert r["error_sigma"] == pytest.approx(0.0, abs=1e-6) and r["faults"] == []
