"""The machinery of the read documents (:mod:`auditor.contract.reads`,
:mod:`auditor.contract.workloads`): the base class :class:`_Document` whose ``from_json`` /
``to_json`` follow the dataclass fields' annotations, :class:`ShapeError`, :data:`OMIT_NONE`
and :func:`declared`. Standard library only."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Mapping

__all__ = ["OMIT_NONE", "ShapeError", "declared"]


#: ``field(metadata=OMIT_NONE)``: ``to_json`` leaves the field out when it is None.
OMIT_NONE: Mapping[str, bool] = types.MappingProxyType({"omit_none": True})


class ShapeError(TypeError):
    """A JSON document that is not the one a dataclass reads (a field of the wrong type,
    one missing, not an object)."""


class _Document:
    """Base of the read documents: :meth:`from_json` and :meth:`to_json` from the dataclass
    fields' annotations."""

    @classmethod
    def from_json(cls, data: Any):
        """The document of a JSON object (see the module docstring); :class:`ShapeError`
        when ``data`` is not one."""
        return _build(cls, data)

    def to_json(self) -> dict[str, Any]:
        """The document as a JSON object: every field (nested documents too; an
        :data:`OMIT_NONE` field only when set), then ``extra``."""
        return _to_json(self)


def _to_json(obj: Any) -> Any:
    if isinstance(obj, _Document):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name != "extra" and not (value is None and f.metadata.get("omit_none")):
                out[f.name] = _to_json(value)
        out.update(getattr(obj, "extra", None) or {})
        return out
    if isinstance(obj, list):
        return [_to_json(x) for x in obj]
    return obj


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
    return {name: hint for name, hint in typing.get_type_hints(cls).items() if name != "extra"}


@functools.cache
def _json_fields(cls) -> dict[str, tuple[tuple[type, ...], Any]]:
    """Per field of ``cls``: the JSON types it accepts, from its annotation (``int``, not a
    bool; ``float``, an int too; ``str``, ``bool``, ``list``, ``dict``; None for
    ``X | None``; ``Any`` anything; a document an object, a list of documents a list), and
    the converter of a nested document (its ``from_json``, or :func:`_objects`) or None."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
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
