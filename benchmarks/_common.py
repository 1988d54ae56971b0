"""Shared pieces of the benchmarks: throw-away databases, service processes (auditor and
MLflow), synthetic but *consistent* rank reports, machine description.

Nothing here is imported by the package; MLflow is a benchmark-only dependency
(``benchmarks/requirements.txt``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from auditor.server import free_port

PG_ADMIN_URL = os.environ.get("AUDITOR_BENCH_PG", "postgresql://127.0.0.1:5432/postgres")
#: Python interpreter that runs the auditor under test (``auditor serve``, ``auditor audit``,
#: ``auditor import``): by default this one; point it at another checkout's venv
#: (``AUDITOR_BENCH_PYTHON=/work/wt-before/.venv/bin/python``, or ``--auditor-python``) to
#: measure that code with the same benchmark, e.g. before and after a change.
AUDITOR_PYTHON = os.environ.get("AUDITOR_BENCH_PYTHON") or sys.executable


def auditor_python(path: str | None = None) -> str:
    """The interpreter whose ``-m auditor`` is benchmarked (``path`` overrides, then
    ``AUDITOR_BENCH_PYTHON``, then this interpreter). Run it with ``-P``: without it,
    ``python -m auditor`` imports the package from the current directory first (a checkout
    other than that interpreter's)."""
    return path or AUDITOR_PYTHON


def auditor_code(python: str) -> str:
    """Where ``python -m auditor`` is imported from and its git commit, e.g.
    ``/work/wt-before@db8a3c6`` (printed with every table: which code was measured)."""
    src = subprocess.run([python, "-P", "-c", "import auditor, os; print(os.path.dirname(os.path.dirname(auditor.__file__)))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--", "auditor"], capture_output=True, text=True)
    return f"{src}@{rev.stdout.strip() or '?'}{'+dirty' if dirty.stdout.strip() else ''}"


# --------------------------------------------------------------------------- machine
def machine() -> dict:
    """nproc, CPU model and the 1/5/15-minute load average right now."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "load": load()}


def load() -> str:
    """``uptime``-style load average, e.g. ``1.52 0.80 0.41``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -------------------------------------------------------------------------- databases
@contextmanager
def database(kind: str, tag: str = "bench"):
    """Yield ``(sqlalchemy_url, path_or_dbname)`` of an empty throw-away database of ``kind``
    (``sqlite`` or ``postgresql``); drop it afterwards."""
    if kind == "sqlite":
        d = Path(tempfile.mkdtemp(prefix=f"auditor-{tag}-"))
        try:
            yield f"sqlite:///{d / 'db.sqlite'}", d / "db.sqlite"
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    from auditor.testing.postgres import create_database

    url, drop = create_database(tag, PG_ADMIN_URL)
    try:
        yield url, url.rsplit("/", 1)[1]
    finally:
        drop()


def database_bytes(kind: str, where) -> int:
    """On-disk size of a benchmark database (SQLite: file + WAL; PostgreSQL: pg_database_size)."""
    if kind == "sqlite":
        p = Path(where)
        return sum(q.stat().st_size for q in p.parent.glob(p.name + "*"))
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        return conn.execute("SELECT pg_database_size(%s)", (where,)).fetchone()[0]


# --------------------------------------------------------------------------- services
class Service:
    """A service subprocess (``python -m auditor serve`` or ``mlflow server``) on a free port."""

    def __init__(self, argv: list[str], url: str, health: str, env: dict | None = None,
                 log: Path | None = None):
        self.argv, self.url, self.health = argv, url, health
        self.env = {**os.environ, **(env or {})}
        self.log = log or Path(tempfile.mkstemp(prefix="bench-service-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Service":
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:4]} exited; log:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"{self.argv[:4]} not healthy; log:\n{self.log.read_text()[-3000:]}")

    @property
    def pids(self) -> list[int]:
        """The service process and its children (uvicorn/gunicorn workers)."""
        out = [self.proc.pid]
        try:
            out += [int(p) for p in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
                    .read_text().split()]
        except OSError:
            pass
        return out

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # our own session: the server and its workers
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def auditor_service(database_url: str, workers: int = 1, python: str | None = None, **env: str) -> Service:
    """``python -m auditor serve`` with ``workers`` processes on ``database_url``; ``python``:
    the interpreter of the code under test (:func:`auditor_python`)."""
    port = free_port()
    return Service(
        [auditor_python(python), "-P", "-m", "auditor", "serve", "--port", str(port), "--log-level", "warning",
         "--workers", str(workers)],
        f"http://127.0.0.1:{port}", "/healthz",
        env={"AUDITOR_DATABASE_URL": database_url, "AUDITOR_GRACE_SECONDS": "3600", **env},
    )


def mlflow_service(database_url: str, workers: int | None = None) -> Service:
    """``mlflow server`` with its default server and worker count unless ``workers`` is given."""
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    art = tempfile.mkdtemp(prefix="bench-mlflow-art-")
    argv = [str(exe), "server", "--backend-store-uri", database_url, "--default-artifact-root", art,
            "--host", "127.0.0.1", "--port", str(port)]
    if workers:
        argv += ["--workers", str(workers)]
    return Service(argv, f"http://127.0.0.1:{port}", "/health")


