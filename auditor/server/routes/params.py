"""Path parameters shared by the routes."""

from fastapi import Path

from auditor.contract.names import RUN_ID_PATTERN

#: Every path and query parameter carries the wire pattern of what it names, so characters a
#: database rejects (NUL, lone surrogates) are a 422 naming the parameter, never a query.
RunIdPath = Path(min_length=1, max_length=128, pattern=RUN_ID_PATTERN)
#: A workload label (``Report.workload``): a run id's characters and length.
WorkloadPath = Path(min_length=1, max_length=128, pattern=RUN_ID_PATTERN)
