"""The values the flows reason with: a run's :class:`Topology` (from a stored row or from the
wire, never from a JSON document) and a (run, statistic) as :class:`SeriesInfo`."""

from __future__ import annotations

from dataclasses import dataclass, field

from auditor import core, layout
from auditor.core import DIMS, EXPERT_DIMS
from auditor.db.rows import RunRow, SeriesRow
from auditor.contract.models import StatisticSpec


@dataclass(frozen=True, slots=True)
class Topology:
    """A run's topology (DESIGN.md §3.1): dense sizes (dp, cp, tp, pp), the expert
    factorisation (edp, ep, etp, pp) if any, the rank order if known, known/unknown."""

    world_size: int
    sizes: tuple[int, int, int, int]
    expert: tuple[int, int, int, int] | None = None
    order: str | None = None
    known: bool = True
    #: where the layout came from (``topology_source``): words fix hints, never a conflict
    source: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, world_size: int, sizes, order: str | None, topology: str, source: str | None = None) -> "Topology":
        """From wire fields (a :class:`auditor.contract.models.Sizes`; ``order`` validated, kept in
        its canonical spelling, :func:`auditor.layout.canonical_order`); an unknown topology
        keeps the world size only."""
        if topology == "unknown":
            return cls(world_size, (1, 1, 1, 1), None, None, False, source)
        return cls(world_size, sizes.as_tuple(), sizes.expert_tuple(), layout.canonical_order(order), True, source)

    @classmethod
    def of_row(cls, r: RunRow) -> "Topology":
        """From a stored run (its order as stored before orders were canonical, too)."""
        return cls(r.world_size, r.sizes, r.expert, stored_order(r.order), r.known, r.source)

    def describe(self) -> dict:
        """``world_size``, ``sizes`` (expert ones too) and, when set, ``order`` / ``topology: unknown``."""
        out: dict = {"world_size": self.world_size, "sizes": dict(zip(DIMS, self.sizes))}
        if self.expert is not None:
            out["sizes"].update(zip(("edp", "ep", "etp"), self.expert[:3]))
        if self.order:
            out["order"] = self.order
        if not self.known:
            out["topology"] = "unknown"
        return out

    def dims_sizes(self, spec: core.Spec) -> tuple[tuple[str, ...], tuple[int, int, int, int]]:
        """The statistic's factorisation: its dims and their sizes."""
        if spec.factorisation == "expert" and self.expert is not None:
            return EXPERT_DIMS, self.expert
        return DIMS, self.sizes

    def placed(self, spec: core.Spec) -> dict[str, list[int]]:
        """The placed coordinates per dim (``{}``: every rank)."""
        if not spec.placement or not self.known:
            return {}
        dims, sizes = self.dims_sizes(spec)
        return spec.placed(dict(zip(dims, sizes)))

    def placed_count(self, spec: core.Spec) -> int:
        """Ranks that hold the statistic (the world unless ``spec.placement``, or the ranks of
        a fingerprint's ``replica_groups``)."""
        if spec.replica_groups is not None:
            return len({r for g in spec.replica_groups for r in g})
        placed = self.placed(spec)
        if not placed:
            return self.world_size
        dims, sizes = self.dims_sizes(spec)
        return core.placed_count(self.world_size, sizes, dims, placed)

    def audit_args(self) -> dict:
        """The topology keywords of :func:`auditor.core.audit_step`."""
        return {"expert_sizes": self.expert, "order": self.order, "topology": "known" if self.known else "unknown",
                "world_size": self.world_size, "source": self.source}


@dataclass(frozen=True, slots=True)
class SeriesInfo:
    """A (run, statistic) as the flows use it: the wire spec (for conflict checks) and the
    engine's spec (for audits)."""

    id: int
    run_id: str
    statistic: str
    kind: str
    spec: StatisticSpec
    engine_spec: core.Spec

    @classmethod
    def of(cls, row: SeriesRow) -> "SeriesInfo":
        """From a stored series (its spec validated as the wire's)."""
        spec = StatisticSpec(**row.spec)
        return cls(row.id, row.run_id, row.statistic, row.kind, spec, spec.to_core())


def stored_order(order: str | None) -> str | None:
    """A stored order in its canonical spelling; one that no longer parses as it was."""
    try:
        return layout.canonical_order(order)
    except ValueError:
        return order
