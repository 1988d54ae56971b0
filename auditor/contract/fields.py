"""One table per wire block of ``POST /v1/reports``: each field's name, type, bounds and
default, declared once. Both decoders are built from these tables: the pydantic models
(:func:`auditor.contract.models.model_of`: the 422 wording and the OpenAPI schema) and the
msgspec structs (:func:`auditor.contract.fast.struct_of`: the fast decoder), so a field
added, bounded or defaulted here is so on both paths (tests/contract/test_decode.py proves
them equal on random bodies).

A block's methods that the service reads (coordinates and sizes as tuples, the expert
factorisation) are here too, as mixins both classes of a block inherit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from auditor.config import WIRE_MAX_SIZE
from auditor.contract.names import HOST_PATTERN, NAME_MAX, RUN_ID_PATTERN, SOURCE_PATTERN, STATISTIC_PATTERN, addressable
from auditor.core.stats import UNIT_ROUNDOFF

Dim = Literal["dp", "cp", "tp", "pp", "edp", "ep", "etp"]
Kind = Literal["moments", "sum", "norm", "fingerprint"]
DType = Literal["float64", "float32", "tf32", "float16", "bfloat16"]
Topology = Literal["known", "unknown"]
assert set(DType.__args__) == set(UNIT_ROUNDOFF)  # type: ignore[attr-defined]

#: Largest rank, coordinate or microbatch index (an INTEGER column).
MAX_INT = 2**31 - 1
#: Steps are BIGINT in the database; 2^62 leaves room and is exact in float64 JSON parsers.
MAX_STEP = 2**62
#: Largest size of a dimension, world_size, num_microbatches, and longest group_ranks.
MAX_SIZE = MAX_GROUP = WIRE_MAX_SIZE
#: Longest Megatron order string.
MAX_ORDER = 32
#: Projections of a fingerprint (``kind: fingerprint``, ``spec.k``): 1 … 13 (3 + 13 values
#: fill a deferred report's ring slot of 16; docs/replica-drift.md).
FINGERPRINT_K_MAX = 13
#: Longest ``local.fingerprint``: numel, Σx, Σx², k projections, two digests.
FINGERPRINT_MAX = 5 + FINGERPRINT_K_MAX

#: ``default`` of a required field.
REQUIRED: Any = ...
#: ``default`` of a nested block that defaults to the block with every field at its default.
BLOCK_DEFAULT: Any = object()


@dataclass(frozen=True)
class WireField:
    """One field of a wire block.

    ``type``: ``int``, ``float``, ``bool``, ``str``, a ``Literal``, ``list`` (of ``int``
    items bounded by ``item_ge``/``item_le``), or the name of another block (``"Coords"``,
    resolved by each builder to its own class). ``optional``: ``None`` is accepted too.
    ``ge``/``le`` bound a number, ``min_length``/``max_length`` a text or a list;
    ``pattern`` (an anchored regex) and ``after`` (a check returning the value or raising
    ValueError) are applied by pydantic on the field and by the fast decoder once per
    distinct text for the whole batch (:func:`auditor.contract.fast.batch_holds`).
    ``raw``: the fast decoder keeps the JSON text and decodes it per distinct text
    (``spec``, ``group_ranks``). ``description``: OpenAPI's."""

    name: str
    type: Any
    default: Any = REQUIRED
    optional: bool = False
    ge: int | None = None
    le: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    after: Callable[[Any], Any] | None = None
    item_ge: int | None = None
    item_le: int | None = None
    item_type: Any = int
    raw: bool = False
    description: str | None = None

    @property
    def bounds(self) -> dict[str, int]:
        """The numeric and length bounds that are set (``ge``, ``le``, ``min_length``, ``max_length``)."""
        return {k: v for k in ("ge", "le", "min_length", "max_length") if (v := getattr(self, k)) is not None}


def _index(name: str, default: Any = 0) -> WireField:
    return WireField(name, int, default, ge=0, le=MAX_INT)


def _size(name: str, default: Any = 1, optional: bool = False) -> WireField:
    return WireField(name, int, default, optional=optional, ge=1, le=MAX_SIZE)


def _number(name: str) -> WireField:
    return WireField(name, float, None, optional=True)


COORDS = (_index("dp"), _index("cp"), _index("tp"), _index("pp"), _index("edp"), _index("ep"), _index("etp"))

SIZES = (_size("dp"), _size("cp"), _size("tp"), _size("pp"),
         _size("edp", None, True), _size("ep", None, True), _size("etp", None, True))

