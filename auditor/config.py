"""Service configuration: one pydantic-settings object, read from ``AUDITOR_*`` variables.

Every limit the service enforces lives here, with its default; docs/deploy.md "Limits and
security" lists them with what a caller gets past each one.
"""

from __future__ import annotations

import threading

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from auditor.defaults import DEFAULT_DATABASE_URL, DEFAULT_GRACE_SECONDS

#: The largest world_size, size of a dim or num_microbatches the wire schema admits at all
#: (auditor.contract); the deployment's own limits below may only be lower. Past the limit a
#: caller is told the configured value, never this one.
WIRE_MAX_SIZE = 1 << 20
#: Peak memory of decoding and ingesting a ``POST /v1/reports`` body, per byte of the body
#: (body included), as measured on this code: 10,000 reports of 8 ranks with one NaN (the
#: pydantic path), 4.2 MiB -> 73 MiB = 17×; of 256 ranks with NaN, 15.3 MiB -> 99 MiB = 6.5×;
#: valid bodies (msgspec) 1.4-5.8×; a 16 MiB invalid body of small reports 6.2×. Only a body
#: of bare ``{}`` went higher (28×).
BODY_MEMORY_FACTOR = 17
#: Largest bodies decoded at once by default: 2 × 16 MiB × 17 ≈ 550 MiB on top of the
#: ~100-250 MiB a serving process holds keeps one process in a 1 GiB container.
BODIES_IN_FLIGHT = 2


