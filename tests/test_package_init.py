"""llmeq_jax/__init__.py: importing the package keeps transformers' "PyTorch was not found" advice quiet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A Python without torch, as after `scripts/main_job.sh` (no [dev] extra): transformers'
# availability check (importlib find_spec) is told torch is not there.
HIDE_TORCH = """
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name == "torch" else _find(name, *a, **k)
"""


def _import_stderr(first: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    code = HIDE_TORCH + first + "\nimport transformers\n"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300).stderr


def test_no_pytorch_advice_after_importing_llmeq_jax():
    assert "PyTorch was not found" in _import_stderr("")  # the check sees no torch: transformers would say it
    assert "PyTorch was not found" not in _import_stderr("import llmeq_jax")
