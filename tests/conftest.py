"""Suite-wide collection rules.

Tests marked ``gpu`` (tests/pallas_kernels/test_gpu_kernels.py: kernels compiled for a real
GPU) are deselected when JAX's default backend is not a GPU, so a CPU run neither runs
them nor counts them as skipped; pytest's summary reports them as "deselected".
"""

from __future__ import annotations

import jax


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or jax.default_backend() == "gpu":
        return
    config.hook.pytest_deselected(items=gpu_items)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
