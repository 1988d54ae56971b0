"""Service configuration: one pydantic-settings object, read from ``AUDITOR_*`` variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite:///./auditor.db"


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
        60.0, ge=0, description="How long a step may stay incomplete before it is audited with missing_report."
    )
    sweep_interval_seconds: float = Field(
        5.0, gt=0, description="How often the background sweep looks for steps whose grace period ended."
    )
    metrics_retention_seconds: float = Field(
        86400.0, gt=0, description="Series idle for longer than this are no longer exported on /metrics."
    )
    max_batch: int = Field(10_000, ge=1, description="Most reports accepted in one POST /v1/reports.")
    token: str | None = Field(
        None, description="If set, POST/PUT requests must carry 'Authorization: Bearer <token>'."
    )
