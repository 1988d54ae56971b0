"""The machinery of the read documents (:mod:`auditor.contract.reads`,
:mod:`auditor.contract.workloads`): the base class :class:`_Document` whose ``from_json`` /
``to_json`` follow the dataclass fields' annotations, :class:`ShapeError`, :data:`OMIT_NONE`
and :func:`declared`. Standard library only."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Mapping

__all__ = ["OMIT_NONE", "ReadDocument", "ShapeError", "declared"]


#: ``field(metadata=OMIT_NONE)``: ``to_json`` leaves the field out when it is None.
OMIT_NONE: Mapping[str, bool] = types.MappingProxyType({"omit_none": True})


class ShapeError(TypeError):
    """A JSON document that is not the one a dataclass reads (a field of the wrong type,
    one missing, not an object)."""


class _Document:
    """Base of the read documents: :meth:`from_json` and :meth:`to_json` from the dataclass
    fields' annotations."""

    #: The order of the keys :meth:`to_json` writes, when not the declaration order: every
    #: field but ``extra``, once (checked on the first ``to_json``). The HTTP answers keep
    #: the key order they always had, byte for byte; the declaration order is the schema's
    #: (OpenAPI), and dataclass rules (defaults last) constrain it.
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_json(cls, data: Any):
        """The document of a JSON object (see the module docstring); :class:`ShapeError`
        when ``data`` is not one."""
        return _build(cls, data)

    def to_json(self) -> dict[str, Any]:
        """The document as a JSON object: every field in :attr:`WIRE_ORDER` (nested
        documents too; an :data:`OMIT_NONE` field only when set), then ``extra``. Lists
        and dicts of plain values are the document's own, not copies."""
        out = {}
        for name, omit, nested in _plan(type(self)):
            value = getattr(self, name)
            if value is None:
                if omit:
                    continue
            elif nested:
                value = value.to_json() if isinstance(value, _Document) else [v.to_json() for v in value]
            out[name] = value
        if self.extra:  # type: ignore[attr-defined]  # every document declares it
            out.update(self.extra)  # type: ignore[attr-defined]
        return out


#: The base of every read document (``isinstance(x, ReadDocument)``: ``x.to_json()`` is its JSON).
ReadDocument = _Document


@functools.cache
def _plan(cls) -> tuple[tuple[str, bool, bool], ...]:
    """Per key :meth:`_Document.to_json` writes, in order: (field name, left out when None,
    holds a document or a list of documents). Raises TypeError when ``cls.WIRE_ORDER`` is
    not its fields (less ``extra``) once each."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
    order = cls.WIRE_ORDER or tuple(fields)
    if sorted(order) != sorted(fields):
        raise TypeError(f"{cls.__name__}.WIRE_ORDER must name each field once: "
                        f"missing {sorted(set(fields) - set(order))}, unknown or repeated "
                        f"{sorted(n for n in order if order.count(n) > 1 or n not in fields)}")
    known = _json_fields(cls)
    return tuple((name, bool(fields[name].metadata.get("omit_none")), known[name][1] is not None) for name in order)


def _objects(cls, values: Any) -> list:
    """``[cls.from_json(v) for v in values]``; :class:`ShapeError` when ``values`` is no list."""
    if not isinstance(values, list):
        raise ShapeError(f"{cls.__name__}: a JSON list was expected, got {type(values).__name__}")
    return [cls.from_json(v) for v in values]


@functools.cache
def declared(cls) -> dict[str, Any]:
    """The declared fields of a read document class and their annotations (resolved), in
    declaration order, ``extra`` left out: the keys the service may send. For a schema
    builder (e.g. the routes' OpenAPI: drop ``extra``, which only holds undeclared keys)
    and the test that the service sends no other key."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "extra"}


@functools.cache
def _json_fields(cls) -> dict[str, tuple[tuple[type, ...], Any]]:
    """Per field of ``cls``: the JSON types it accepts, from its annotation (``int``, not a
    bool; ``float``, an int too; ``str``, ``bool``, ``list``, ``dict``; None for
    ``X | None``; ``Any`` anything; a document an object, a list of documents a list), and
    the converter of a nested document (its ``from_json``, or :func:`_objects`) or None."""
    out = {}
    hints = typing.get_type_hints(cls)
    for name in (f.name for f in dataclasses.fields(cls)):
        hint = hints[name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else (hint,)
        accepted: list[type] = []
        convert = None
        for a in args:
            inner = typing.get_args(a)
            a = typing.get_origin(a) or a
            if a is Any:
                accepted = [object]
                break
            if isinstance(a, type) and issubclass(a, _Document):
                accepted.append(dict)
                convert = a.from_json
            else:
                if a is list and inner and isinstance(inner[0], type) and issubclass(inner[0], _Document):
                    convert = functools.partial(_objects, inner[0])
                accepted += {float: [int, float], type(None): [type(None)]}.get(a, [a])
        out[name] = (tuple(accepted), convert)
    return out


def _build(cls, data: Any):
    """``cls`` from a JSON object: known fields (nested documents decoded), the rest in
    ``extra``. Missing optional fields take their defaults. Raises :class:`ShapeError` when
    ``data`` is not an object, a field is missing or of another JSON type than its
    annotation says (a bool is no number)."""
    if not isinstance(data, dict):
        raise ShapeError(f"{cls.__name__}: a JSON object was expected, got {type(data).__name__}")
    known = _json_fields(cls)
    for name, value in data.items():
        ok = known.get(name)
        if ok is not None and not (isinstance(value, ok[0]) and not (type(value) is bool and bool not in ok[0])):
            raise ShapeError(f"{cls.__name__}.{name}: {type(value).__name__} {str(value)[:80]!r} is not "
                             f"{' or '.join(t.__name__ for t in ok[0])}")
    kwargs = {k: (known[k][1](v) if known[k][1] is not None and v is not None else v)
              for k, v in data.items() if k in known and k != "extra"}
    try:
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known or k == "extra"})
    except TypeError as exc:  # a required field missing
        raise ShapeError(f"{cls.__name__}: {exc}") from None
