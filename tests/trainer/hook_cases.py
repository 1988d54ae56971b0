"""Fixed inputs through every hook on one rank of a gloo world, and the wire dicts they
produce (issue 24): ``hook_reports.json`` holds what the hooks sent before the reports
were resolved on the sender thread; ``test_hook_syncs.py`` checks that they still send
exactly that, bit for bit, and add no host sync.

    PYTHONPATH=. python tests/trainer/hook_cases.py   # rewrite hook_reports.json (2 gloo ranks)

The file is the reference of the code before issue 24 (commit cf97c12, where the hooks read
every value on the training thread): rewrite it only for an intended change of the wire
dicts, and say so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
FIXTURE = HERE / "hook_reports.json"


def cases(rank: int, client, counted=None) -> list[str]:
    """Run every hook on fixed inputs (this rank's share), reporting to ``client``; returns
    the case names in report order. ``counted(name, call)`` wraps each call (default: run it)."""
    import torch
    import torch.distributed as dist

    from auditor.trainer.hooks import audited_norm_sq, audited_sum, distributed_masked_whiten, report_statistic
    from auditor.trainer.wrap import set_step, wrap_distributed_whiten

    counted = counted or (lambda name, call: call())
    g = torch.Generator().manual_seed(24 + rank)
    x = torch.randn(4096, generator=g) * 1.7 + 0.3
    bool_mask = torch.rand(4096, generator=g) > 0.25
    weights = torch.rand(4096, generator=g).round(decimals=2)
    names: list[str] = []

    def run(name, call):
        names.append(name)
        return counted(name, call)

    kw = {"client": client, "run_id": "issue24"}
    run("whiten-f32", lambda: distributed_masked_whiten(x, bool_mask, step=0, **kw))
    run("whiten-f32-float-mask", lambda: distributed_masked_whiten(x, bool_mask.float(), step=1, **kw))
    run("whiten-weighted", lambda: distributed_masked_whiten(x, weights, step=2, shift_mean=False, **kw))
    run("whiten-bf16", lambda: distributed_masked_whiten(x.bfloat16(), bool_mask, step=3, **kw))
    run("whiten-f64-2d", lambda: distributed_masked_whiten(x.double().reshape(64, 64), bool_mask.reshape(64, 64),
                                                            step=4, **kw))
    empty_here = bool_mask & (rank == 0)  # rank 1 holds no masked value: no min/max
    run("whiten-empty-on-rank1", lambda: distributed_masked_whiten(x, empty_here, step=5, **kw))

    def empty_everywhere():
        try:
            distributed_masked_whiten(x, torch.zeros(4096), step=6, **kw)
        except ValueError:  # slime's error for a group without a masked value, after the report
            return
        raise AssertionError("no ValueError for an empty group")

    run("whiten-empty-everywhere", empty_everywhere)

    def slime_own(v, m, process_group=None, shift_mean=True, epsilon=1e-8):  # slime's code, sums in v's dtype
        s = torch.tensor([(v * m).sum(), (v * v * m).sum(), m.sum()], device=v.device, dtype=torch.float32)
        dist.all_reduce(s, group=process_group)
        mean = s[0] / s[2]
        var = s[1] / s[2] - mean**2
        if s[2].item() >= 2:
            var = var * s[2] / (s[2] - 1)
        out = (v - mean) * torch.rsqrt(var + epsilon)
        return out if shift_mean else out + mean

    def bound_own(v, m, process_group=None, shift_mean=True, epsilon=1e-8):  # all_reduce unobservable
        s = torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()]).float()
        torch.distributed.distributed_c10d.all_reduce(s, group=process_group)
        mean = s[0] / s[2]
        var = (s[1] / s[2] - mean**2) * s[2] / (s[2] - 1)
        return (v - mean) * torch.rsqrt(var + epsilon)

    wrapped = wrap_distributed_whiten(slime_own, **kw)
    set_step(10)
    run("wrap-slime-f32", lambda: wrapped(x, bool_mask.float()))
    set_step(11)
    run("wrap-slime-no-shift", lambda: wrapped(x, bool_mask.float(), shift_mean=False))
    set_step(12)
    run("wrap-slime-bf16", lambda: wrapped(x.bfloat16(), bool_mask.bfloat16()))
    set_step(13)
    run("wrap-slime-weighted", lambda: wrapped(x, weights))
    set_step(14)
    run("wrap-auditor-own", lambda: wrap_distributed_whiten(distributed_masked_whiten, dtype="float32", **kw)(
        x, bool_mask))
    set_step(15)
    run("wrap-bound-fallback", lambda: wrap_distributed_whiten(bound_own, **kw)(x, bool_mask.float()))
    set_step(16)
    run("wrap-bound-no-fallback", lambda: wrap_distributed_whiten(bound_own, reduce_fallback=False, **kw)(
        x, bool_mask.float()))
    set_step(17)
    run("wrap-one-value", lambda: wrapped(torch.full((8,), 2.5), torch.ones(8)))

    counts = torch.tensor([120.0 + rank, 80.5]) / 3
    run("sum-float", lambda: audited_sum(1234.0 + rank, step=20, **kw))
    run("sum-tensor", lambda: audited_sum(counts[0], step=21, **kw))
    run("sum-microbatches", lambda: audited_sum([counts[0], 7, counts[1], 0.1], step=22, **kw))
    run("sum-f64", lambda: audited_sum(counts[1].double(), step=23, dtype=torch.float64, **kw))
    run("sum-bf16", lambda: audited_sum([counts[0].bfloat16(), counts[1]], step=24, dtype=torch.bfloat16, **kw))
    gsq = (torch.randn(1000, generator=g) ** 2).sum()
    run("norm-tensor", lambda: audited_norm_sq(gsq, 0.125, step=30, **kw))
    gsq_float = float(gsq)
    run("norm-float", lambda: audited_norm_sq(gsq_float, step=31, **kw))
    run("norm-replicated-along", lambda: audited_norm_sq(gsq, torch.tensor(3.25), step=32,
                                                         replicated_along=["tp"], **kw))
    run("norm-f64", lambda: audited_norm_sq(gsq.double() / 7, 1 / 3, step=33, dtype=torch.float64, **kw))
    if client is None:  # nothing to compare with: a report is all it does
        return names
    run("report-statistic", lambda: report_statistic(
        client, run_id="issue24", statistic="custom", step=40, kind="sum", local={"sum": 1.0 + rank},
        applied={"sum": 3.0}, process_group=None))
    return names


def _worker(rank: int, world: int, port: int, spool: str) -> dict:
    import os

    import torch.distributed as dist

    from auditor.testing import count_host_syncs
    from auditor.trainer.client import AuditorClient

    os.environ["AUDITOR_TOPOLOGY"] = "dp=2"
    os.environ.pop("AUDITOR_URL", None)  # the wrapper without a client: the bare function
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    syncs: dict[str, list[int]] = {}

    def counted(name, call):
        with count_host_syncs() as seen:
            call()
        syncs.setdefault(name, []).append(seen.count)

    cases(rank, None, counted)  # no client: what the calls cost without the auditor
    client = AuditorClient(f"file://{spool}/{rank}", rank=rank)
    cases(rank, client, counted)
    client.close()
    dist.destroy_process_group()
    (spooled,) = Path(f"{spool}/{rank}").glob("*.jsonl")
    reports = [json.loads(line) for line in spooled.read_text().splitlines()]
    return {"reports": reports, "syncs": syncs, "stats": client.stats}


def run_world(spool: str) -> list[dict]:
    """:func:`cases` on two gloo ranks, per rank: ``reports`` (the wire dicts, in the order
    they were made), ``syncs`` (case name → [host syncs without a client, with one]) and
    the client's ``stats``."""
    from auditor.testing.world import spawn_world

    return spawn_world(_worker, 2, (spool,), 120.0)


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(HERE.parents[1]))
    FIXTURE.write_text(json.dumps([r["reports"] for r in run_world(tempfile.mkdtemp())], indent=1) + "\n")
    print(f"wrote {FIXTURE}")
