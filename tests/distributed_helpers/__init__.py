"""Helpers for tests/distributed/: code that must run in its own processes (8 host devices, 2 processes)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "distributed_helpers"


def subprocess_env(**extra) -> dict:
    """This environment with the repository on PYTHONPATH and XLA_FLAGS replaced by ``extra``'s."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env
