"""Workers of the replica drift worlds (tests/e2e/test_replica_worlds.py, issue 27): four real
gloo ranks with real Megatron-core process groups train small models, watched by
:func:`auditor.watch_replicas`, each scenario a run ``{prefix}-{name}`` spooled per rank.

The model is a faithful small tensor-parallel block (Megatron's layers need CUDA): a
sequence-parallel LayerNorm (weights marked ``sequence_parallel`` as Megatron does), an
all-gather of the sequence over tp, a column-parallel and a row-parallel linear (marked
with Megatron's ``set_tensor_model_parallel_attributes``), a reduce-scatter back to the
sequence shard, a final sequence-parallel LayerNorm. After backward, as Megatron's
``finalize_model_grads``: the gradients of the ``sequence_parallel`` parameters are
all-reduced over tp, then every gradient averaged over dp.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

#: Scenarios and what each injects (the test asserts the verdict of each).
SCENARIOS = {
    "tp-correct": "tp=2 × dp=2, sequence-parallel LayerNorms, 50 steps, every reduction in place",
    "tp-ln-missing": "tp=2 × dp=2, the final LayerNorm's gradient TP all-reduce omitted",
    "ddp-left-out": "tp=2 × dp=2 under torch DDP over the dp group, linear_fc2.weight left out of its sync",
    "flip-two": "tp=2 × dp=2, one bit of rank 3's linear_fc1.weight flipped at step 20 (groups of 2 along dp)",
    "flip-four": "tp=1 × dp=4, one bit of rank 2's linear_fc1.weight flipped at step 20",
    "bf16": "tp=1 × dp=4 in bfloat16, each rank adds the dp gradient parts in its own order (rounding only)",
    "tied-correct": "pp=2 × dp=2, embedding tied to the output layer, all-reduced over the embedding group",
    "tied-one-stage": "pp=2 × dp=2, the embedding-group all-reduce skipped: each stage updates its own copy",
    "tp-ln-missing-live": "tp-ln-missing again, the ranks' clients sending to a live `auditor serve`",
    "hsdp": "2×2 DeviceMesh (dp_replicate, dp_shard), DTensors [Replicate(), Shard(0)] and replicated; "
            "rank 3's shard changed at step 1",
}
H, F, S, V = 16, 32, 8, 24
FLIP_STEP = 20
#: Steps whose optimizer step and hooks run under ``count_host_syncs`` (it slows every op).
SYNC_STEPS = 3
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
FC2 = "decoder.layers.0.mlp.linear_fc2.weight"
FINAL_LN = "decoder.final_layernorm.weight"


def worker(rank: int, world: int, port: int, spool: str, prefix: str, timeout: float, url: str) -> dict:
    """Every scenario on this rank; returns {scenario: facts} (ground truth read outside the
    hooks: the first step each watched tensor really differed, host syncs of the hooks)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # four ranks on a small machine: intra-op threads would wait for each other
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    from megatron.core import parallel_state as ps

    out = {}
    for kw, names, run in (({"tensor_model_parallel_size": 2}, ("tp-correct", "tp-ln-missing", "ddp-left-out",
                                                                "flip-two", "tp-ln-missing-live"), _tp_run),
                           ({"tensor_model_parallel_size": 1}, ("flip-four", "bf16"), _tp_run),
                           ({"pipeline_model_parallel_size": 2}, ("tied-correct", "tied-one-stage"), _tied_run)):
        ps.initialize_model_parallel(**kw)
        for name in names:
            t0 = time.monotonic()
            out[name] = run(name, rank, url if name.endswith("-live") else f"file://{spool}/{prefix}-{name}/{rank}",
                            prefix)
            out[name]["seconds"] = time.monotonic() - t0
        ps.destroy_model_parallel()
    out["hsdp"] = _hsdp_run(rank, spool, prefix)
    dist.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- the TP block


def _seq_gather():
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    class Gather(torch.autograd.Function):
        """All-gather the sequence over tp; backward: reduce-scatter (all-reduce, keep my rows)."""

        @staticmethod
        def forward(ctx, x):
            g = ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, x.contiguous(), group=g)
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, grad):
            return _scatter_rows(grad)

    class Scatter(torch.autograd.Function):
        """Reduce-scatter the sequence over tp; backward: all-gather."""

        @staticmethod
        def forward(ctx, x):
            return _scatter_rows(x)

        @staticmethod
        def backward(ctx, grad):
            g = ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, grad.contiguous(), group=g)
            return torch.cat(parts)

    return Gather, Scatter


