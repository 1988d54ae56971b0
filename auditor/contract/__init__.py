"""The wire contract of the auditor service, in both directions (DESIGN.md §3).

In (what trainers send): :mod:`~auditor.contract.names` (run and statistic names),
:mod:`~auditor.contract.values` and :mod:`~auditor.contract.rules` (every value and
cross-field rule, pure functions), :mod:`~auditor.contract.fields` (one field table per
block), :mod:`~auditor.contract.models` (the pydantic models built from it: 422 wording,
OpenAPI), :mod:`~auditor.contract.fast` (the msgspec structs built from it: the fast
decoder) and :mod:`~auditor.contract.parse` (a ``POST /v1/reports`` body to reports or
errors, the deployment's limits).

Out (what the service answers): :mod:`~auditor.contract.reads`, the read documents as
standard-library dataclasses, which the Reader decodes.

This file imports nothing: ``import auditor.contract.reads`` (the Reader's, standard
library only) must not drag pydantic, msgspec or numpy in.
"""
