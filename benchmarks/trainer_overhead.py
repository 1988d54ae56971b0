"""What each hook costs the training thread (issue 24): host syncs, CPU time, allocations.

    python benchmarks/trainer_overhead.py [--sizes 4096,1048576,16777216] [--repeats 30] [--cuda-calls 1000]

One rank (a one-rank gloo world on CPU, NCCL on a GPU), a file-only client. Prints:

1. host syncs per call (``auditor.testing.count_host_syncs``: each is one host-device sync
   on a GPU), 4,096 values, without and with the auditor, for every hook: a slime-style
   whitening through ``wrap_distributed_whiten``, ``distributed_masked_whiten``,
   ``audited_sum``, ``audited_norm_sq`` and ``report_statistic``. Goal: the same in both
   columns (the whitening keeps its own).
2. per-call CPU time of each hook against the unhooked call over the shapes of real steps
   (``--sizes``, float32 and bfloat16): median µs, the ratio and the µs added, and the
   Python memory each call allocates (tracemalloc) and the process's peak RSS. Goals: ≤
   1.2× at 1 M elements, ≤ 20 µs added at 4 K.
3. what the report path does per call on the training thread: the wire dict's fixed
   fields (run id, topology, group ranks: :func:`auditor.trainer.report.build_report`), the
   device payload and the hand-over to the client.
4. on a CUDA machine only (else one line saying it is skipped): each hook for
   ``--cuda-calls`` calls under ``torch.cuda.set_sync_debug_mode("error")`` (the
   whitening, whose own empty-group check is a sync, under ``"warn"``, counting the
   warnings with and without the auditor), then the time of a small model step (MLP
   forward/backward, optimizer step, whitening, token-count sum, grad-norm) with and
   without the auditor. Goals: no sync error, ≤ 1 % step time.

The script runs unchanged on CPU and on a GPU box.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from auditor.testing import count_host_syncs  # noqa: E402
from auditor.trainer import report as report_mod  # noqa: E402
from auditor.trainer.client import AuditorClient  # noqa: E402
from auditor.trainer.hooks import audited_norm_sq, audited_sum, distributed_masked_whiten, report_statistic  # noqa: E402
from auditor.trainer.settings import read_settings  # noqa: E402
from auditor.trainer.wrap import set_step, wrap_distributed_whiten  # noqa: E402


def slime_whiten(values, mask, process_group=None, shift_mean=True, epsilon=1e-8):
    """slime's ``distributed_masked_whiten`` as slime writes it (its own host reads: the
    list of 0-d tensors into ``torch.tensor`` and the Bessel ``.item()``)."""
    stats = torch.tensor([(values * mask).sum(), (values**2 * mask).sum(), mask.sum()], device=values.device,
                         dtype=torch.float32)
    dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    mean = total / count
    var = total_sq / count - mean**2
    if count.item() >= 2:
        var = var * count / (count - 1)
    out = (values - mean) * torch.rsqrt(var + epsilon)
    return out if shift_mean else out + mean


def syncfree_whiten(values, mask, process_group=None, shift_mean=True, epsilon=1e-8):
    """A whitening without any host read (for the CUDA ``"error"`` run of the wrapper)."""
    stats = torch.stack([(values * mask).sum(), (values**2 * mask).sum(), mask.sum()]).float()
    dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats
    mean = total / count
    var = total_sq / count - mean**2
    var = torch.where(count >= 2, var * count / (count - 1), var)
    out = (values - mean) * torch.rsqrt(var + epsilon)
    return out if shift_mean else out + mean


def calls(client, values, mask):
    """(name, unhooked call, hooked call) of every hook on ``values``/``mask``."""
    device = values.device
    tokens = [mask[: len(mask) // 2].sum(), mask[len(mask) // 2:].sum()]
    gsq = (values.float() ** 2).sum()
    wrapped = wrap_distributed_whiten(slime_whiten, client=client, run_id="bench")
    kw = {"client": client, "run_id": "bench"}
    return [
        ("slime-style whiten, wrap_distributed_whiten", lambda: slime_whiten(values, mask),
         lambda: wrapped(values, mask)),
        ("distributed_masked_whiten", lambda: distributed_masked_whiten(values, mask),
         lambda: distributed_masked_whiten(values, mask, **kw)),
        ("audited_sum (2 microbatches)", lambda: audited_sum(tokens), lambda: audited_sum(tokens, **kw)),
        ("audited_norm_sq", lambda: audited_norm_sq(gsq, 0.5), lambda: audited_norm_sq(gsq, 0.5, **kw)),
        ("report_statistic (tensor values)", lambda: None, lambda: report_statistic(
            client, run_id="bench", statistic="s", step=0, kind="sum", local={"sum": tokens[0]},
            applied={"sum": tokens[1]}, process_group=None)),
    ], device


def inputs(n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    mask = (torch.rand(n, generator=g) > 0.2).to(device=device, dtype=dtype)
    return values, mask


def median_us(f, repeats: int, cuda: bool) -> float:
    f()
    ts = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def py_alloc_per_call(f, n: int = 50) -> float:
    """Bytes of Python memory a call allocates and keeps until the next (tracemalloc peak)."""
    f()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(n):
        f()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / 1024


def part_syncs(client, device) -> None:
    print("\n1. host syncs per call, 4,096 values (each one is a host-device sync on a GPU)")
    print(f"{'call':<46} {'without the auditor':>20} {'with it':>8}")
    values, mask = inputs(4096, torch.float32, device)
    rows, _ = calls(client, values, mask)
    for name, bare, hooked in rows:
        counts = []
        for f in (bare, hooked):
            with count_host_syncs() as seen:
                f()
            counts.append(seen.count)
        print(f"{name:<46} {counts[0]:>20} {counts[1]:>8}")


def part_cpu(client, device, sizes, repeats) -> None:
    cuda = device.type == "cuda"
    print(f"\n2. per-call time ({'wall, synchronised' if cuda else 'CPU'}), median of {repeats}; python memory "
          "allocated per call (tracemalloc)")
    print(f"{'call':<46} {'n':>9} {'dtype':>8} {'bare µs':>10} {'hooked µs':>10} {'ratio':>6} {'added µs':>9} "
          f"{'py KiB/call':>11}")
    for n in sizes:
        for dtype in (torch.float32, torch.bfloat16):
            values, mask = inputs(n, dtype, device)
            rows, _ = calls(client, values, mask)
            for name, bare, hooked in rows:
                if name.startswith(("audited_", "report_")) and (n != sizes[0] or dtype != torch.float32):
                    continue  # scalars: the shape does not matter
                b = median_us(bare, repeats, cuda)
                h = median_us(hooked, repeats, cuda)
                kib = py_alloc_per_call(hooked)
                print(f"{name:<46} {n:>9,} {str(dtype)[6:]:>8} {b:>10.1f} {h:>10.1f} {h / b if b > 0.5 else 0:>6.2f} "
                      f"{h - b:>9.1f} {kib:>11.1f}")
            client.flush(timeout=60)
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


def part_per_call(client, device, repeats) -> None:
    from auditor.trainer.hooks import moments_payload  # here: parts 1 and 2 also measure the code before issue 24

    print("\n3. the report path on the training thread, per call (median µs of 2,000)")
    values, mask = inputs(4096, torch.float32, device)
    payload = torch.zeros(12, dtype=torch.float64, device=device)
    steps = [
        ("build_report (run id, topology, group ranks)", lambda: report_mod.build_report(
            run_id=None, statistic="s", step=0, local=None, applied=None, group=None)),
        ("moments_payload (device work, 4,096 values)", lambda: moments_payload(values, mask)),
        ("AuditorClient.report_deferred (ring + queue)", lambda: client.report_deferred(payload, lambda v: {"run_id": "bench", "v": v})),
        ("AuditorClient.report (a finished dict)", lambda: client.report({"run_id": "bench"})),
        ("read_settings (environment, cached parse)", read_settings),
    ]
    cuda = device.type == "cuda"
    for name, f in steps:
        print(f"{name:<50} {median_us(f, 2000, cuda):>8.2f}")
        client.flush(timeout=60)


class _Errors(logging.Handler):
    """Error records of the auditor's loggers (a hook logs what it catches)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage() + (f" {record.exc_info[1]}" if record.exc_info else ""))


