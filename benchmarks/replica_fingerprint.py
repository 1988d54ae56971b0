"""What a replica fingerprint costs (issue 27): seconds per GB tracked, against one plain read
pass of the same tensor.

    python benchmarks/replica_fingerprint.py [--sizes 1048576,16777216] [--repeats 5] [--device auto] [--threads N]

For each size (elements) and dtype (float32, bfloat16), and for a bucket of many small
tensors (``--bucket 256x65536``), the median time of
``auditor.trainer.fingerprint.fingerprint`` (k = 8) without and with the digests
(``exact=True``), the bytes of the tensor read per second, the seconds per GB tracked, and
the same for ``tensor.sum()`` (one read pass: the floor any fingerprint pays) and the ratio
between the two. On CUDA (``--device auto`` picks it when present) the times are taken
between ``torch.cuda.synchronize()`` calls and the read pass is the device's achieved
memory bandwidth, so the last column is the fingerprint's throughput as a fraction of it.
The script runs unchanged on CPU and on a GPU box. On a CPU shared with other work, torch's
intra-op threads wait for each other: ``--threads 1`` gives steadier numbers (the load
average is printed with the table).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from auditor.trainer.fingerprint import fingerprint  # noqa: E402


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up), synchronised
    around each run on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def row(label: str, tensors, device: torch.device, repeats: int) -> dict:
    """One line of the table: times and rates of the fingerprint (plain, exact) and of a
    read pass over ``tensors`` (one tensor or a bucket)."""
    one = tensors if isinstance(tensors, torch.Tensor) else None
    items = [one] if one is not None else tensors
    nbytes = sum(t.numel() * t.element_size() for t in items)
    plain = timed(lambda: fingerprint(tensors), device, repeats)
    exact = timed(lambda: fingerprint(tensors, exact=True), device, repeats)
    read = timed(lambda: [t.sum() for t in items], device, repeats)
    gb = nbytes / 1e9
    return {"what": label, "MB": nbytes / 1e6, "fp_ms": plain * 1e3, "fp_s_per_GB": plain / gb,
            "fp_GBps": gb / plain, "exact_ms": exact * 1e3, "exact_s_per_GB": exact / gb,
            "read_GBps": gb / read, "fp_of_read": read / plain, "exact_of_read": read / exact}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1048576,16777216", help="elements per tensor, comma-separated")
    ap.add_argument("--bucket", default="256x65536", help="a bucket of N tensors of M elements: NxM ('' for none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}, " \
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    print(f"# replica fingerprint cost, k = 8, torch {torch.__version__}, {device.type}: {where}")
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for n in (int(s) for s in args.sizes.split(",") if s):
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(n, generator=g, device=device).to(dtype)
            rows.append(row(f"{n:,} {str(dtype)[6:]}", t, device, args.repeats))
            del t
    if args.bucket:
        count, size = (int(x) for x in args.bucket.split("x"))
        bucket = [torch.randn(size, generator=g, device=device) for _ in range(count)]
        rows.append(row(f"bucket {count}x{size:,} float32", bucket, device, args.repeats))
    head = ("tensor", "MB", "fp ms", "fp s/GB", "fp GB/s", "exact ms", "exact s/GB", "read GB/s",
            "fp/read", "exact/read")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['what']} | {r['MB']:.1f} | {r['fp_ms']:.2f} | {r['fp_s_per_GB']:.3f} | {r['fp_GBps']:.2f} | "
              f"{r['exact_ms']:.2f} | {r['exact_s_per_GB']:.3f} | {r['read_GBps']:.2f} | {r['fp_of_read']:.2f} | "
              f"{r['exact_of_read']:.2f} |")
    label = "the device's achieved read bandwidth" if device.type == "cuda" else "one read pass (tensor.sum)"
    print(f"\nfp/read, exact/read: the fingerprint's throughput as a fraction of {label}.")


if __name__ == "__main__":
    main()
