"""Old name of :mod:`auditor.trainer.client`: ``from auditor.client import AuditorClient`` keeps working."""

from auditor.trainer.client import AuditorClient, client_from_env  # noqa: F401
