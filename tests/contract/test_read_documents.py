"""The read documents are declared once (auditor/contract/reads.py) and the real Service
builds them (its read methods return those dataclasses: get_run, runs_page, report, steps,
step, compare_workload, compare_runs), so every key it emits is a declared field by
construction. Over runs in every state (consistent, inconsistent with faults, unverified,
incomplete with ranks behind and a re-audit, pending, with refused reports; ``sum`` and
``moments`` statistics, a known order and an unknown topology) this pins: each read returns
its document class, its JSON (``to_json``, what the routes answer) holds declared keys only,
every declared field is emitted at least once, and the JSON decodes (``from_json``) with
nothing left in ``extra`` back to an equal document."""

from __future__ import annotations

import dataclasses
import json
import time
import typing

import pytest
from factory import reference_reports, world_reports

from auditor.contract import reads
from auditor.contract.models import Report as WireReport
from auditor.service import ConflictError


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A Service on a real SQLite file, for this module."""
    from auditor.db.engine import ensure_schema, make_engine
    from auditor.service import Service

    url = f"sqlite:///{tmp_path_factory.mktemp('reads') / 'auditor.db'}"
    engine = make_engine(url)
    ensure_schema(engine, url)
    svc = Service.from_engine(engine)
    yield svc
    svc.close()


def _wire(reports: list[dict]) -> list:
    return [WireReport.model_validate(r) for r in reports]


def _unknown(run_id: str, locals_, applied_, step: int = 0) -> list:
    """A token-count (``sum``) step of a 2-rank run that declared no topology."""
    return _wire([{"run_id": run_id, "statistic": "tokens", "step": step, "rank": r, "world_size": 2,
                   "topology": "unknown", "kind": "sum", "local": {"sum": locals_[r]}, "applied": {"sum": applied_[r]},
                   "group_ranks": [0, 1]} for r in range(2)])


@pytest.fixture(scope="module")
def runs(service) -> list[str]:
    """Runs in every state; their ids."""
    tag = f"reads-{time.time_ns()}"
    ok, bad, blind, lost, open_, reused, drift = (f"{tag}-{n}" for n in ("ok", "bad", "blind", "lost", "open", "reused",
                                                                        "drift"))
    label = {"workload": f"{tag}-w"}  # ok, bad, blind, lost: one workload (compared: a variant, a run not compared)
    ordered = [dict(r, order="tp-cp-dp-pp", **label) for s in range(2) for r in world_reports(ok, step=s)]
    service.ingest(_wire(ordered))                                            # consistent, with an order
    service.ingest(_wire([dict(r, **label) for r in reference_reports(bad, buggy=True)]))  # inconsistent, faults
    service.ingest(_wire(reference_reports(bad, buggy=False, step=1)))
    service.ingest([r.model_copy(update=label) for r in _unknown(blind, (2.0, 2.0), (4.0, 4.0))])  # topology unknown
    for s in range(3):                                                       # rank 1 behind: incomplete
        service.ingest(_wire([dict(r, **label) for r in world_reports(lost, step=s, skip_ranks=(1,))]))
    service.sweep(grace_seconds=0.0, now=time.time() + 1)
    late = [r for r in world_reports(lost, step=0) if r["rank"] == 1]
    service.ingest(_wire(late))                                              # step 0 re-audited
    service.ingest(_wire(world_reports(open_, skip_ranks=(3,))))             # pending
    service.ingest(_wire(world_reports(reused)))                             # refused reports
    with pytest.raises(ConflictError):
        service.ingest(_wire(world_reports(reused, scale=2.0)))
    service.ingest(_wire(_fingerprints(drift)))                              # replica drift: kind fingerprint
    return [ok, bad, blind, lost, open_, reused, drift]


def _fingerprints(run_id: str) -> list[dict]:
    """Three DP replicas of one weight over two steps (hosts named); rank 1 out of line at step 1."""
    import torch

    from auditor.trainer.fingerprint import fingerprint

    w = torch.linspace(-1.0, 1.0, 1000)
    return [{"run_id": run_id, "statistic": "ln.weight", "kind": "fingerprint", "step": s, "rank": r,
             "world_size": 3, "sizes": {"dp": 3}, "coords": {"dp": r}, "host": f"node-{r}",
             "local": {"fingerprint": fingerprint(w * (1.5 if (r, s) == (1, 1) else 1.0)).tolist()}}
            for s in range(2) for r in range(3)]


def _documents(service, run_ids: list[str]):
    """(declared class, document) of every read the routes answer, as they answer it: the
    service's keyset key becomes the route's ``next_cursor``, the report and the workload
    gain ``page``."""
    first, last = service.runs_page(limit=1)
    yield reads.RunsPage, reads.RunsPage(runs=first, next_cursor="c" if last else None)
    yield reads.RunsPage, reads.RunsPage(runs=service.runs_page()[0])
    labels = {service.get_run(r).workload for r in run_ids} - {None}
    for w in sorted(labels):
        yield reads.Workload, dataclasses.replace(service.compare_workload(w), page=f"http://auditor/workloads/{w}")
    yield reads.Workload, service.compare_runs(run_ids[:2])
    for run_id in run_ids:
        yield reads.Run, service.get_run(run_id)
        report = service.report(run_id)
        yield reads.Report, dataclasses.replace(report, page=f"http://auditor/runs/{run_id}")
        for st in report.statistics:
            for limit in (1, 1000):
                page, cursor = service.steps(run_id, st.statistic, limit=limit)
                yield reads.StepsPage, dataclasses.replace(page, next_cursor=None if cursor is None else "c")
            for summary in service.steps(run_id, st.statistic)[0].steps:
                for limit in (1, None):
                    out, cursor = service.step(run_id, st.statistic, summary.step, limit=limit)
                    yield reads.StepPage, dataclasses.replace(out, next_cursor=None if cursor is None else "c")


def _document_of(hint) -> type | None:
    """The document class a field holds (itself, in a list, or optional), else None."""
    for a in (hint, *typing.get_args(hint)):
        for b in (a, *typing.get_args(a)):
            if isinstance(b, type) and dataclasses.is_dataclass(b):
                return b
    return None


def _walk(cls, doc, where: str, seen: set, undeclared: list) -> None:
    """Every key of ``doc`` against ``cls``'s fields, nested documents too."""
    fields = reads.declared(cls)
    for key, value in doc.items():
        if key not in fields:
            undeclared.append(f"{where}.{key} ({cls.__name__})")
            continue
        seen.add((cls.__name__, key))
        inner = _document_of(fields[key])
        if inner is not None and value is not None:
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                _walk(inner, item, f"{where}.{key}[{i}]", seen, undeclared)


