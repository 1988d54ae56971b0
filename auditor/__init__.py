"""auditor: audits the statistics distributed trainers all-reduce across parallel ranks."""

__version__ = "0.1.0"
