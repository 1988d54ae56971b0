"""A step's stored ``group_ranks`` (compressed text, e.g. "0-2399") read back as engine
reports costs memory independent of ranks x group size: the reports carry the stored text
(``auditor.db.store.rank_report``) and the engine compares texts (``RankSpans``). Before,
a 2,400-rank step whose ranks all name the whole group expanded 5.8 M ints (~206 MiB) per
read, at ingest (the exact audit of a step that is not clean), on ``GET .../steps/{step}``
and in the report's bad-step tables; so did a step whose ranks name different large groups
(rank i: every rank but i). Real SQLite, through the service; one test over real HTTP."""

from __future__ import annotations

import httpx
from factory import traced_peak

from auditor.db.engine import ensure_schema, make_engine
from auditor.db.store import COLUMNS, rank_report
from auditor.contract.parse import parse_report_batch
from auditor.service import Service
from auditor.testing.server import ServerProcess

MiB = 2**20
WORLD = 2400
#: the rank whose all-reduce reduced over itself only: the step is not clean, so it is judged
#: by the exact engine (which reads the group_ranks back)
FAULTY = 17


def _local(rank: int) -> dict:
    return {"count": 4.0, "sum": 2.0 + rank % 3, "sum_sq": 9.0 + rank % 5, "min": -0.5, "max": 2.0}


def step_body(run_id: str, world: int = WORLD, groups=None) -> bytes:
    """A ``POST /v1/reports`` body of one dp=``world`` step, rank :data:`FAULTY` applying its
    local sums; ``groups(rank)`` gives each rank's group_ranks JSON text (default: the whole
    group, one text for all)."""
    glob = {k: sum(_local(r)[k] for r in range(world)) for k in ("count", "sum", "sum_sq")}
    whole = "[" + ",".join(map(str, range(world))) + "]"
    parts = []
    for r in range(world):
        loc = _local(r)
        app = {k: loc[k] for k in glob} if r == FAULTY else glob
        gr = whole if groups is None else groups(r)
        parts.append(
            f'{{"run_id":"{run_id}","statistic":"adv","step":0,"rank":{r},"world_size":{world},'
            f'"coords":{{"dp":{r}}},"sizes":{{"dp":{world}}},"local":{_json(loc)},"applied":{_json(app)},'
            f'"group_ranks":{gr}}}')
    return ('{"reports":[' + ",".join(parts) + "]}").encode()


def _json(d: dict) -> str:
    return "{" + ",".join(f'"{k}":{v!r}' for k, v in d.items()) + "}"


def _service(tmp_path) -> Service:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    engine = make_engine(url)
    ensure_schema(engine, url)
    return Service.from_engine(engine)


def test_rank_report_keeps_the_stored_text():
    """The engine's reports of stored rows carry ``group_ranks`` as the stored text."""
    def row_of(rank: int, text: str | None) -> tuple:
        vals = {c: 0 for c in COLUMNS}
        vals.update(rank=rank, dtype="float32", applied=True, group_ranks=text, non_finite=None,
                    local_count=1.0, local_sum=1.0, local_sum_sq=1.0)
        return tuple(vals[c] for c in COLUMNS)

    rows = [row_of(0, "0-3"), row_of(1, "0-3"), row_of(2, "0-1,3"), row_of(3, None)]
    got = [rank_report(r) for r in rows]
    assert [r.group_ranks for r in got] == ["0-3", "0-3", "0-1,3", None]


