"""pytest plugin: audit the reductions of a test's gloo world and fail it with the diagnosis.

For framework CI (slime, verl, Megatron-based trainers): a regression test that spawns a
``torch.distributed`` world and whitens, divides or clips through an audited hook
(``AUDITOR_URL``-configured client: :func:`auditor.client.client_from_env`,
``auditor.integrations.slime``, ``wrap_distributed_whiten``) gets its reports collected by
an in-process auditor service and fails when any step is inconsistent::

    pytest -p auditor.pytest_plugin        # also auto-loaded once auditor is installed

    @pytest.mark.audited                   # or request the `audited` fixture
    def test_cp_whitening(audited):
        mp.spawn(train_two_steps, nprocs=4)   # ranks read AUDITOR_URL, set by the plugin

    FAILED test_cp_whitening - auditor: run 'grpo' is INCONSISTENT
      advantages step 0: cp_disagreement (ranks 0-3): CP peers … ; wrong_group (ranks 0-3):
      reduced local only: over ['dp'] (size 1: no other rank) where ['dp', 'cp'] was expected … use
      get_data_parallel_group(with_context_parallel=True)

Fixtures
--------
``auditor_service`` (session): the service on a temporary SQLite file, in a thread of the
test process (``url``, ``reader``). ``audited`` (function): sets ``AUDITOR_URL`` (and a
temporary ``AUDITOR_SPOOL_DIR``) for the test and the processes it spawns; after the test
body has passed, audits every step still open (the ranks have exited: a report missing now
is missing for good), then fails the test with the auditor's diagnosis if a run the test
wrote to is inconsistent — or if no report arrived at all (``min_steps``), which would
otherwise pass silently. ``audited.expect_inconsistent(run_id)`` inverts the check for a
run that reproduces a known bug; ``audited.runs()``/``audited.report(run_id)`` give typed
results (:mod:`auditor.reader`). ``audited.layouts(body, layouts, workload=...)`` is the CI
one-liner of layout invariance: ``body`` on every rank of a gloo world per (dp, cp) layout,
then every run consistent and the workload invariant (:mod:`auditor.testing.layouts`).

A run audited without a known layout (no Megatron ``parallel_state`` or ``megatron.core.mpu``
accessors, no DeviceMesh, no ``AUDITOR_TOPOLOGY``: each rank could be checked only against
the group it reduced over) is ``unverified`` and fails the test with what to set, unless the
marker says ``allow_unverified=True``.

Marker ``@pytest.mark.audited(min_steps=1, allow_unverified=False)`` requests the fixture and
sets its options.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

#: How many bad steps and faults of each inconsistent run the failure message quotes.
MAX_STEPS_QUOTED = 3


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "audited(min_steps=1, allow_unverified=False): collect the auditor reports of this test's ranks "
                   "(AUDITOR_URL) and fail the test with the diagnosis when a step is inconsistent, or unverified "
                   "(no layout known) unless allowed (auditor.pytest_plugin)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("audited") is not None and "audited" not in getattr(item, "fixturenames", ()):
            item.fixturenames.append("audited")


class AuditorService:
    """An auditor service in a daemon thread of the test process, on a temporary SQLite file.

    ``url``: its base URL (127.0.0.1, a free port); ``reader``: an :class:`auditor.Reader`."""

    def __init__(self, directory: Path):
        from auditor.config import Settings
        from auditor.reader import Reader
        from auditor.server import BackgroundServer

        self.database_url = f"sqlite:///{directory / 'auditor.db'}"
        # grace: long enough that a slow rank is not called missing while the test runs;
        # `settle()` audits what is still open once the test body is done
        settings = Settings(database_url=self.database_url, grace_seconds=3600, sweep_interval_seconds=3600)
        self._server = BackgroundServer(settings)
        self.url = self._server.__enter__()
        self.reader = Reader(self.url)

    def settle(self) -> int:
        """Audit every step still open (as its grace period would); returns how many."""
        return self._server.app.state.svc.service.sweep(grace_seconds=0.0)

    def close(self) -> None:
        self.reader.close()
        self._server.__exit__(None, None, None)


@dataclass
class Audited:
    """The ``audited`` fixture's value: what the test's ranks reported, and the check."""

    service: AuditorService
    started: float
    min_steps: int = 1
    allow_unverified: bool = False
    expected_bad: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        """Base URL the ranks report to (also in ``AUDITOR_URL``)."""
        return self.service.url

    def expect_inconsistent(self, *run_ids: str) -> None:
        """These runs reproduce a known bug: the check then requires them to be
        inconsistent (and fails if the auditor finds nothing wrong)."""
        self.expected_bad.update(run_ids)

    def layouts(self, body, layouts=None, *, workload: str, args: tuple = (), expect_inconsistent=(),
                timeout: float | None = None) -> list:
        """The CI one-liner of layout invariance (issue 26): run ``body(rank, *args)`` on every
        rank of every layout — one gloo world with Megatron-core groups per layout, each a run
        ``{workload}-{layout}`` of ``workload`` reporting to this service
        (:func:`auditor.testing.layouts.run_layouts`; ``rank`` is a
        :class:`~auditor.testing.layouts.LayoutRank`: its coordinates, ``group()``, ``client``,
        ``run_id``) — then require every run consistent and the workload invariant
        (:func:`~auditor.testing.layouts.check_layouts`); else the test fails with each problem,
        naming its layout and step. ``layouts``: (dp, cp) or (dp, cp, micro-batches) tuples,
        default the seed's six ``(1,1) (2,1) (1,2) (2,2) (1,4) (4,1)``;
        ``expect_inconsistent``: layouts whose run reproduces a known bug. Returns the runs
        (:class:`~auditor.testing.layouts.LayoutRun`: what each rank returned)."""
        from auditor.testing import layouts as lay

        self.expect_inconsistent(*(lay.Layout.of(x).run_id(workload) for x in expect_inconsistent))
        try:
            return lay.assert_layout_invariant(
                body, lay.SEED_LAYOUTS if layouts is None else layouts, url=self.url, workload=workload, args=args,
                reader=self.service.reader, expect_inconsistent=expect_inconsistent, settle=self.service.settle,
                timeout=lay.DEFAULT_TIMEOUT if timeout is None else timeout)
        except AssertionError as e:
            pytest.fail(f"auditor: {e}", pytrace=False)

    def runs(self) -> list:
        """Runs this test reported to (typed :class:`auditor.reader.Run`), newest first."""
        return [r for r in self.service.reader.runs(page_size=1000) if r.last_activity >= self.started]

    def report(self, run_id: str):
        """The typed report (:class:`auditor.reader.Report`) of one run."""
        return self.service.reader.report(run_id)

    def check(self) -> None:
        """Settle open steps, then raise ``pytest.fail`` with the diagnosis of every
        inconsistent run (or of an expected-bad run found consistent, or of no report)."""
        self.service.settle()
        runs = self.runs()
        audited = sum(r.steps_audited for r in runs)
        problems = []
        if audited < self.min_steps:
            problems.append(f"auditor: {audited} step(s) audited, expected at least {self.min_steps}: did the ranks "
                            f"report (AUDITOR_URL={self.url}, an audited hook, the client flushed at exit)?")
        seen = {r.run_id for r in runs}
        for run_id in sorted(self.expected_bad - seen):
            problems.append(f"auditor: run {run_id!r} was expected to be inconsistent but never reported")
        for run in runs:
            if run.run_id in self.expected_bad:
                if run.status != "inconsistent":
                    problems.append(f"auditor: run {run.run_id!r} was expected to be inconsistent, but it is "
                                    f"{run.status} ({run.steps_audited} step(s) audited)")
                continue
            report = self.report(run.run_id)
            # the status every surface shows (auditor.status)
            passed, lines = report.check(allow_unverified=self.allow_unverified)
            if not passed:
                if report.status in ("inconsistent", "incomplete"):
                    problems.append(diagnosis(report))
                problems.extend(f"auditor: {line}" for line in lines if "REFUSED" in line or "UNVERIFIED" in line)
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


def diagnosis(report) -> str:
    """The failure text of an inconsistent (or incomplete) run. The first line names the run,
    the first bad step's fault kinds and the message of its cause (a diagnosis such as
    ``wrong_group`` before symptoms such as ``cp_disagreement``), so pytest's one-line
    summary already says what to change; then per statistic the counts and the faults of up
    to :data:`MAX_STEPS_QUOTED` bad steps."""
    from auditor.web.plots import primary_fault

    state = report.status.upper()
    bad = [s for s in report.statistics if s.steps_inconsistent or s.steps_incomplete]
    head = f"auditor: run {report.run_id!r} is {state}"
    first = next((s for s in bad if s.bad_steps), None)
    if first is not None:
        step = first.bad_steps[0]
        kinds = sorted({f.kind for f in step.faults}, key=lambda k: (k != "cp_disagreement", k))
        cause = primary_fault(kinds)
        message = next((f.message for f in step.faults if f.kind == cause), "")
        head += f" — {first.statistic} step {step.step}: {', '.join(kinds)}: {message}"
    lines = [head]
    for s in bad:
        lines.append(f"  {s.statistic}: {s.steps_inconsistent} inconsistent, {s.steps_incomplete} incomplete of "
                     f"{s.steps_audited} step(s); faults {', '.join(f'{k} ×{n}' for k, n in s.faults.items())}")
        for step in s.bad_steps[:MAX_STEPS_QUOTED]:
            for f in step.faults:
                lines.append(f"    step {step.step}: {f.kind} (ranks {_ranks(f.ranks)}): {f.message}")
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (" …" if len(ranks) > 16 else "")


@pytest.fixture(scope="session")
def auditor_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuditorService]:
    """An in-process auditor service on a temporary SQLite file, for the whole session."""
    service = AuditorService(tmp_path_factory.mktemp("auditor"))
    yield service
    service.close()


@pytest.fixture
def audited(request: pytest.FixtureRequest, auditor_service: AuditorService, monkeypatch: pytest.MonkeyPatch,
            tmp_path_factory: pytest.TempPathFactory) -> Audited:
    """Point this test's ranks at ``auditor_service`` (``AUDITOR_URL``, a temporary
    ``AUDITOR_SPOOL_DIR``); the test fails with the auditor's diagnosis afterwards when a
    run it reported to is inconsistent. See the module docstring."""
    marker = request.node.get_closest_marker("audited")
    options = dict(marker.kwargs) if marker else {}
    monkeypatch.setenv("AUDITOR_URL", auditor_service.url)
    monkeypatch.setenv("AUDITOR_SPOOL_DIR", str(tmp_path_factory.mktemp("auditor-spool")))
    return Audited(auditor_service, started=time.time() - 1e-3, min_steps=int(options.get("min_steps", 1)),
                   allow_unverified=bool(options.get("allow_unverified", False)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After a passing test body that used ``audited``, run its check: an inconsistent step
    fails the test itself (not its teardown)."""
    result = yield
    audit = getattr(item, "funcargs", {}).get("audited")
    if isinstance(audit, Audited):
        audit.check()
    return result