LOCAL = (
    _number("count"), _number("sum"), _number("sum_sq"),
    # Declared before min/max: their rules read it.
    WireField("weighted", bool, False, description=(
        "true when the mask weights elements (a floating mask with an entry other than 0 or 1: count = Σm, "
        "sum = Σm·v, sum_sq = Σm·v², min/max over m != 0). It turns off the ingest rule "
        "|min|, |max| <= √sum_sq, which holds only for 0/1 masks (values (3, 0) with weights (0.5, 0.5) have "
        "sum_sq 4.5 < 3²); min <= max and the mean within [min, max] still apply. Not stored. The hooks "
        "(masked_moments) set it.")),
    _number("min"), _number("max"), _number("replicated_sum_sq"),
    WireField("fingerprint", list, None, optional=True, min_length=4, max_length=FINGERPRINT_MAX, item_type=float,
              description=(
                  "kind 'fingerprint' only: [numel, sum, sum_sq, p_0 … p_{k-1}] and, with exact digests, [d_0, d_1] "
                  "(auditor.trainer.fingerprint; 3 + k or 5 + k values, k = spec.k). numel a non-negative integer, "
                  "digests integers in [0, 2^31). docs/replica-drift.md.")),
)

APPLIED = (_number("count"), _number("sum"), _number("sum_sq"), _number("mean"), _number("var"))

REPORT = (
    WireField("run_id", str, min_length=1, max_length=NAME_MAX, pattern=RUN_ID_PATTERN, after=addressable),
    WireField("statistic", str, min_length=1, max_length=NAME_MAX, pattern=STATISTIC_PATTERN, after=addressable),
    WireField("step", int, ge=0, le=MAX_STEP),
    _index("microbatch"),
    _size("num_microbatches"),
    _index("rank", REQUIRED),
    _size("world_size", REQUIRED),
    WireField("coords", "Coords", BLOCK_DEFAULT),
    WireField("sizes", "Sizes", BLOCK_DEFAULT),
    WireField("local", "LocalStats"),
    WireField("applied", "AppliedStats", None, optional=True),
    # the reports of a step mostly carry the same group: the fast decoder decodes and
    # checks each distinct text once and shares the list (4 kB of JSON at 1,024 ranks)
    WireField("group_ranks", list, None, optional=True, max_length=MAX_GROUP, item_ge=0, item_le=MAX_INT, raw=True),
    WireField("dtype", DType, "float32"),
    WireField("kind", Kind, "moments"),
    # pydantic-validated on both paths (a run's reports repeat a few specs)
    WireField("spec", "StatisticSpec", None, optional=True, raw=True),
    # Megatron's rank order, fastest-varying dim first (DESIGN.md §3.1); optional.
    WireField("order", str, None, optional=True, max_length=MAX_ORDER),
    # "unknown": the trainer does not know its coordinates; judged from group_ranks alone.
    WireField("topology", Topology, "known"),
    # Where the rank's layout came from (``megatron.core.parallel_state``, ``megatron.core.mpu``,
    # ``device_mesh``, ``AUDITOR_TOPOLOGY``, ... or why none: DESIGN.md §3.1); informational.
    WireField("topology_source", str, None, optional=True, pattern=SOURCE_PATTERN),
    # The rank's host name, named by replica_divergence findings (kind 'fingerprint'); optional.
    WireField("host", str, None, optional=True, pattern=HOST_PATTERN),
)

#: Every block by the name its fields use.
BLOCKS = {"Coords": COORDS, "Sizes": SIZES, "LocalStats": LOCAL, "AppliedStats": APPLIED, "Report": REPORT}
#: Every block's fields by name.
BLOCK_FIELDS = {block: {f.name: f for f in table} for block, table in BLOCKS.items()}


class CoordsAPI:
    """What the service reads of a report's coordinates, shared by
    :class:`~auditor.contract.models.Coords` and the fast decoder's struct."""

    __slots__ = ()

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.dp, self.cp, self.tp, self.pp)

    def expert_tuple(self) -> tuple[int, int, int, int]:
        return (self.edp, self.ep, self.etp, self.pp)

    @property
    def is_origin(self) -> bool:
        """Every coordinate 0 (what a report without ``coords`` has)."""
        return not (self.dp or self.cp or self.tp or self.pp or self.edp or self.ep or self.etp)


class SizesAPI:
    """What the service reads of a report's sizes, shared by
    :class:`~auditor.contract.models.Sizes` and the fast decoder's struct."""

    __slots__ = ()

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.dp, self.cp, self.tp, self.pp)

    @property
    def has_expert(self) -> bool:
        return self.edp is not None or self.ep is not None or self.etp is not None

    def expert_tuple(self) -> tuple[int, int, int, int] | None:
        """(edp, ep, etp, pp), or None without the expert factorisation."""
        if not self.has_expert:
            return None
        return (self.edp or 1, self.ep or 1, self.etp or 1, self.pp)

    def as_dict(self) -> dict[str, int]:
        """Every given size (expert ones only with the expert factorisation)."""
        out = {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp}
        e = self.expert_tuple()
        if e is not None:
            out.update(edp=e[0], ep=e[1], etp=e[2])
        return out

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def is_default(self) -> bool:
        """All dense sizes 1 and no expert factorisation (what a report without ``sizes`` has)."""
        return self.dp == self.cp == self.tp == self.pp == 1 and not self.has_expert
