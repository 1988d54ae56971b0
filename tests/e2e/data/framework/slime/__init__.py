"""A stand-in for the slime package in the CPU tests of tests/e2e/test_stubbed_mpu.py (slime is
not on PyPI): its whitening function as slime writes it, and an advantage step that takes its
groups from ``megatron.core.mpu`` as slime's loss code does."""
