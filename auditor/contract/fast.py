"""The fast decoder of ``POST /v1/reports`` (docs/performance.md "Decode").

The same contract as the pydantic models (:mod:`auditor.contract.models`), as msgspec
structs built from the same field tables (:mod:`auditor.contract.fields`,
:func:`struct_of`): a body is decoded straight into them (no intermediate dicts, ~5x less
CPU per report than pydantic) and checked by the same rule functions
(:mod:`auditor.contract.values`, :mod:`auditor.contract.rules`), per batch
(:func:`batch_holds`). A body they refuse, for whatever reason, is validated again by
pydantic, which words the errors: the pydantic models stay the one source of the messages
and of the OpenAPI schema, and these structs accept exactly the bodies pydantic accepts,
with equal values (tests/contract/test_decode.py checks both on random bodies). msgspec
refuses a few bodies pydantic accepts (``NaN``/``Infinity`` tokens, numbers beyond float
range): those take the pydantic path.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re
from typing import Annotated, Any, ClassVar, Optional

import msgspec
import numpy as np
import pydantic_core

from auditor.contract import fields as F
from auditor.contract.fields import CoordsAPI, SizesAPI, WireField
from auditor.contract.models import StatisticSpec
from auditor.contract.names import HOST_RE, RUN_ID_RE, SOURCE_RE, STATISTIC_RE, addressable
from auditor.contract.rules import group_rules, ranks_facts, report_rules, shape_rules
from auditor.contract.values import (MEAN_ABS, MEAN_COUNT, MEAN_REL, RANGE_ABS, RANGE_REL, WEIGHTED_TERMS,
                                     applied_rules, local_rules)
from auditor.core.types import Spec


class _Fast(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Base of the fast decoder's structs: unknown fields refused (``extra="forbid"``), not
    tracked by the cyclic GC (they make no reference cycles)."""


def _fast_type(f: WireField, blocks: dict[str, type]) -> Any:
    """The msgspec type of a table field: its type (a block resolved in ``blocks``) with its
    bounds, ``| None`` when optional; ``msgspec.Raw`` for a ``raw`` field. Patterns and
    ``after`` checks are left to :func:`batch_holds` (once per distinct text)."""
    if f.raw:
        return msgspec.Raw
    if isinstance(f.type, str):
        t = blocks[f.type]
    elif f.type is list:
        t = list[Annotated[f.item_type, msgspec.Meta(ge=f.item_ge, le=f.item_le)]]
    else:
        t = f.type
    if f.bounds:
        t = Annotated[t, msgspec.Meta(**f.bounds)]
    return Optional[t] if f.optional else t


def struct_of(name: str, base: type, table: tuple[WireField, ...], blocks: dict[str, type], frozen: bool) -> type:
    """The msgspec struct ``name`` of a block: ``base`` (its docstring and methods) with the
    fields of ``table`` (:mod:`auditor.contract.fields`), keyword-only, unknown fields
    refused; nested blocks are looked up in ``blocks`` by name."""
    fields: list[tuple] = []
    for f in table:
        t = _fast_type(f, blocks)
        if f.default is F.REQUIRED:
            fields.append((f.name, t))
        else:
            fields.append((f.name, t, blocks[f.type]() if f.default is F.BLOCK_DEFAULT else f.default))
    return msgspec.defstruct(name, fields, bases=(base,), module=__name__, namespace={"__doc__": base.__doc__},
                             kw_only=True, frozen=frozen, forbid_unknown_fields=True, gc=False)


class _FastCoords(_Fast, CoordsAPI, frozen=True):
    """:class:`~auditor.contract.models.Coords` as decoded by :func:`decode_report_batch`."""


class _FastSizes(_Fast, SizesAPI, frozen=True):
    """:class:`~auditor.contract.models.Sizes` as decoded by :func:`decode_report_batch`."""


class _FastLocal(_Fast, frozen=True):
    """:class:`~auditor.contract.models.LocalStats` as decoded by :func:`decode_report_batch`
    (integers become floats, as in pydantic). Its rules
    (:func:`~auditor.contract.values.local_rules`) are checked for the whole batch by
    :func:`batch_holds`, not on construction."""