def _scatter_rows(x):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    g = ps.get_tensor_model_parallel_group()
    x = x.clone()
    dist.all_reduce(x, group=g)
    n = x.shape[0] // dist.get_world_size(g)
    r = dist.get_rank(g)
    return x[r * n:(r + 1) * n].contiguous()


def _block(dtype):
    """The TP block as a module whose parameter names are Megatron's (GPT decoder, one layer)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    class Block(torch.nn.Module):
        def forward(self, x_local):
            return _forward(self, x_local)

    tp = ps.get_tensor_model_parallel_world_size()
    gen = torch.Generator().manual_seed(1234 + ps.get_tensor_model_parallel_rank())  # shards differ along tp
    root = Block()
    dec = root.decoder = torch.nn.Module()
    layer = torch.nn.Module()
    dec.layers = torch.nn.ModuleList([layer])
    layer.input_layernorm = torch.nn.LayerNorm(H, dtype=dtype)
    layer.mlp = torch.nn.Module()
    layer.mlp.linear_fc1 = torch.nn.Module()
    layer.mlp.linear_fc2 = torch.nn.Module()
    layer.mlp.linear_fc1.weight = torch.nn.Parameter((torch.randn(F // tp, H, generator=gen) / H ** 0.5).to(dtype))
    layer.mlp.linear_fc2.weight = torch.nn.Parameter((torch.randn(H, F // tp, generator=gen) / F ** 0.5).to(dtype))
    dec.final_layernorm = torch.nn.LayerNorm(H, dtype=dtype)
    for ln in (layer.input_layernorm, dec.final_layernorm):
        with torch.no_grad():  # not the default ones: a drift shows in every field
            ln.weight.copy_(1.0 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(7)))
        for p in ln.parameters():
            p.sequence_parallel = True  # Megatron marks LayerNorm parameters so under sequence parallelism
    set_tensor_model_parallel_attributes(layer.mlp.linear_fc1.weight, True, 0, 1)
    set_tensor_model_parallel_attributes(layer.mlp.linear_fc2.weight, True, 1, 1)
    return root


def _forward(root, x_local):
    import torch

    gather, scatter = _seq_gather()
    layer, dec = root.decoder.layers[0], root.decoder
    h = gather.apply(layer.input_layernorm(x_local))
    a = torch.nn.functional.gelu(h @ layer.mlp.linear_fc1.weight.T)
    o = scatter.apply(a @ layer.mlp.linear_fc2.weight.T)
    return dec.final_layernorm(x_local + o)


def _tp_run(run: str, rank: int, dest: str, prefix: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from auditor import set_step, watch_replicas
    from auditor.testing import count_host_syncs
    from auditor.trainer.client import AuditorClient

    name = run.removesuffix("-live")  # the same scenario, sent to a live service
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    steps = 50 if name == "tp-correct" else 24 if name.startswith("flip") else 12
    root = _block(dtype)
    model = root
    if name == "ddp-left-out":
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(root, [FC2])
        model = DDP(root, process_group=ps.get_data_parallel_group())
    opt = torch.optim.SGD(root.parameters(), lr=0.05)
    client = AuditorClient(dest, rank=rank, flush_interval=0.05)
    hooked = name in ("tp-correct", "ddp-left-out")  # the optimizer hooks; the others call step()
    watch = watch_replicas(root, client, run_id=f"{prefix}-{run}", optimizer=opt if hooked else None,
                           exact=True, agreement="rounding" if name == "bf16" else None, min_bucket=1)
    tp, dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    first_differ: dict[str, int] = {}
    syncs = []
    for step in range(steps):
        set_step(step)
        gen = torch.Generator().manual_seed(100 * step + dp)  # the same batch on the tp ranks of a dp slice
        x = torch.randn(S, H, generator=gen).to(dtype)
        n = S // ps.get_tensor_model_parallel_world_size()
        out = model(x[tp * n:(tp + 1) * n])
        loss = (out.float() * torch.linspace(-1, 1, H)).square().mean()
        loss.backward()
        _finalize_grads(root, name)
        with count_host_syncs() if step < SYNC_STEPS else contextlib.nullcontext() as seen:
            opt.step()
            if not hooked:
                if name.startswith("flip") and step == FLIP_STEP and rank == (3 if name == "flip-two" else 2):
                    _flip_bit(root.decoder.layers[0].mlp.linear_fc1.weight)
                watch.step()
        if seen is not None:
            syncs.append(seen.count)
        opt.zero_grad()
        for pname in _differing(root):
            first_differ.setdefault(pname, step)
    watch.close()
    delivered = client.flush(60.0)
    client.close()
    return {"first_differ": first_differ, "syncs": syncs, "delivered": delivered, "stats": dict(client.stats),
            "buckets": [(b.name, b.members, b.spec) for b in watch.buckets], "steps": steps}


def _finalize_grads(root, name: str) -> None:
    """Megatron's ``finalize_model_grads`` for the block, each reduction on one flat buffer
    as Megatron's: the TP all-reduce of the ``sequence_parallel`` parameters' gradients (the
    final LayerNorm's skipped in ``tp-ln-missing``), then the DP average (by DDP in
    ``ddp-left-out``; bf16: each rank adds the gathered parts in its own order)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        _all_reduce([p.grad for n, p in root.named_parameters() if getattr(p, "sequence_parallel", False)
                     and not (name == "tp-ln-missing" and n.startswith("decoder.final_layernorm"))],
                    ps.get_tensor_model_parallel_group())
    if name == "ddp-left-out":
        return
    g, n = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    grads = [p.grad for p in root.parameters()]
    if name != "bf16":
        _all_reduce(grads, g, 1.0 / n)
        return
    flat = torch.cat([t.reshape(-1) for t in grads])
    parts = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(parts, flat, group=g)
    me = ps.get_data_parallel_rank()
    total = parts[me]
    for i in range(1, n):
        total = total + parts[(me + i) % n]  # bf16 additions in this rank's order
    _unflatten(total / n, grads)


