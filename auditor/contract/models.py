"""The pydantic models of the wire (DESIGN.md §3): what trainers send (``POST /v1/reports``,
``PUT /v1/runs/{run_id}``) and the ingest's answer.

They are the one source of the 422 wording (every error names the field, pydantic's
``loc``, and the rule) and of the OpenAPI schema. The report blocks' fields come from
:mod:`auditor.contract.fields` (:func:`model_of`), their rules from
:mod:`auditor.contract.values` and :mod:`auditor.contract.rules`, raised at the field they
blame (:func:`located`). NaN and Inf are accepted in every statistic: they are a training
fault the audit reports (``non_finite``), not a client error.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model,
                      field_validator, model_validator)

from auditor.contract import fields as F
from auditor.contract.fields import MAX_ORDER, CoordsAPI, Dim, Kind, SizesAPI, Topology, WireField
from auditor.contract.names import StatisticName
from auditor.contract.rules import (FINGERPRINT_K, FINGERPRINT_SPEC_FIELDS, fingerprint_spec_rules,
                                    normalised_placement, registration_rules, report_rules, spec_field_rules,
                                    spec_kind_rules)
from auditor.contract.values import RuleError, applied_rules, is_empty_identity, local_rules, range_error
from auditor.core.types import DIMS, Spec


def located(title: str, rules, obj, *args) -> None:
    """Run ``rules(obj, *args)``; a :class:`RuleError` becomes a ``value_error`` at its
    ``loc`` (a ValidationError raised in a validator keeps its locations, under the
    validated object's own: pydantic-core >= 2.x), worded as the ValueError it was."""
    try:
        rules(obj, *args)
    except RuleError as e:
        value = obj
        for part in e.loc:
            value = getattr(value, part, None)
        raise ValidationError.from_exception_data(title, [{"type": "value_error", "loc": e.loc, "input": value,
                                                           "ctx": {"error": ValueError(str(e))}}]) from None


#: The bounded integers of the wire as pydantic types (the tables' ``ge``/``le``).
NonNegInt = Annotated[int, Field(ge=0, le=F.MAX_INT)]
Step = Annotated[int, Field(ge=0, le=F.MAX_STEP)]
PosInt = Annotated[int, Field(ge=1, le=F.MAX_SIZE)]


class _Strict(BaseModel):
    # strict: "1" or true is not a step, 2.5 is not a rank (floats still accept integers)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _annotation(f: WireField, blocks: dict[str, type]) -> Any:
    """The pydantic type of a table field: its type (a block resolved in ``blocks``) with
    its bounds, pattern and ``after`` check, ``| None`` when optional."""
    if isinstance(f.type, str):
        t = blocks[f.type]
    elif f.type is list:
        t = list[Annotated[f.item_type, Field(ge=f.item_ge, le=f.item_le)]]
    else:
        t = f.type
    meta: list = []
    if (f.bounds and f.type is not list) or f.pattern:  # a list's length: on the field (model_of)
        meta.append(Field(**f.bounds, **({"pattern": f.pattern} if f.pattern else {})))
    if f.after is not None:
        meta.append(AfterValidator(f.after))
    if meta:
        t = Annotated[(t, *meta)]
    return Optional[t] if f.optional else t


def model_of(name: str, base: type[BaseModel], table: tuple[WireField, ...], blocks: dict[str, type]) -> type:
    """The pydantic model ``name`` of a block: ``base`` (its docstring, validators and
    methods) with the fields of ``table`` (:mod:`auditor.contract.fields`); nested blocks
    are looked up in ``blocks`` by name."""
    fields: dict[str, Any] = {}
    for f in table:
        if f.default is F.BLOCK_DEFAULT:
            info = Field(default_factory=blocks[f.type], description=f.description)
        else:
            info = Field(f.default, description=f.description, **(f.bounds if f.type is list else {}))
        fields[f.name] = (_annotation(f, blocks), info)
    return create_model(name, __base__=base, __module__=__name__, __doc__=base.__doc__, **fields)


class StatisticSpec(_Strict):
    """How a statistic must be reduced (DESIGN.md §3).

    ``reduce_over``: dims whose ranks form one reduction group (a rank's expected group is
    every rank equal to it on the other dims). ``replicas``: dims along which ranks hold the
    same data, counted once. ``variance``: Bessel-corrected (``sample``) or ``population``.
    ``over_microbatches``: a ``sum`` statistic is summed over all microbatches of the step.

    Kind ``fingerprint`` (replica drift, docs/replica-drift.md) reads instead: the replica
    group the tensor must agree over, ``replicate_over`` (dims: ranks equal on every other
    dim hold the same tensor) or ``replica_groups`` (disjoint lists of ranks, e.g. the first
    and last stage of a tied embedding); ``agreement`` (``bitwise``: digests and numel equal,
    needs the digests; ``rounding``: within the documented rounding tolerance; null:
    bitwise when the fingerprint carries digests); ``k`` projections (1 … 13, default 8) and
    the projection ``seed`` (default 0). A spec naming any of them is a fingerprint spec:
    ``replicate_over`` defaults to ``["dp"]``, ``reduce_over`` and ``replicas`` are empty.
    """

    reduce_over: list[Dim] = Field(default_factory=lambda: ["dp", "cp"], max_length=len(DIMS))
    replicas: list[Dim] = Field(default_factory=lambda: ["tp"], max_length=len(DIMS))
    variance: Literal["sample", "population"] = "sample"
    over_microbatches: bool = False
    #: Where the statistic lives (DESIGN.md §3.1): dim → coordinates; "first"/"last" are
    #: stored as [0]/[-1]; negative coordinates count from the end. {} = every rank.
    placement: dict[Dim, Literal["first", "last"] | Annotated[list[Annotated[int, Field(ge=-(1 << 20), le=1 << 20)]],
                                                             Field(min_length=1, max_length=1 << 12)]] = Field(
        default_factory=dict)
    #: ``norm``: dims along which ``replicated_sum_sq`` is identical; None = the whole group (v1).
    replicated_along: list[Dim] | None = None
    #: ``fingerprint``: the dims the tensor is replicated over (exclusive with ``replica_groups``).
    replicate_over: list[Dim] | None = Field(None, max_length=len(DIMS) + 3)
    #: ``fingerprint``: explicit replica groups, disjoint lists of ranks.
    replica_groups: list[Annotated[list[NonNegInt], Field(min_length=1, max_length=F.MAX_GROUP)]] | None = Field(
        None, min_length=1, max_length=F.MAX_GROUP)
    #: ``fingerprint``: ``bitwise`` or ``rounding``; None: bitwise when the fingerprint has digests.
    agreement: Literal["bitwise", "rounding"] | None = None
    #: ``fingerprint``: projections per fingerprint.
    k: Annotated[int, Field(ge=1, le=F.FINGERPRINT_K_MAX)] | None = None
    #: ``fingerprint``: the projections' seed (the same on every rank).
    seed: Annotated[int, Field(ge=0, le=F.MAX_INT)] | None = None

    @model_validator(mode="after")
    def _unique_dims(self) -> "StatisticSpec":
        if self.placement:
            object.__setattr__(self, "placement", normalised_placement(self.placement))
        if self.is_fingerprint:
            located("StatisticSpec", fingerprint_spec_rules, self)
            if self.replicate_over is None and self.replica_groups is None:
                object.__setattr__(self, "replicate_over", ["dp"])
            object.__setattr__(self, "k", FINGERPRINT_K if self.k is None else self.k)
            object.__setattr__(self, "seed", 0 if self.seed is None else self.seed)
            object.__setattr__(self, "reduce_over", [])
            object.__setattr__(self, "replicas", [])
        located("StatisticSpec", spec_field_rules, self, "replicas" in self.model_fields_set)
        return self

    @property
    def is_fingerprint(self) -> bool:
        """Whether the spec names a replica group, agreement, k or seed (kind ``fingerprint``)."""
        return any(getattr(self, f) is not None for f in FINGERPRINT_SPEC_FIELDS)

    def to_core(self) -> Spec:
        """The audit engine's :class:`auditor.core.types.Spec` (dims in the order given)."""
        return Spec(tuple(self.reduce_over), tuple(self.replicas), self.variance, self.over_microbatches,
                    tuple((d, tuple(sel)) for d, sel in self.placement.items()),
                    None if self.replicated_along is None else tuple(self.replicated_along),
                    None if self.replicate_over is None else tuple(self.replicate_over),
                    None if self.replica_groups is None else tuple(tuple(g) for g in self.replica_groups),
                    self.agreement, self.k, self.seed)

    @property
    def factorisation(self) -> str:
        """``"expert"`` when the spec names edp, ep or etp, else ``"dense"``."""
        return self.to_core().factorisation

    def placed(self, sizes: dict[str, int]) -> dict[str, list[int]]:
        """``placement`` with negative coordinates resolved against ``sizes``; raises
        ValueError naming the dim for a coordinate outside [-size, size)."""
        return self.to_core().placed(sizes)


DEFAULT_SPECS: dict[str, StatisticSpec] = {
    "moments": StatisticSpec(),
    "sum": StatisticSpec(),
    "norm": StatisticSpec(reduce_over=["tp", "pp"], replicas=["dp", "cp"]),
    "fingerprint": StatisticSpec(replicate_over=["dp"]),
}


class _Coords(_Strict, CoordsAPI):
    """A rank's coordinate along each parallel dimension (0-based): dense dp, cp, tp, pp
    and, with expert parallelism, expert edp, ep, etp (DESIGN.md §3.1)."""


class _Sizes(_Strict, SizesAPI):
    """Size of each parallel dimension; world_size is the product dp·cp·tp·pp, and also
    edp·ep·etp·pp when any expert size is given (the expert factorisation, DESIGN.md §3.1)."""


class _LocalStats(_Strict):
    """This rank's own masked statistics before the all-reduce (float64 recommended).

    ``moments``: count, sum, sum_sq required (min, max optional). ``sum``: sum required.
    ``norm``: sum_sq required, replicated_sum_sq optional. ``fingerprint``: fingerprint
    required, nothing else. With count 0, ``min = +Infinity``
    and ``max = -Infinity`` (the identities of min/max reductions) are read as null
    (:func:`~auditor.contract.values.is_empty_identity`).
    """

    @field_validator("min", "max", check_fields=False)
    @classmethod
    def _range(cls, v: float | None, info: ValidationInfo) -> float | None:
        d = info.data
        if v is not None and is_empty_identity(info.field_name, v, d.get("count")):
            return None  # no min/max, as null (stored NULL, not non_finite)
        msg = range_error(info.field_name, v, d.get("count"), d.get("sum"), d.get("sum_sq"), d.get("min"),
                          weighted=d.get("weighted", False))
        if msg:
            raise ValueError(msg)
        return v

    @model_validator(mode="after")
    def _rules(self) -> "_LocalStats":
        located("LocalStats", local_rules, self)
        return self


class _AppliedStats(_Strict):
    """What the rank's all-reduce returned, and optionally the mean/var it whitened with."""

    @model_validator(mode="after")
    def _rules(self) -> "_AppliedStats":
        located("AppliedStats", applied_rules, self)
        return self


class _Report(_Strict):
    """One rank's statistics of one (run, statistic, step, microbatch); see DESIGN.md §3.

    ``applied`` is ``null`` when the rank did not take part in the collective
    (``skipped_collective``). ``group_ranks`` is ``dist.get_process_group_ranks(group)`` of
    the group the rank reduced over, if the client knows it.
    """

    #: Not a field: whether every float of the report is known to be finite (no: the
    #: pydantic path reads NaN and Infinity; :class:`~auditor.contract.fast.FastReport` says yes).
    values_finite: ClassVar[bool] = False

    @model_validator(mode="after")
    def _topology(self) -> "_Report":
        located("Report", report_rules, self)
        return self

    @property
    def effective_spec(self) -> StatisticSpec:
        return self.spec or DEFAULT_SPECS[self.kind]


_BLOCKS: dict[str, type] = {"StatisticSpec": StatisticSpec}
Coords = _BLOCKS["Coords"] = model_of("Coords", _Coords, F.COORDS, _BLOCKS)
Sizes = _BLOCKS["Sizes"] = model_of("Sizes", _Sizes, F.SIZES, _BLOCKS)
LocalStats = _BLOCKS["LocalStats"] = model_of("LocalStats", _LocalStats, F.LOCAL, _BLOCKS)
AppliedStats = _BLOCKS["AppliedStats"] = model_of("AppliedStats", _AppliedStats, F.APPLIED, _BLOCKS)
Report = _BLOCKS["Report"] = model_of("Report", _Report, F.REPORT, _BLOCKS)


class ReportBatch(_Strict):
    """Body of ``POST /v1/reports``: 1 to ``max_batch`` (default 10,000) reports."""

    reports: list[Report] = Field(min_length=1)  # type: ignore[valid-type]


class StatisticRegistration(_Strict):
    kind: Kind = "moments"
    spec: StatisticSpec | None = None

    @model_validator(mode="after")
    def _kind_and_spec(self) -> "StatisticRegistration":
        if self.spec is not None:
            located("StatisticRegistration", lambda reg: spec_kind_rules(reg.kind, reg.spec), self)
        return self


class RunRegistration(_Strict):
    """Body of ``PUT /v1/runs/{run_id}``: fixes the topology (and optionally statistic specs)."""

    world_size: PosInt
    sizes: Sizes = Field(default_factory=Sizes)  # type: ignore[valid-type]
    order: Annotated[str, Field(max_length=MAX_ORDER)] | None = None
    topology: Topology = "known"
    statistics: dict[StatisticName, StatisticRegistration] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _world(self) -> "RunRegistration":
        located("RunRegistration", registration_rules, self)
        return self


class IngestResult(BaseModel):
    """Answer to ``POST /v1/reports``."""

    accepted: int = Field(description="Reports stored by this request.")
    duplicates: int = Field(description="Identical re-sends of stored reports (no-ops).")
    steps_audited: int = Field(description="Steps this request completed and audited.")