class _FastApplied(_Fast, frozen=True):
    """:class:`~auditor.contract.models.AppliedStats` as decoded by :func:`decode_report_batch`
    (rules: :func:`batch_holds`)."""


class _FastReport(_Fast):
    """:class:`~auditor.contract.models.Report` as decoded by :func:`decode_report_batch`:
    the same attributes (and ``coords``/``sizes`` methods) the service reads. ``spec`` and
    ``group_ranks`` are decoded as their raw JSON text (``null`` too) and replaced by
    :func:`batch_holds` with their value (a :class:`StatisticSpec` or None; a list of ranks,
    one list object per distinct text, not to be changed, or None). The rules are
    :class:`~auditor.contract.models.Report`'s, checked for the whole batch by
    :func:`batch_holds` (not on construction: a struct made by hand is not checked)."""

    #: Not a field: msgspec reads no NaN or Infinity token nor a number beyond float range,
    #: so every float of a fast-decoded report is finite (:func:`auditor.db.store.report_row`
    #: need not look for non-finite values).
    values_finite: ClassVar[bool] = True


_BLOCKS: dict[str, type] = {}
FastCoords = _BLOCKS["Coords"] = struct_of("FastCoords", _FastCoords, F.COORDS, _BLOCKS, frozen=True)
FastSizes = _BLOCKS["Sizes"] = struct_of("FastSizes", _FastSizes, F.SIZES, _BLOCKS, frozen=True)
FastLocal = _BLOCKS["LocalStats"] = struct_of("FastLocal", _FastLocal, F.LOCAL, _BLOCKS, frozen=True)
FastApplied = _BLOCKS["AppliedStats"] = struct_of("FastApplied", _FastApplied, F.APPLIED, _BLOCKS, frozen=True)
FastReport = _BLOCKS["Report"] = struct_of("FastReport", _FastReport, F.REPORT, _BLOCKS, frozen=False)


class TextCache:
    """Decoded values by their JSON text, bounded in entries and in text bytes (a body may
    hold megabytes of one field): emptied when either bound would be passed; a text longer
    than a quarter of the bytes is decoded every time. Dict operations only, safe across
    the worker threads that decode bodies (their races can only blur the byte count)."""

    def __init__(self, entries: int, text_bytes: int):
        self.entries, self.text_bytes = entries, text_bytes
        self.values: dict[bytes, tuple] = {}
        self.held = 0

    def get(self, key: bytes, make) -> tuple:
        hit = self.values.get(key)
        if hit is None:
            hit = make(key)
            if len(key) <= self.text_bytes // 4:
                if len(self.values) >= self.entries or self.held + len(key) > self.text_bytes:
                    self.values.clear()
                    self.held = 0
                self.values[key] = hit
                self.held += len(key)
        return hit


def _make_spec(text: bytes) -> tuple[StatisticSpec | None, Spec | None]:
    obj = pydantic_core.from_json(text, allow_inf_nan=True)
    spec = None if obj is None else StatisticSpec.model_validate(obj, strict=True)
    return spec, None if spec is None else spec.to_core()


#: A run's reports repeat one spec (a few distinct ones).
_SPECS = TextCache(256, 4 << 20)


def spec_of(raw: msgspec.Raw) -> tuple[StatisticSpec | None, Spec | None]:
    """The :class:`StatisticSpec` (validated by pydantic, strict, as in a
    :class:`~auditor.contract.models.Report`)
    and its engine spec of a report's raw ``spec`` JSON; ``(None, None)`` for ``null``."""
    return _SPECS.get(bytes(raw), _make_spec)


#: ``group_ranks`` as the table declares it (not raw): null or a bounded list of ranks.
_RANKS_LIST = msgspec.json.Decoder(_fast_type(dataclasses.replace(F.BLOCK_FIELDS["Report"]["group_ranks"], raw=False),
                                              {}))


def _make_ranks(text: bytes) -> tuple[list[int] | None, tuple[bool, int] | None]:
    ranks = _RANKS_LIST.decode(text)
    return ranks, None if ranks is None else ranks_facts(ranks)


#: The reports of a step mostly carry one group (4 kB of JSON at 1,024 ranks).
_RANKS = TextCache(256, 32 << 20)


