"""A ``POST /v1/reports`` body to reports, or to the errors that say why not: the fast
decoder first (:mod:`auditor.contract.fast`), the pydantic models for any body it refuses
(:mod:`auditor.contract.models`: they word the errors), with the number of errors bounded;
and the deployment's own limits (:func:`limit_errors`).
"""

from __future__ import annotations

import pydantic_core
from pydantic import TypeAdapter, ValidationError

from auditor.contract.fast import FastReport, decode_report_batch
from auditor.contract.models import Report, ReportBatch
from auditor.contract.rules import expected_reports

#: What :func:`parse_report_batch` returns: pydantic reports or their fast-decoded twins,
#: read by the service through the same attributes.
WireReport = Report | FastReport


def limit_errors(reports: list[WireReport], *, max_world_size: int, max_num_microbatches: int,
                 max_reports_per_step: int) -> list[dict]:
    """The configured limits (``auditor.config.Settings``) a validated batch breaks, as
    field errors (``type`` ``limit_exceeded``, ``loc`` naming the report and field); empty
    when it breaks none. The static bounds of the models above are hard ceilings; these are
    the deployment's own, checked before anything is stored."""
    out = []

    def add(i: int, name: str, msg: str) -> None:
        out.append({"loc": ("reports", i, name), "msg": msg, "type": "limit_exceeded"})

    for i, r in enumerate(reports):
        if r.world_size > max_world_size:
            add(i, "world_size", f"world_size ({r.world_size}) is above the limit {max_world_size} "
                                 "(AUDITOR_MAX_WORLD_SIZE)")
        elif r.num_microbatches > max_num_microbatches:
            add(i, "num_microbatches", f"num_microbatches ({r.num_microbatches}) is above the limit "
                                       f"{max_num_microbatches} (AUDITOR_MAX_NUM_MICROBATCHES)")
        elif expected_reports(r) > max_reports_per_step:
            add(i, "num_microbatches", f"a step of world_size {r.world_size} × num_microbatches "
                                       f"{r.num_microbatches} expects {expected_reports(r)} reports, above the "
                                       f"limit {max_reports_per_step} (AUDITOR_MAX_REPORTS_PER_STEP)")
    return out


#: Reports validated per pydantic call by :func:`parse_report_batch`.
_CHUNK = 500
_REPORT_LIST = TypeAdapter(list[Report])


def parse_report_batch(body: bytes, max_errors: int) -> tuple[list[WireReport] | None, list[dict], int]:
    """Decode and validate a ``POST /v1/reports`` body: ``(reports or None, errors, number of
    reports)``. A valid body is decoded by msgspec (:func:`decode_report_batch`, into
    :class:`~auditor.contract.fast.FastReport`); any other, and one msgspec cannot read, is validated by pydantic
    (:func:`validate_report_batch`, into :class:`~auditor.contract.models.Report`), whose errors are the answer."""
    fast = decode_report_batch(body)
    if fast is not None:
        return fast, [], len(fast)
    return validate_report_batch(body, max_errors)


def validate_report_batch(body: bytes, max_errors: int) -> tuple[list[Report] | None, list[dict], int]:
    """Decode and validate a ``POST /v1/reports`` body with the pydantic models: ``(reports
    or None, errors, number of reports)``.

    Validation errors cost memory (pydantic-core collects every one: a 15 MB body of
    invalid reports made 1.6 million errors and took 2.4 GB), so the reports are validated
    in chunks of ``_CHUNK`` and validation stops once ``max_errors`` errors are collected;
    the errors are those the whole-body :class:`~auditor.contract.models.ReportBatch` validation gives (same ``loc``,
    ``type`` and message), and the first ones of them. Peak memory is then the decoded body
    (~10× its size) plus one chunk's errors. ``NaN``/``Infinity`` tokens are accepted.
    """
    try:
        obj = pydantic_core.from_json(body, allow_inf_nan=True)
    except ValueError as e:
        return None, [{"loc": (), "msg": f"invalid JSON: {e}", "type": "json_invalid"}], 1
    items = obj.get("reports") if isinstance(obj, dict) else None
    if not isinstance(items, list) or not items or len(obj) != 1:
        try:  # the envelope is wrong: its errors, with each report validated as usual
            ReportBatch.model_validate(obj if not isinstance(items, list) else {**obj, "reports": items[:_CHUNK]},
                                       strict=True)
        except ValidationError as e:
            return None, e.errors(include_url=False, include_input=False)[:max_errors], \
                max(1, len(items) if isinstance(items, list) else 1)
    reports: list[Report] = []
    errors: list[dict] = []
    for start in range(0, len(items), _CHUNK):
        try:
            chunk = _REPORT_LIST.validate_python(items[start:start + _CHUNK], strict=True)
        except ValidationError as e:
            for err in e.errors(include_url=False, include_input=False):
                err["loc"] = ("reports", start + err["loc"][0], *err["loc"][1:])
                errors.append(err)
            if len(errors) >= max_errors:
                return None, errors[:max_errors], len(items)
            continue
        if not errors:
            reports.extend(chunk)
    return (None if errors else reports), errors, len(items)