def part_cuda(client, calls_n: int) -> None:
    if not torch.cuda.is_available():
        print("\n4. CUDA: skipped (no CUDA device here): run this script on a GPU machine for the "
              "set_sync_debug_mode('error') check and the step-time overhead")
        return
    device = torch.device("cuda")
    print(f"\n4. CUDA ({torch.cuda.get_device_name()}): {calls_n} calls of each hook under set_sync_debug_mode")
    values, mask = inputs(1 << 20, torch.float32, device)
    tokens = [mask[:1000].sum(), mask[1000:].sum()]
    gsq = (values**2).sum()
    wrapped = wrap_distributed_whiten(syncfree_whiten, client=client, run_id="bench")
    strict = [("wrap_distributed_whiten (sync-free function)", 1, lambda: wrapped(values, mask)),
              ("audited_sum (2 microbatches)", 2, lambda: audited_sum(tokens, client=client, run_id="bench")),
              ("audited_norm_sq", 1, lambda: audited_norm_sq(gsq, 0.5, client=client, run_id="bench")),
              ("report_statistic", 1, lambda: report_statistic(client, run_id="bench", statistic="s", step=0,
                                                               kind="sum", local={"sum": tokens[0]},
                                                               applied={"sum": tokens[1]}, process_group=None))]
    errors = _Errors()
    logging.getLogger("auditor").addHandler(errors)
    for name, per_call, f in strict:
        f()  # first call: lazy allocations (the ring's pinned buffer, events) outside the check
        torch.cuda.synchronize()
        client.flush(timeout=60)
        before, errors.seen = client.stats["enqueued"] + client.stats["reports_dropped"], []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(calls_n):
                f()
            verdict = "0 syncs"
        except RuntimeError as exc:
            verdict = f"SYNC: {str(exc).splitlines()[0][:80]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        handed = client.stats["enqueued"] + client.stats["reports_dropped"] - before
        if errors.seen:  # a hook catches everything (never into training): a sync error is logged there
            verdict = f"SYNC (logged by the hook): {errors.seen[0][:80]}"
        elif handed != per_call * calls_n:
            verdict += f", but {per_call * calls_n - handed} reports not handed to the client"
        print(f"  error mode  {name:<46} {verdict}")
    logging.getLogger("auditor").removeHandler(errors)
    for name, f in (("distributed_masked_whiten, bare", lambda: distributed_masked_whiten(values, mask)),
                    ("distributed_masked_whiten, audited", lambda: distributed_masked_whiten(
                        values, mask, client=client, run_id="bench"))):
        f()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(calls_n):
                    f()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        print(f"  warn mode   {name:<46} {len(seen) / calls_n:.2f} syncs per call (its own empty-group check)")
    client.flush(timeout=60)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 1024, device=device)
    adv = torch.randn(64 * 256, device=device)
    adv_mask = (torch.rand(64 * 256, device=device) > 0.3).float()

    def step(cl, i):
        out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        gsq = torch.stack([p.grad.pow(2).sum() for p in model.parameters()]).sum()
        audited_norm_sq(gsq, client=cl, run_id="bench", step=i)
        audited_sum([adv_mask[:8192].sum(), adv_mask[8192:].sum()], client=cl, run_id="bench", step=i)
        distributed_masked_whiten(adv, adv_mask, client=cl, run_id="bench", step=i)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(cl, n=300) -> float:
        for i in range(20):
            step(cl, i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            step(cl, i)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    times = {"without": [], "with": []}
    for _ in range(3):  # interleaved: clocks and other tenants drift
        times["without"].append(timed(None))
        times["with"].append(timed(client))
        client.flush(timeout=60)
    bare, hooked = min(times["without"]), min(times["with"])
    print(f"  small model step: {bare:.3f} ms without the auditor, {hooked:.3f} ms with it "
          f"({(hooked / bare - 1) * 100:+.2f} %; best of 3 × 300 steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cuda-calls", type=int, default=1000)
    ap.add_argument("--parts", default="1,2,3,4", help="which parts to run (1,2 also run on the code before issue 24)")
    args = ap.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    sizes = [int(s) for s in args.sizes.split(",")]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    import auditor

    print(f"auditor from {Path(auditor.__file__).parent.parent}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}, device {device}")
    os.environ.setdefault("AUDITOR_RUN_ID", "bench")
    os.environ.pop("AUDITOR_URL", None)  # the wrapper's unhooked path: no environment client
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    client = AuditorClient(f"file://{tempfile.mkdtemp(prefix='auditor-trainer-bench-')}", rank=0, max_queue=100_000)
    set_step(0)
    try:
        for part, run in ((1, lambda: part_syncs(client, device)),
                          (2, lambda: part_cpu(client, device, sizes, args.repeats)),
                          (3, lambda: part_per_call(client, device, args.repeats)),
                          (4, lambda: part_cuda(client, args.cuda_calls))):
            if part in parts:
                run()
    finally:
        client.close()
        dist.destroy_process_group()
        gc.collect()
    print(f"\nclient: {client.stats}")


if __name__ == "__main__":
    main()
