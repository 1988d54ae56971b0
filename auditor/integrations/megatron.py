"""Old name of :mod:`auditor.trainer.megatron` (this rank's coordinates from Megatron-core)."""

from auditor.trainer.megatron import coords_and_sizes, is_initialized, megatron_topology  # noqa: F401