def test_every_emitted_key_is_declared_and_every_field_emitted(service, runs):
    """Each read returns its declared class; its JSON holds declared keys only (nothing in
    ``extra``), and every declared field of every document is emitted by some read."""
    seen: set = set()
    undeclared: list = []
    count = 0
    for cls, doc in _documents(service, runs):
        count += 1
        assert type(doc) is cls, (cls.__name__, type(doc).__name__)
        _walk(cls, doc.to_json(), cls.__name__, seen, undeclared)
    assert not undeclared, f"keys the service emits that contract/reads.py does not declare: {sorted(set(undeclared))}"
    declared = {(cls.__name__, name) for cls in reads.DOCUMENTS for name in reads.declared(cls)}
    assert declared - seen == set(), "declared fields the service never emitted"
    assert count > 40


def test_documents_encode_and_decode_back(service, runs):
    """``to_json`` then ``from_json`` gives an equal document with every key read into a
    field (``extra`` empty, recursively), and encoding it again gives the same JSON."""
    def no_extra(obj) -> None:
        if dataclasses.is_dataclass(obj):
            assert obj.extra == {}, (type(obj).__name__, obj.extra)
            for f in dataclasses.fields(obj):
                no_extra(getattr(obj, f.name))
        elif isinstance(obj, list):
            for x in obj:
                no_extra(x)

    for cls, doc in _documents(service, runs):
        no_extra(doc)
        data = doc.to_json()
        back = cls.from_json(json.loads(json.dumps(data)))
        no_extra(back)
        assert back == doc
        assert back.to_json() == data and list(back.to_json()) == list(data)


def test_wire_order_names_every_field_once():
    """``to_json`` writes each document's keys in its ``WIRE_ORDER`` (the order the HTTP
    answers always had), which must name every field but ``extra`` once: a document whose
    order misses one is refused (TypeError naming it) instead of silently dropping the key."""
    for cls in reads.DOCUMENTS:
        order = cls.WIRE_ORDER or tuple(reads.declared(cls))
        assert sorted(order) == sorted(reads.declared(cls)), cls.__name__

    @dataclasses.dataclass(frozen=True)
    class Short(reads.ProgressAt):
        WIRE_ORDER = ("step",)

    with pytest.raises(TypeError, match=r"Short.WIRE_ORDER must name each field once: missing \['ranks'\]"):
        Short(step=1, ranks="0").to_json()
    assert list(reads.Fault(kind="k", message="m", ranks=[1]).to_json()) == list(reads.Fault.WIRE_ORDER)


def test_a_rank_row_carries_every_column_of_the_engine_s_table():
    """The service copies the engine's per-rank row (``auditor.core.RankRow``) field by field
    into the document (``_rank_row``): a column the engine adds must be declared (and copied)."""
    from auditor import core

    assert set(core.RankRow.__dataclass_fields__) == set(reads.declared(reads.RankRow))


@pytest.mark.parametrize("cls, doc, what", [
    (reads.Run, [], "a JSON object was expected"),
    (reads.Fault, {"kind": "x", "message": "m", "ranks": "0"}, "Fault.ranks: str"),
    (reads.StatisticReport, {"progress": {"newest_step": True}}, "Progress.newest_step: bool"),
    (reads.Progress, {"newest_step": 1, "ranks_behind": 1.5, "at": [], "summary": ""}, "Progress.ranks_behind"),
    (reads.StepDetail, {"step": 1, "verdict": None, "reports": 1, "expected": 1, "faults": [], "ranks": [{}]},
     "RankRow: "),
])
def test_a_document_of_the_wrong_shape_is_a_shape_error(cls, doc, what):
    """Wrong JSON types (a bool is no number, a float no int), a missing field, a nested
    document that is not one: ShapeError (a TypeError) naming the document and field."""
    with pytest.raises(reads.ShapeError, match=what):
        cls.from_json(doc)
