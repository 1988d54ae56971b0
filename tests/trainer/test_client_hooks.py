"""wrap_distributed_whiten on real gloo ranks: a trainer's own whitening function, audited
without changing its code, reports what its all-reduce returned and the group it used."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

from auditor.server import free_port

pytestmark = pytest.mark.multiprocess

TESTS = str(Path(__file__).parents[1])  # factory.py


def _worker(rank: int, port: int, spool: str, run_id: str, variant: str) -> None:
    sys.path.insert(0, TESTS)
    import torch
    import torch.distributed as dist

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.wrap import set_step, wrap_distributed_whiten
    from auditor.trainer.hooks import distributed_masked_whiten as slime_whiten
    from factory import ADVANTAGES, REFERENCE_TOKENS

    os.environ["AUDITOR_TOPOLOGY"] = "cp=2"  # no Megatron here: the two ranks are the CP slices of one sequence
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
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
    Path(spool, f"ok{rank}").write_text(json.dumps(results))


def _run(tmp_path, run_id, variant):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), run_id, variant)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for r in range(2):
        assert json.loads((tmp_path / f"ok{r}").read_text()) == {"0": True, "1": True}  # output unchanged
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