class Settings(BaseSettings):
    """Everything the service reads from its environment.

    Each field is also the environment variable ``AUDITOR_<FIELD>`` (e.g.
    ``AUDITOR_DATABASE_URL``); command-line options of ``auditor serve`` override them.
    """

    model_config = SettingsConfigDict(env_prefix="AUDITOR_", extra="ignore")

    database_url: str = Field(
        DEFAULT_DATABASE_URL,
        description="SQLAlchemy URL: sqlite:///path.db (default, WAL mode) or postgresql+psycopg://...",
    )
    grace_seconds: float = Field(
        DEFAULT_GRACE_SECONDS, ge=0,
        description="How long a step may stay incomplete before it is audited with missing_report.",
    )
    sweep_interval_seconds: float = Field(
        5.0, gt=0, description="How often the background sweep looks for steps whose grace period ended."
    )
    sweep_max_steps: int = Field(
        200, ge=1, description="Most steps one sweep round audits (each in its own short transaction)."
    )
    sweep_max_seconds: float = Field(
        2.0, gt=0, description="A sweep round stops starting new steps after this many seconds."
    )
    metrics_retention_seconds: float = Field(
        86400.0, gt=0, description="Series idle for longer than this are no longer exported on /metrics."
    )
    run_retention_days: float = Field(
        0.0, ge=0, description="Runs idle (no report) for longer than this many days are deleted with their "
                               "reports and verdicts by the sweep; 0 keeps runs forever."
    )
    delete_chunk_rows: int = Field(
        5000, ge=1, description="Reports deleted per transaction when a run is deleted (DELETE /v1/runs/{id}, "
                                "retention): bounds how long a delete holds the write lock."
    )

    # ------------------------------------------------------------------ input limits
    max_batch: int = Field(10_000, ge=1, description="Most reports accepted in one POST /v1/reports (413 past it).")
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024,
        description="Largest request body, in bytes; enforced while the body streams in (413, rest unread).",
    )
    max_body_bytes_in_flight: int | None = Field(
        None, ge=1024,
        description="Request-body bytes one process holds at once (POST /v1/reports, PUT /v1/runs), each from "
                    "before it is read until its decode and ingest are done: the bound on request memory, since a "
                    "decoded body costs up to ~17× its size (BODY_MEMORY_FACTOR). A body that does not fit waits "
                    "up to AUDITOR_BODY_BUDGET_WAIT_SECONDS before it is read, then 503 + Retry-After; one "
                    "without a Content-Length that outgrows the room left while it streams in: 503 at once. "
                    "Default (unset): min(2, AUDITOR_INGEST_CONCURRENCY) × AUDITOR_MAX_BODY_BYTES (32 MiB: "
                    "~550 MiB decoded); never less than AUDITOR_MAX_BODY_BYTES.",
    )
    body_budget_wait_seconds: float = Field(
        2.0, ge=0, description="Longest wait for room in AUDITOR_MAX_BODY_BYTES_IN_FLIGHT before a body is read "
                               "(503 + Retry-After past it); below the trainer client's 5 s request timeout."
    )
    max_world_size: int = Field(
        65_536, ge=1, le=WIRE_MAX_SIZE,
        description="Largest world_size (and size of any dim, and group_ranks length) a report or run may declare."
    )
    max_num_microbatches: int = Field(
        4096, ge=1, le=WIRE_MAX_SIZE, description="Largest num_microbatches a report may declare."
    )
    max_reports_per_step: int = Field(
        262_144, ge=1, le=2**31 - 1,
        description="Largest number of reports one step may expect (world_size × num_microbatches).",
    )
    max_statistics_per_run: int = Field(
        1000, ge=1, description="Most statistics one run may have (PUT /v1/runs or new names in reports; 422 past it)."
    )
    metrics_max_series: int = Field(
        2000, ge=0, description="Most (run, statistic) series exported on /metrics with their own labels; "
                                "the rest are summed into run=\"_other\", statistic=\"_other\"."
    )
    max_errors_listed: int = Field(
        1000, ge=1, description="Validation stops after this many errors; the 422 lists them (errors_truncated: true)."
    )

    # ------------------------------------------------------------------ connections
    max_connections: int = Field(
        1000, ge=1, description="Open client connections per process. A connection past it closes an idle one (of "
                                "the client address holding the most, the longest idle first); with none idle it "
                                "may only ask for /healthz, /readyz or /metrics (AUDITOR_MAX_CONCURRENT_PROBES "
                                "such at once), else 503 and closed."
    )
    max_concurrent_requests: int = Field(
        200, ge=1, description="Writes (POST/PUT/DELETE) in progress per process; past it: 503 with Retry-After."
    )
    max_concurrent_reads: int = Field(
        64, ge=1, description="Reads (GET/HEAD: API reads and pages) in progress per process, a budget of their "
                              "own so writers (or stalled bodies) never starve them; past it: 503 with Retry-After."
    )
    max_concurrent_pages: int = Field(
        4, ge=1, description="Run pages (GET /runs/{run_id}) rendering at once per process, within "
                             "AUDITOR_MAX_CONCURRENT_READS; past it: 503 with Retry-After. A page streams its "
                             "run's step summaries into plots of at most 4,000 points a line and reads at most "
                             "2,000 rank rows of a selected step: ~5 MB of Python objects for a 100,000-step run "
                             "(plus the selected step's re-audit), and rendering is CPU-bound, so more at once "
                             "adds memory, not throughput."
    )
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="A connection must deliver a request's complete headers within this many seconds "
                                "of opening (or of its previous response), else it is closed."
    )
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="Longest pause between two chunks of a request body (408 past it)."
    )
    body_deadline_seconds: float = Field(
        120.0, gt=0, description="Longest time to receive a whole request body, however it trickles in "
                                 "(408 past it): a client sending a byte now and then cannot hold a slot."
    )
    max_concurrent_probes: int = Field(
        32, ge=1, description="/readyz and /metrics requests in progress per process: a budget of their own, "
                              "outside AUDITOR_MAX_CONCURRENT_REQUESTS, so a load balancer's probe and "
                              "Prometheus's scrape answer while ingest is saturated (503 past it; /healthz "
                              "has no cap)."
    )
    probe_interval_seconds: float = Field(
        2.0, gt=0, description="Pause between two background database probes, whose last result /readyz and "
                               "/healthz report."
    )
    probe_timeout_seconds: float = Field(
        10.0, gt=0, description="A database probe without an answer after this counts as a failure (/readyz 503). "
                                "It is abandoned, and no new probe starts until its thread returns: a hung "
                                "database holds at most one probe thread and pooled connection."
    )
    shutdown_timeout_seconds: float = Field(
        10.0, gt=0, description="On SIGTERM/SIGINT: how long requests in progress and background tasks get to "
                                "finish; the process is gone at most 5 s after that in any case."
    )
    keep_alive_seconds: int = Field(5, ge=1, description="Idle keep-alive connections are closed after this.")
    max_header_bytes: int = Field(
        65_536, ge=1024, description="Largest request line + headers (400 and the connection closed past it)."
    )
    backlog: int = Field(2048, ge=1, description="Listen backlog of the server socket.")
    ingest_concurrency: int = Field(
        8, ge=1, description="POST /v1/reports handled at once per process (the others wait); keeps threads and "
                             "database connections free for reads and the sweep."
    )
    db_lock_timeout_seconds: float = Field(
        30.0, gt=0, description="Longest wait for a database lock (SQLite busy timeout, PostgreSQL lock_timeout); "
                                "503 with Retry-After past it."
    )
    db_pool_timeout_seconds: float = Field(
        10.0, gt=0, description="Longest wait for a database connection from the pool (503 past it)."
    )

    # ------------------------------------------------------------------ auth
    token: str | None = Field(
        None, description="If set, every request except the public ones must carry 'Authorization: Bearer <token>'."
    )
    read_token: str | None = Field(
        None, description="Optional second token that may only read (GET): for Grafana, CI jobs, dashboards."
    )
    login_max_failures: int = Field(
        10, ge=1, description="Wrong tokens one client address may send to POST /login within "
                              "AUDITOR_LOGIN_FAILURE_WINDOW_SECONDS; past it every sign-in of that address (right "
                              "token or not) is a 429 with Retry-After until the window ends."
    )
    login_failure_window_seconds: float = Field(
        60.0, gt=0, description="The window of AUDITOR_LOGIN_MAX_FAILURES, from an address's first wrong token."
    )
    public_endpoints: bool = Field(
        True, description="/readyz and /metrics answer without a token even when one is set (/healthz always does)."
    )

    @field_validator("token", "read_token")
    @classmethod
    def _not_a_placeholder(cls, value: str | None) -> str | None:
        """A token is a secret: the placeholders of an example env file ("change-me...")
        are refused (they passed ``docker-compose config`` and served with them)."""
        if value is not None and value.strip().lower().replace("_", "-").startswith(("change-me", "changeme")):
            raise ValueError(f"{value!r} is a placeholder, not a secret: set a random token (openssl rand -hex 32)")
        return value

    @field_validator("*")
    @classmethod
    def _durations_a_wait_can_take(cls, value, info: ValidationInfo):
        """A duration (``*_seconds``, ``*_days``) is at most ``threading.TIMEOUT_MAX`` seconds
        (~292 years): past it (1e308, inf) a wait on it raises OverflowError - the shutdown
        thread did, and SQLite's busy timeout overflowed."""
        if info.field_name.endswith(("_seconds", "_days")) and isinstance(value, float):
            limit = threading.TIMEOUT_MAX / (86400.0 if info.field_name.endswith("_days") else 1.0)
            if not value <= limit:
                raise ValueError(f"at most {limit:g} (a wait of ~292 years)")
        return value

    @property
    def body_budget_bytes(self) -> int:
        """The effective AUDITOR_MAX_BODY_BYTES_IN_FLIGHT: the setting, or its default
        ``min(2, ingest_concurrency) × max_body_bytes``; at least ``max_body_bytes``, so the
        largest body accepted always fits once nothing else is in flight."""
        derived = min(BODIES_IN_FLIGHT, self.ingest_concurrency) * self.max_body_bytes
        return max(self.max_body_bytes_in_flight or derived, self.max_body_bytes)
