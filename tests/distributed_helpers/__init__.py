"""Helpers for tests/distributed/: code that must run in its own processes (8 host devices, 2 processes)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.xla_flags import with_test_flags

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "distributed_helpers"


def subprocess_env(**extra) -> dict:
    """This environment with the repository on PYTHONPATH and XLA_FLAGS replaced by ``extra``'s (with the test
    flags of tests/xla_flags.py: a child process computes what the test's own process would, bit for bit)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    env["XLA_FLAGS"] = with_test_flags(extra.get("XLA_FLAGS", ""))
    return env