# ---------------------------------------------------------------------------- reports
def topology(world: int) -> tuple[int, int]:
    """(dp, cp) with cp = 2 (the CP case the auditor exists for) and dp = world / 2."""
    assert world % 2 == 0 or world == 1
    return (world // 2, 2) if world > 1 else (1, 1)


def step_reports(run_id: str, step: int, world: int, statistic: str = "advantages",
                 group_ranks: bool = False, buggy: bool = False) -> list[dict]:
    """All ``world`` reports of one step of a correct run (the applied statistic is the global
    one over dp × cp), so the audit takes its common, consistent path. ``buggy``: every rank
    applies its own local statistic instead (an inconsistent step)."""
    dp, cp = topology(world)
    locs = []
    for rank in range(world):
        n = float(64 + (rank * 7 + step * 13) % 97)
        mean = 0.01 * ((rank + step) % 11 - 5)
        var = 1.0 + 0.01 * (rank % 5)
        s = n * mean
        ss = (n - 1) * var + n * mean * mean
        locs.append((n, s, ss, mean - 2.0, mean + 2.0))
    N = sum(l[0] for l in locs)
    S = sum(l[1] for l in locs)
    SS = sum(l[2] for l in locs)
    gm = S / N
    gv = (SS / N - gm * gm) * N / (N - 1)
    applied = {"count": N, "sum": S, "sum_sq": SS, "mean": gm, "var": gv}
    sizes = {"dp": dp, "cp": cp, "tp": 1, "pp": 1}
    out = []
    for rank, (n, s, ss, lo, hi) in enumerate(locs):
        r = {
            "run_id": run_id, "statistic": statistic, "step": step, "rank": rank, "world_size": world,
            "coords": {"dp": rank // cp, "cp": rank % cp, "tp": 0, "pp": 0}, "sizes": sizes,
            "local": {"count": n, "sum": s, "sum_sq": ss, "min": lo, "max": hi},
            "applied": applied, "dtype": "float32",
        }
        if buggy:
            lm = s / n
            r["applied"] = {"count": n, "sum": s, "sum_sq": ss, "mean": lm,
                            "var": (ss / n - lm * lm) * n / (n - 1)}
        if group_ranks:
            r["group_ranks"] = list(range(world))
        out.append(r)
    return out


def report_stream(run_id: str, total: int, world: int, first_step: int = 0, **kw):
    """``total`` reports of consecutive steps, rank-major within a step (ranks report in order)."""
    step = first_step
    left = total
    while left > 0:
        reps = step_reports(run_id, step, world, **kw)
        yield from reps[:left]
        left -= len(reps)
        step += 1


def batches(it, size: int):
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def encode_batch(reports: list[dict]) -> bytes:
    return json.dumps({"reports": reports}, separators=(",", ":")).encode()


_VALUES = [("local", k) for k in ("count", "sum", "sum_sq", "min", "max")] + \
    [("applied", k) for k in ("count", "sum", "sum_sq", "mean", "var")]


def mlflow_metrics(r: dict, per_report: int) -> list[dict]:
    """A report as MLflow metrics at its step: ``per_report == 1``: the applied mean, key
    ``<statistic>/rank<rank>``; ``per_report == 10``: each of its ten numbers, key
    ``<statistic>/rank<rank>/<local|applied>_<field>``."""
    ts = int(time.time() * 1000)
    if per_report == 1:
        return [{"key": f"{r['statistic']}/rank{r['rank']}", "value": r["applied"]["mean"],
                 "timestamp": ts, "step": r["step"]}]
    return [{"key": f"{r['statistic']}/rank{r['rank']}/{part}_{k}", "value": r[part][k],
             "timestamp": ts, "step": r["step"]} for part, k in _VALUES[:per_report]]


def mlflow_batches(reports: list[dict], mlflow_run_id: str, per_report: int = 1, size: int = 1000) -> list[bytes]:
    """The same reports as MLflow ``log-batch`` bodies (:func:`mlflow_metrics`); MLflow
    accepts at most 1,000 metrics per request, so larger batches are split."""
    metrics = [m for r in reports for m in mlflow_metrics(r, per_report)]
    return [json.dumps({"run_id": mlflow_run_id, "metrics": chunk}, separators=(",", ":")).encode()
            for chunk in batches(metrics, size)]


def post_retrying_busy(http, path: str, body: bytes):
    """POST ``body`` until the answer is not a 503 (waiting its ``Retry-After``); return the
    answer and how many 503s came first."""
    busy = 0
    while True:
        r = http.post(path, content=body)
        if r.status_code != 503:
            return r, busy
        busy += 1
        time.sleep(float(r.headers.get("retry-after", "1")))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (server workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*") if Path(f"/proc/{p}/task").exists() else []:
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError):
            pass
    return total / tick


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