def ranks_of(raw: msgspec.Raw) -> tuple[list[int] | None, tuple[bool, int] | None]:
    """A report's raw ``group_ranks`` JSON as its list (one list object per distinct text:
    not to be changed) and :func:`ranks_facts`; ``(None, None)`` for ``null``. Raises
    msgspec.ValidationError for anything but null or a list of ranks."""
    return _RANKS.get(bytes(raw), _make_ranks)


class _FastBatch(_Fast, kw_only=True):
    reports: Annotated[list[FastReport], msgspec.Meta(min_length=1)]  # type: ignore[valid-type]


_FAST_BATCH = msgspec.json.Decoder(_FastBatch)


def decode_report_batch(body: bytes) -> list[FastReport] | None:  # type: ignore[valid-type]
    """The reports of a valid ``POST /v1/reports`` body, decoded by msgspec and checked by
    :func:`batch_holds`; None when the body breaks any rule or msgspec cannot read it
    (``NaN`` tokens, numbers beyond float range): :func:`auditor.contract.parse.parse_report_batch`
    then validates it with pydantic, which words the errors."""
    try:
        reports = _FAST_BATCH.decode(body).reports
        return reports if batch_holds(reports) else None
    except Exception:  # whatever the reason: pydantic decides and words it
        return None


class _TextRule:
    """A patterned text field of the reports (:mod:`auditor.contract.fields`: ``pattern`` and
    ``after``), checked once per distinct text: the texts that passed are remembered (at
    most ``keep``; then forgotten), ``None`` passes when the field is optional."""

    def __init__(self, f: WireField, rx: re.Pattern, keep: int):
        self.get, self.rx, self.after, self.keep = operator.attrgetter(f.name), rx, f.after, keep
        self.empty: frozenset = frozenset([None]) if f.optional else frozenset()
        self.seen: set = set(self.empty)

    def check(self, reports) -> None:
        """Raise ValueError unless every report's text matches (and passes ``after``)."""
        seen = self.seen
        if seen.issuperset(map(self.get, reports)):
            return
        for text in set(map(self.get, reports)) - seen:
            if self.rx.search(text) is None:
                raise ValueError(f"{text!r} does not match {self.rx.pattern}")
            if self.after is not None:
                self.after(text)
            if len(seen) >= self.keep:
                seen.clear()
                seen.update(self.empty)
            seen.add(text)


_TEXTS = F.BLOCK_FIELDS["Report"]
#: The patterned fields, each with its regex for Python's ``re.search`` (``names.search_pattern``).
_TEXT_RULES = (_TextRule(_TEXTS["run_id"], RUN_ID_RE, 1 << 16), _TextRule(_TEXTS["statistic"], STATISTIC_RE, 1 << 16),
               _TextRule(_TEXTS["topology_source"], SOURCE_RE, 1 << 12), _TextRule(_TEXTS["host"], HOST_RE, 1 << 16))
assert {f.name for f in F.REPORT if f.pattern} == {"run_id", "statistic", "topology_source", "host"}
assert _TEXTS["run_id"].after is _TEXTS["statistic"].after is addressable
_get_spec, _get_group_ranks = operator.attrgetter("spec"), operator.attrgetter("group_ranks")
_get_order = operator.attrgetter("order")
#: Rows of tuples as one flat iterator (``np.fromiter`` reads None as NaN and bools as 0/1).
_chain = itertools.chain.from_iterable
_get_local, _get_applied = operator.attrgetter("local"), operator.attrgetter("applied")
_get_kind = operator.attrgetter("kind")
#: What :func:`~auditor.contract.rules.shape_rules` and :func:`~auditor.contract.rules.group_rules`
#: read of a report, besides spec and group_ranks.
_SHAPE = operator.attrgetter("world_size", "rank", "microbatch", "num_microbatches", "sizes", "coords", "order",
                             "topology", "kind")
_LOCAL_VALUES = operator.attrgetter("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq", "weighted")
_APPLIED_VALUES = operator.attrgetter("count", "sum", "sum_sq", "mean")
_NO_APPLIED_VALUES = (0.0, 0.0, 0.0, 0.0)
#: Below this many reports a batch's rules are checked report by report (~2.5 µs each)
#: rather than by the array tests (~40 µs a batch, then ~1 µs a report).
BATCH_RULES_MIN = 32


