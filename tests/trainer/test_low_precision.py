"""bfloat16/float16 values through the hooks on real gloo ranks: the statistics are formed
and all-reduced in float32 whatever the values' dtype, and the report says so.

The new-user repro: ``distributed_masked_whiten(x.bfloat16(), ones)`` over a gloo world of
two ranks formed Σv and Σv² in bfloat16 before the float32 all-reduce and reported
``dtype: float32``; the correct whitening was flagged ``group_mismatch`` (error 0.0013 σ
against a float32 tolerance of 5.4e-6). Now the step is consistent, the applied sums are
the float32 sums of the values, and the reference bug (each CP rank reducing alone) is
still caught with the reference numbers.
"""

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


def _worker(rank: int, world: int, port: int, spool: str, dtype_name: str) -> dict:
    sys.path.insert(0, TESTS)
    import torch
    import torch.distributed as dist

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import distributed_masked_whiten
    from auditor.trainer.wrap import set_step, wrap_distributed_whiten
    from factory import ADVANTAGES, REFERENCE_TOKENS

    os.environ["AUDITOR_TOPOLOGY"] = "cp=2"  # the two ranks are the CP slices of one batch
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dt = getattr(torch, dtype_name)
    client = AuditorClient(f"file://{spool}", rank=rank)
    out: dict = {}

    # correct whitening of 1,000 low-precision values per rank over the whole group
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 2 + 0.3).to(dt)
    w = distributed_masked_whiten(x, torch.ones(1000), client=client, run_id="ok", step=0)
    out["ok"] = {"out_dtype": str(w.dtype), "local_sum32": float(x.float().sum()),
                 "local_sum_sq32": float((x.float() ** 2).sum())}

    # the reference bug in low precision (the advantages are exact in bfloat16/float16):
    # step 0 reduced over each rank alone, step 1 over the group
    ref = torch.tensor([a for a, n in zip(ADVANTAGES, REFERENCE_TOKENS[rank]) for _ in range(n)], dtype=dt)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    for step, group in ((0, alone), (1, None)):
        distributed_masked_whiten(ref, torch.ones_like(ref), process_group=group, client=client, run_id="bug",
                                  step=step)

    # a trainer's own function that forms its sums in the values' dtype (slime's, given
    # bfloat16 values), audited through the wrapper: reported in that precision
    def own(v, m, process_group=None, shift_mean=True, epsilon=1e-8):
        s = torch.tensor([(v * m).sum(), (v * v * m).sum(), m.sum()], dtype=torch.float32)
        dist.all_reduce(s, group=process_group)
        mean = s[0] / s[2]
        var = (s[1] / s[2] - mean**2) * s[2] / (s[2] - 1)
        return (v - mean) * torch.rsqrt(var + epsilon)

    set_step(0)
    wrap_distributed_whiten(own, client=client, run_id="wrap")(x[:100], torch.ones(100, dtype=dt))
    # the new-user trial: 1,000 values per rank, 2 ranks (every such step was precision_loss)
    set_step(0)
    wrap_distributed_whiten(own, client=client, run_id="wrap1k")(x, torch.ones(1000, dtype=dt))
    client.close()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_low_precision_values_are_reduced_in_float32_and_audited(tmp_path, dtype_name):
    results = spawn_world(_worker, 2, (str(tmp_path), dtype_name), TIMEOUT)
    lines = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    by = {(x["run_id"], x["step"], x["rank"]): x for x in lines}

    # the hook: float32 statistics, reported as such; the sums are the float32 sums of the values
    for rank in (0, 1):
        rep = by[("ok", 0, rank)]
        assert rep["dtype"] == "float32" and results[rank]["ok"]["out_dtype"] == f"torch.{dtype_name}"
        assert rep["applied"]["count"] == 2000.0
    total = sum(r["ok"]["local_sum32"] for r in results)
    total_sq = sum(r["ok"]["local_sum_sq32"] for r in results)
    assert by[("ok", 0, 0)]["applied"]["sum"] == pytest.approx(total, rel=1e-6)
    assert by[("ok", 0, 0)]["applied"]["sum_sq"] == pytest.approx(total_sq, rel=1e-6)
    assert by[("ok", 0, 0)]["applied"]["sum"] == pytest.approx(by[("ok", 0, 0)]["local"]["sum"]
                                                               + by[("ok", 0, 1)]["local"]["sum"], rel=1e-6)
    # the wrapped function formed its sums in the values' dtype: reported in it
    assert {by[("wrap", 0, r)]["dtype"] for r in (0, 1)} == {dtype_name}

    from auditor.offline import audit_offline

    reports, counts = audit_offline([tmp_path])
    assert counts["invalid"] == counts["conflicting"] == 0
    stats = {r["run_id"]: r["statistics"][0] for r in reports}
    ok, bug, wrap = stats["ok"], stats["bug"], stats["wrap"]
    assert (ok["steps_consistent"], ok["steps_inconsistent"], ok["faults"]) == (1, 0, {}), ok
    assert ok["applied_error_sigma"] < 1e-5
    assert (wrap["steps_consistent"], wrap["steps_inconsistent"]) == (1, 0), wrap
    wrap1k = stats["wrap1k"]
    assert (wrap1k["steps_consistent"], wrap1k["steps_inconsistent"], wrap1k["faults"]) == (1, 0, {}), wrap1k
    assert {by[("wrap1k", 0, r)]["dtype"] for r in (0, 1)} == {dtype_name}
    # the reference bug, in low precision: caught with the float32 reference numbers
    assert (bug["steps_consistent"], bug["steps_inconsistent"]) == (1, 1), bug
    (bad,) = bug["bad_steps"]
    assert bad["step"] == 0
    assert {"cp_disagreement", "group_mismatch", "wrong_group"} <= {f["kind"] for f in bad["faults"]}
    assert (bug["worst_cp_disagreement_step"], bug["worst_applied_error_step"]) == (0, 0)
    assert bug["worst_cp_disagreement_sigma"] == pytest.approx(0.433154, abs=1e-6)
    assert bug["worst_applied_error_sigma"] == pytest.approx(0.267869, abs=1e-6)