def test_a_whole_group_step_of_2400_ranks_is_ingested_and_read_in_a_few_mib(tmp_path):
    """Ingest (the exact audit of a step that is not clean), ``Service.step`` (10 rows) and
    the report (its bad-step table) of a 2,400-rank step whose every rank names the whole
    group each peak under 24 MiB traced (206 MiB each before: 5.8 M ints)."""
    svc = _service(tmp_path)
    try:
        batch, errs, _ = parse_report_batch(step_body("whole"), 5)
        assert batch is not None, errs
        out, peak = traced_peak(lambda: svc.ingest(batch))
        assert [v for _, _, v in out.audited] == ["inconsistent"]
        assert peak < 24 * MiB, peak / MiB
        del batch

        step, peak = traced_peak(lambda: svc.step("whole", "adv", 0, limit=10)[0])
        assert step.verdict == "inconsistent" and len(step.ranks) == 10
        assert {f.kind for f in step.faults} >= {"group_mismatch"}
        assert peak < 24 * MiB, peak / MiB

        rep, peak = traced_peak(lambda: svc.report("whole"))
        (bad,) = rep.statistics[0].bad_steps
        assert bad.ranks[0].rank == FAULTY
        assert peak < 24 * MiB, peak / MiB
    finally:
        svc.close()


#: ranks of the step whose ranks name different large groups (2.6 M ints, ~95 MiB, expanded)
ADV_WORLD = 1600


def all_but(rank: int, world: int = ADV_WORLD) -> str:
    """The group_ranks JSON of every rank of ``world`` but ``rank``."""
    return "[" + ",".join(str(x) for x in range(world) if x != rank) + "]"


def test_ranks_naming_different_large_groups_are_judged_in_a_few_mib(tmp_path):
    """1,600 ranks, rank i naming every rank but i (no two texts alike, nothing to share):
    ingest and ``Service.step`` each peak under 24 MiB traced (~100 MiB before); every rank's
    wrong_group says which rank its group leaves out, from the texts."""
    svc = _service(tmp_path)
    try:
        batch, errs, _ = parse_report_batch(step_body("adv", ADV_WORLD, all_but), 5)
        assert batch is not None, errs
        out, peak = traced_peak(lambda: svc.ingest(batch))
        assert [v for _, _, v in out.audited] == ["inconsistent"]
        assert peak < 24 * MiB, peak / MiB
        del batch

        step, peak = traced_peak(lambda: svc.step("adv", "adv", 0, limit=10)[0])
        assert peak < 24 * MiB, peak / MiB
        assert step.verdict == "inconsistent" and len(step.ranks) == 10
        members = [f for f in step.faults if f.kind == "wrong_group" and "left_out" in f.evidence]
        assert sorted(r for f in members for r in f.ranks) == list(range(ADV_WORLD))
        f5 = next(f for f in members if f.ranks == [5])
        assert f5.evidence["left_out"] == "5" and f5.evidence["wrongly_included"] == ""
        assert "leaves out rank 5 (dist.get_process_group_ranks)" in f5.message
    finally:
        svc.close()


def test_the_step_endpoint_stays_small_over_http(tmp_path):
    """A real ``auditor serve`` on SQLite: ``GET .../steps/0?limit=10`` of the 2,400-rank
    whole-group step and of the 1,600-rank all-but-i step (stored in process by the
    service's bulk ingest) raise the server's peak RSS by under 64 MiB (the first alone by
    ~210 MiB before)."""
    svc = _service(tmp_path)
    try:
        for body in (step_body("http"), step_body("http-adv", ADV_WORLD, all_but)):
            batch, errs, _ = parse_report_batch(body, 5)
            assert batch is not None, errs
            assert [v for _, _, v in svc.ingest(batch).audited] == ["inconsistent"]
        del batch, body
    finally:
        svc.close()
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "s.log").start()
    try:
        base = s.peak_rss()
        r = httpx.get(f"{s.url}/v1/runs/http/statistics/adv/steps/0", params={"limit": 10}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["verdict"] == "inconsistent" and len(body["ranks"]) == 10 and body["ranks_total"] == WORLD
        r = httpx.get(f"{s.url}/v1/runs/http-adv/statistics/adv/steps/0", params={"limit": 10}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["verdict"] == "inconsistent" and body["ranks_total"] == ADV_WORLD
        assert sum(f["kind"] == "wrong_group" for f in body["faults"]) >= ADV_WORLD - 1
        grown = s.peak_rss() - base
        assert grown < 64 * MiB, grown / MiB
    finally:
        s.stop()
