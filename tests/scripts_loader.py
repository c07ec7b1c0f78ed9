"""The scripts under scripts/ as modules for the tests (they are not a package: each is loaded from its file)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` as a fresh module, with scripts/ on the path while it loads (the scripts import their
    siblings, e.g. bench_e2e imports profile_decode)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))