def _all_reduce(tensors, group, scale: float = 1.0) -> None:
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    _unflatten(flat * scale if scale != 1.0 else flat, tensors)


def _unflatten(flat, tensors) -> None:
    i = 0
    for t in tensors:
        t.copy_(flat[i:i + t.numel()].view_as(t))
        i += t.numel()


def _flip_bit(p) -> None:
    import torch

    with torch.no_grad():
        bits = p.data.view(torch.int32)
        bits[3, 5] ^= 1 << 12  # a mantissa bit of one float32 element


def _differing(root) -> set[str]:
    """Which of FC1, FC2 and the final LayerNorm weight differ between their replicas
    (ground truth, outside the hooks; one all-gather): the shards over dp, the LayerNorm
    over every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    names = (FC1, FC2, FINAL_LN)
    flat = torch.cat([root.get_parameter(n).data.reshape(-1) for n in names])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
    out, i = set(), 0
    for n in names:
        m = root.get_parameter(n).numel()
        ranks = dp_ranks if n in (FC1, FC2) else range(len(parts))
        if not all(torch.equal(parts[ranks[0]][i:i + m], parts[r][i:i + m]) for r in ranks):
            out.add(n)
        i += m
    return out


# ----------------------------------------------------------------------------- tied embedding


def _tied_run(name: str, rank: int, dest: str, prefix: str) -> dict:
    """pp=2: stage 0 embeds tokens (``embedding.word_embeddings.weight``) and sends the
    activations to stage 1, which normalises them and projects on its copy of the embedding
    (``output_layer.weight``); the gradient of the activations goes back. Then the DP average
    and (``tied-correct``) the all-reduce of the tied gradient over the embedding group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from auditor import set_step, watch_replicas
    from auditor.trainer.client import AuditorClient

    first = ps.is_pipeline_first_stage()
    root = torch.nn.Module()
    table = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) / H ** 0.5  # identical at init
    if first:
        root.embedding = torch.nn.Module()
        root.embedding.word_embeddings = torch.nn.Embedding(V, H, _weight=table.clone())
        tied_param = "embedding.word_embeddings.weight"
    else:
        root.decoder = torch.nn.Module()
        root.decoder.final_layernorm = torch.nn.LayerNorm(H)
        root.output_layer = torch.nn.Module()
        root.output_layer.weight = torch.nn.Parameter(table.clone())
        tied_param = "output_layer.weight"
    opt = torch.optim.SGD(root.parameters(), lr=0.5)
    client = AuditorClient(dest, rank=rank, flush_interval=0.05)
    holders = sorted(dist.get_process_group_ranks(ps.get_embedding_group()))
    everyone = [r for r in range(dist.get_world_size())]
    watch = watch_replicas(root, client, run_id=f"{prefix}-{name}", optimizer=opt, exact=True,
                           tied={"word_embeddings": {"param": tied_param, "ranks": everyone}})
    dp = ps.get_data_parallel_rank()
    peer = ps.get_pipeline_model_parallel_next_rank() if first else ps.get_pipeline_model_parallel_prev_rank()
    first_differ = None
    for step in range(10):
        set_step(step)
        gen = torch.Generator().manual_seed(10 * step + dp)
        tokens = torch.randint(0, V, (S,), generator=gen)
        if first:
            h = root.embedding.word_embeddings(tokens)
            dist.send(h.detach().contiguous(), peer)
            grad = torch.empty_like(h)
            dist.recv(grad, peer)
            h.backward(grad)
        else:
            h = torch.empty(S, H)
            dist.recv(h, peer)
            h.requires_grad_(True)
            logits = root.decoder.final_layernorm(h) @ root.output_layer.weight.T
            loss = torch.nn.functional.cross_entropy(logits, tokens.roll(1))
            loss.backward()
            dist.send(h.grad.contiguous(), peer)
        for p in root.parameters():
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
            p.grad.div_(ps.get_data_parallel_world_size())
        tied_p = root.get_parameter(tied_param)
        if name == "tied-correct":  # Megatron's _allreduce_embedding_grads
            dist.all_reduce(tied_p.grad, group=ps.get_embedding_group())
        opt.step()
        opt.zero_grad()
        parts = [torch.empty_like(tied_p.data) for _ in everyone]
        dist.all_gather(parts, tied_p.data)
        if first_differ is None and not all(torch.equal(parts[0], q) for q in parts[1:]):
            first_differ = step
    watch.close()
    client.close()
    return {"first_differ": first_differ, "holders": holders, "stats": dict(client.stats),
            "buckets": [(b.name, b.members, b.spec) for b in watch.buckets]}


