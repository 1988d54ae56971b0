"""``auditor.watch_replicas`` on one real gloo rank (issue 27): the buckets it plans and
their bounds, the reports it spools (values equal to ``fingerprint`` of the tensors, bit for
bit), the optimizer hooks' timing, ``every``, DTensor placements, and what it refuses. The
multi-rank verdicts are in tests/e2e/test_replica_worlds.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from auditor import set_step, set_topology, watch_replicas
from auditor.testing import no_host_sync
from auditor.trainer import fingerprint as fpmod
from auditor.trainer import topology, wrap
from auditor.trainer.client import AuditorClient
from auditor.trainer.fingerprint import fingerprint


@pytest.fixture
def world1():
    """A real one-process gloo world (WORLD = [0]) with the topology dp=1."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    set_topology(dp=1)
    yield
    topology.clear()
    wrap.reset()
    dist.destroy_process_group()


class Params(torch.nn.Module):
    def __init__(self, sizes, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.p = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes])


def test_buckets_are_packed_in_order_and_bounded(world1):
    """Ten tensors of 3,000: a target of 7,500 gives five buckets (> 4), doubled to 15,000:
    two of five, named by their first member and count; with the defaults (buckets of at
    least 2^16 elements) a tensor that fills a bucket keeps its own name."""
    model = Params([3000] * 10)
    w = watch_replicas(model, max_reports=4, min_bucket=1)
    assert [(b.name, b.members, b.numel) for b in w.buckets] == [
        ("p.0:5", tuple(f"p.{i}" for i in range(5)), 15000), ("p.5:5", tuple(f"p.{i}" for i in range(5, 10)), 15000)]
    assert w.buckets[0].spec == {"replicate_over": ["dp"], "agreement": "rounding", "k": 8, "seed": 0}
    w = watch_replicas(Params([10] * 300 + [70000, 5]))
    assert [(b.name, len(b.members)) for b in w.buckets] == [("p.0:300", 300), ("p.300", 1), ("p.301", 1)]
    w = watch_replicas(Params([10] * 300), max_reports=1, exact=True)
    assert [(b.name, b.spec["agreement"]) for b in w.buckets] == [("p.0:300", "bitwise")]


def test_reports_hold_the_fingerprints_and_no_host_sync(world1, tmp_path):
    """Hooked on the optimizer with every=2 over 5 steps: reports at steps 0, 2, 4 for params
    and grads of each bucket; the gradients' fingerprints are those before the step, the
    parameters' those after it (bit for bit); ``optimizer.step()`` reads no tensor value."""
    model = Params([40, 7], torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    client = AuditorClient(f"file://{tmp_path}", rank=0)
    w = watch_replicas(model, client, every=2, optimizer=opt, run_id="hooks", exact=True, min_bucket=1)
    expect = {}
    for step in range(5):
        set_step(step)
        model.p[0].grad = torch.full((40,), 0.5 + step, dtype=torch.bfloat16)
        model.p[1].grad = torch.linspace(-1, 1, 7, dtype=torch.bfloat16)
        expect[("grads", step)] = [fingerprint(p.grad, exact=True).tolist() for p in model.p]
        with no_host_sync():
            opt.step()
        expect[("params", step)] = [fingerprint(p.detach(), exact=True).tolist() for p in model.p]
    w.close()
    client.close()
    (spooled,) = Path(tmp_path).glob("*.jsonl")
    reports = [json.loads(line) for line in spooled.read_text().splitlines()]
    assert [(r["statistic"], r["step"]) for r in reports] == [
        (f"{what}/p.{i}", s) for s in (0, 2, 4) for what in ("grads", "params") for i in (0, 1)]
    for r in reports:
        what, name = r["statistic"].split("/")
        assert r["local"]["fingerprint"] == expect[(what, r["step"])][int(name[2:])]
        assert (r["kind"], r["dtype"], r["run_id"], r["rank"], r["world_size"]) == (
            "fingerprint", "bfloat16", "hooks", 0, 1)
        assert r["spec"] == {"replicate_over": ["dp"], "agreement": "bitwise", "k": 8, "seed": 0}
        assert "applied" not in r and r["host"] and r["num_microbatches"] == 1
    assert client.stats["dropped"] == 0


def test_step_without_optimizer_and_main_grad(world1, tmp_path):
    """Without ``optimizer=`` ``step()`` reports both; Megatron's ``main_grad`` is read in
    place of ``.grad``; a parameter without a gradient is left out of its bucket's report."""
    model = Params([6, 5])
    model.p[0].main_grad = torch.arange(6.0)
    client = AuditorClient(f"file://{tmp_path}", rank=0)
    w = watch_replicas(model, client, run_id="main-grad", min_bucket=1, max_reports=1)
    w.step()
    client.close()
    (spooled,) = Path(tmp_path).glob("*.jsonl")
    grads, params = (json.loads(line) for line in spooled.read_text().splitlines())
    assert grads["statistic"] == "grads/p.0:2" and grads["local"]["fingerprint"] == fingerprint(
        torch.arange(6.0)).tolist()
    assert params["local"]["fingerprint"] == fingerprint([p.detach() for p in model.p]).tolist()


def test_dtensor_replicated_dims_give_replica_groups(world1):
    """A DTensor parameter replicated on a one-rank mesh: replica_groups [[0]]; sharded
    along every mesh dim: not reported."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    model = torch.nn.Module()
    model.rep = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    model.shard = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    w = watch_replicas(model, min_bucket=1)
    assert [(b.name, b.spec["replica_groups"]) for b in w.buckets] == [("rep", [[0]])]


def test_tied_entries_and_bad_arguments_are_refused(world1):
    """Each mistake raises ValueError naming it."""
    model = Params([4])
    w = watch_replicas(model, tied={"emb": {"param": "p.0", "ranks": [[0]]}})
    assert [(b.name, b.spec["replica_groups"]) for b in w.buckets] == [("tied:emb", [[0]])]
    with pytest.raises(ValueError, match=r"tied\['p.9'\]: this rank \(0\) has no parameter 'p.9'"):
        watch_replicas(model, tied={"p.9": [0, 1]})
    with pytest.raises(ValueError, match="rank 0 holds 'p.0' but is in none of its groups"):
        watch_replicas(model, tied={"p.0": [1, 2]})
    for kw, msg in (({"what": ("weights",)}, "what must be"), ({"every": 0}, "every"),
                    ({"k": 12, "exact": True}, "17 values, more than a ring slot's 16"),
                    ({"agreement": "bitwise"}, "needs exact=True")):
        with pytest.raises(ValueError, match=msg):
            watch_replicas(model, **kw)


def test_fingerprint_cache_is_bounded():
    """The cached sign blocks and multipliers stay within CACHE_MAX entries over many seeds,
    and an evicted block is rebuilt identical."""
    x = torch.linspace(-1, 1, 1000)
    first = fingerprint(x, seed=1, exact=True)
    for seed in range(2, 3 + fpmod.CACHE_MAX // 2):  # two entries per seed with digests
        fingerprint(x, seed=seed, exact=True)
    assert len(fpmod._CACHE) <= fpmod.CACHE_MAX
    assert torch.equal(fingerprint(x, seed=1, exact=True), first)