def batch_holds(reports: list) -> bool:
    """Whether freshly decoded reports (:class:`FastReport`) keep every rule of
    :class:`~auditor.contract.models.Report` (and of its ``local``/``applied`` blocks);
    replaces each ``spec`` and ``group_ranks`` raw text by its value on the way. False (or an
    exception) when a rule is broken: the caller then lets pydantic validate the body, so
    this may refuse more than the models do, never less.

    The rules are checked per batch rather than per report (the per-report Python rules
    cost ~2 µs of the ~2.8 µs decode, docs/performance.md "Decode"):

    * names, specs and rank groups once per distinct text (:class:`_TextRule`, the
      ``TextCache`` caches);
    * :func:`~auditor.contract.rules.shape_rules` and :func:`~auditor.contract.rules.group_rules`
      once per distinct combination of the fields they read (a step's ranks repeat every step);
    * the value rules (:func:`~auditor.contract.values.local_rules`,
      :func:`~auditor.contract.values.applied_rules`, the fields each kind requires and
      :func:`~auditor.contract.values.check_cauchy_schwarz`) as numpy array tests over the
      batch that flag every report that could break one (:func:`_suspects`); each flagged
      report is then checked by the exact rule functions.
    """
    for rule in _TEXT_RULES:
        rule.check(reports)
    specs, ranks, cores, facts = _decode_texts(reports)

    def exact(r) -> None:  # every rule of one report, by the exact functions
        local_rules(r.local)
        if r.applied is not None:
            applied_rules(r.applied)
        report_rules(r, None if r.spec is None else cores[id(r.spec)],
                     None if r.group_ranks is None else facts[id(r.group_ranks)])

    if len(reports) < BATCH_RULES_MIN:  # the array tests cost ~40 µs a batch: each report by the exact rules
        for r in reports:
            exact(r)
        return True
    _shapes_hold(reports, specs, ranks, cores, facts)
    for i in np.flatnonzero(_suspects(reports)).tolist():
        exact(reports[i])
    return True


def _decode_texts(reports: list) -> tuple[list, list, dict[int, Spec], dict[int, tuple[bool, int]]]:
    """Replace each report's raw ``spec`` and ``group_ranks`` by its value (:func:`spec_of`,
    :func:`ranks_of`: once per distinct text). Returns the specs and rank lists (by report),
    and the engine spec by ``id`` of each :class:`StatisticSpec`, the
    :func:`~auditor.contract.rules.ranks_facts` by ``id`` of each rank list."""
    n = len(reports)
    specs = list(map(_get_spec, reports))
    ranks = list(map(_get_group_ranks, reports))
    cores: dict[int, Spec] = {}  # id(StatisticSpec) -> its engine spec
    facts: dict[int, tuple[bool, int]] = {}  # id(group_ranks list) -> ranks_facts
    if specs.count(None) != n:
        last = spec = None
        for i, raw in enumerate(specs):
            if raw is not None:
                if raw != last:  # mostly the text of the report before (compared, not hashed)
                    spec, core = spec_of(raw)
                    last = raw
                    if spec is not None:
                        cores[id(spec)] = core
                reports[i].spec = specs[i] = spec
    if ranks.count(None) != n:
        last = gr = None
        for i, raw in enumerate(ranks):
            if raw is not None:
                if raw != last:
                    gr, f = ranks_of(raw)
                    last = raw
                    if gr is not None:
                        facts[id(gr)] = f
                reports[i].group_ranks = ranks[i] = gr
    return specs, ranks, cores, facts


def _shapes_hold(reports: list, specs: list, ranks: list, cores: dict, facts: dict) -> None:
    """The shape rules of a batch: with an order, a spec or groups (the extended rules,
    ~0.8 µs a report) once per distinct combination of what they read; specs and ranks
    hold objects the reports keep alive, so their ids are theirs for the whole check. Plain
    reports are cheaper to check one by one than to hash. Raises RuleError."""
    n = len(reports)
    if cores or facts or list(map(_get_order, reports)).count(None) != n:
        keys = zip(map(_SHAPE, reports), map(id, specs), map(id, ranks))
        for i in dict(zip(keys, range(n))).values():  # an index of each distinct combination
            r = reports[i]
            shape_rules(r, None if r.spec is None else cores[id(r.spec)])
            if r.group_ranks is not None:
                group_rules(r, facts[id(r.group_ranks)])
    else:
        for r in reports:  # no spec, no group_ranks
            shape_rules(r)


