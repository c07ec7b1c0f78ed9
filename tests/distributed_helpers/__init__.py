"""Helpers for tests/test_distributed.py that must run in their own processes (8 host devices, 2 processes)."""