def _hsdp_run(rank: int, spool: str, prefix: str) -> dict:
    """DTensor parameters on a 2×2 mesh, no training: an HSDP-style weight (replicated along
    dp_replicate, sharded along dp_shard) and a fully replicated one, reported for 3 steps;
    rank 3's local shard is changed after step 0."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from auditor import set_device_mesh, set_step, watch_replicas
    from auditor.trainer.client import AuditorClient
    from auditor.trainer.mesh import clear_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    set_device_mesh(mesh)
    full = torch.linspace(-1, 1, 64).reshape(8, 8)
    model = torch.nn.Module()
    model.hsdp = torch.nn.Parameter(distribute_tensor(full, mesh, [Replicate(), Shard(0)]))
    model.rep = torch.nn.Parameter(distribute_tensor(full * 2, mesh, [Replicate(), Replicate()]))
    client = AuditorClient(f"file://{spool}/{prefix}-hsdp/{rank}", rank=rank, flush_interval=0.05)
    watch = watch_replicas(model, client, run_id=f"{prefix}-hsdp", what=("params",), exact=True, min_bucket=1)
    for step in range(3):
        set_step(step)
        if step == 1 and rank == 3:
            with torch.no_grad():
                model.hsdp.to_local()[0, 0] += 1.0
        watch.step()
    client.close()
    clear_device_mesh()
    return {"buckets": [(b.name, b.members, b.spec) for b in watch.buckets]}


def read_reports(spool: str, run: str, world: int) -> list[dict]:
    """Every report the ranks of ``run`` spooled."""
    out = []
    for rank in range(world):
        for f in sorted(Path(f"{spool}/{run}/{rank}").glob("*.jsonl")):
            out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out