def _suspects(reports: list) -> np.ndarray:
    """A bool per report: whether it could break a value rule, by array tests over the batch.
    msgspec reads only finite floats, so a NaN in these columns is a field that was absent
    (None), and the tests repeat the rules' own float operations (IEEE: the same results);
    where they would need ``log2`` (Cauchy-Schwarz) or could differ at all, they flag more
    (``Q < S²/C`` instead of the slack)."""
    n = len(reports)
    locs = list(map(_get_local, reports))
    L = np.fromiter(_chain(map(_LOCAL_VALUES, locs)), dtype=np.float64, count=7 * n).reshape(n, 7)
    count, total, total_sq, lo, hi, rep_sq, weighted = L.T
    has_count, has_sum, has_sq = ~np.isnan(count), ~np.isnan(total), ~np.isnan(total_sq)
    with np.errstate(all="ignore"):
        suspect = (count < 0) | (total_sq < 0) | (rep_sq < 0) | (lo > hi)
        # an empty mask: sum and sum_sq 0, no min/max (NaN, an absent field, compares False)
        suspect |= (count == 0) & ((np.abs(total) > 0) | (total_sq > 0) | np.isfinite(lo) | np.isfinite(hi))
        # |min|, |max| <= sqrt(sum_sq)·(1 + 2^-8) + 2^-7 unless weighted (flag or fractional count)
        wt = (weighted != 0) | (has_count & (np.floor(count) != count))
        lim = np.sqrt(total_sq) * (1.0 + RANGE_REL) + RANGE_ABS
        suspect |= ~wt & ((np.abs(lo) > lim) | (np.abs(hi) > lim))
        # the mean sum/count within [min, max] up to its slack
        on = (count > 0) & (count < MEAN_COUNT) & has_sum
        if on.any():
            mean = total / count
            terms = np.where(wt, np.maximum(count, WEIGHTED_TERMS) * 2.0, count) + 1.0
            slack_lo = terms * MEAN_REL * (np.abs(mean) + 2.0 * np.abs(lo)) + terms * MEAN_ABS
            slack_hi = terms * MEAN_REL * (np.abs(mean) + 2.0 * np.abs(hi)) + terms * MEAN_ABS
            suspect |= on & ((mean < lo - slack_lo) | (mean > hi + slack_hi))
        # Cauchy-Schwarz: its slack needs log2, so every report below the exact floor is flagged
        suspect |= (count > 0) & has_sum & has_sq & ~(total_sq >= total * total / count)
        apps = list(map(_get_applied, reports))
        missing = apps.count(None)
        if missing != n:  # an absent applied block reads as zeros: no rule applies to it
            A = np.fromiter(_chain([_NO_APPLIED_VALUES if a is None else _APPLIED_VALUES(a) for a in apps] if missing
                                   else map(_APPLIED_VALUES, apps)), dtype=np.float64, count=4 * n).reshape(n, 4)
            a_count, a_sum, a_sq, a_mean = A.T
            has_a_sum, has_a_sq = ~np.isnan(a_sum), ~np.isnan(a_sq)
            suspect |= (a_count < 0) | (a_sq < 0)
        # the fields each kind requires (applied: moments its mean, or count, sum and sum_sq)
        kinds = list(map(_get_kind, reports))
        moments = slice(None) if kinds.count("moments") == n else np.array(kinds, dtype=object) == "moments"
        suspect[moments] |= ~(has_count & has_sum & has_sq)[moments]
        if missing != n:
            suspect[moments] |= (np.isnan(a_mean) & (np.isnan(a_count) | ~has_a_sum | ~has_a_sq))[moments]
        if not isinstance(moments, slice):
            k = np.array(kinds, dtype=object)
            # a fingerprint report: every one by the exact rules (fingerprint_rules)
            suspect |= k == "fingerprint"
            suspect |= (k == "sum") & ~has_sum
            suspect |= (k == "norm") & ~has_sq
            if missing != n:
                suspect |= (k == "sum") & ~has_a_sum
                suspect |= (k == "norm") & ~has_a_sq
    return suspect
