"""Suite-wide collection rules.

Tests marked ``gpu`` (tests/pallas_kernels/test_gpu_kernels.py: kernels compiled for a real
GPU) are deselected when JAX's default backend is not a GPU, so a CPU run neither runs
them nor counts them as skipped; pytest's summary reports them as "deselected" when it runs in
one process (under pytest-xdist, as scripts/test.sh runs it, each worker drops them itself and
the summary does not count them).

Compiled programs are released after each test module: every XLA:CPU executable holds about a
dozen memory mappings until its jit cache lets it go, and the whole suite in one process compiled
enough of them to pass Linux's default limit of 65530 mappings (vm.max_map_count), at which point
the next compilation died with a segmentation fault inside XLA.

Property tests (hypothesis) draw the same examples on every run of a commit (``derandomize``), so
CI passes or fails a commit on what was tested before it was pushed, not on a fresh draw.
``LLMEQ_HYPOTHESIS=explore`` draws new examples on each run: use it when touching numerics (it is
how the percentile rounding cases pinned in tests/core/test_quantize.py were found).

The whole run keeps the programs it compiles in one persistent compilation cache (a temporary directory
made by the run's first pytest process -- xdist's controller -- and removed when it exits; its workers and
every process a test starts inherit it through the environment): many tests compile the same program again
-- the float model a quantized path is compared against, one decode step under a fresh ``jax.jit``, the CLI
runs of one model in separate processes -- and reading it back is cheaper than compiling it. Whole suite, two
workers: 1505 -> 1278 s against a cache of each process's own (2103 s with none). JAX writes an entry in
place, so a process may find one another is still writing; such an entry is a truncated compressed stream,
which JAX fails to decompress, warns about and compiles instead of using (tried).
``LLMEQ_TEST_COMPILE_CACHE=0`` compiles everything afresh.

XLA:CPU runs at least ``MIN_CPU_THREADS`` threads (``PJRT_NPROC``, read when the CPU client is made): Mosaic GPU's
interpret mode runs each simulated warpgroup as a program whose callbacks wait at its barriers on XLA's CPU threads,
and with one thread a core (two in CI) two waiting warpgroups left none for the warpgroup they waited for: a kernel
with one more operand hung (a stacked, grouped weight-only kernel with a bias, every time). Two simulated SMs of
three warpgroups wait at most six at once. Suites of matmuls took the same time with 8 threads on 2 cores.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

from tests.xla_flags import with_test_flags

MIN_CPU_THREADS = 8
# before anything makes JAX's CPU client (importing jax does not)
os.environ.setdefault("PJRT_NPROC", str(max(MIN_CPU_THREADS, os.cpu_count() or 1)))
os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))  # LLVM -O0: tests/xla_flags.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("LLMEQ_HYPOTHESIS") == "explore" else "fixed")


_RUN_CACHE = "LLMEQ_TEST_COMPILE_CACHE_DIR"


def _use_a_compilation_cache_of_this_run():
    directory = os.environ.get(_RUN_CACHE)  # set by the run's first pytest process (xdist's controller)
    if not directory:
        directory = tempfile.mkdtemp(prefix="llmeq-test-xla-cache-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        os.environ[_RUN_CACHE] = directory
    options = {
        "jax_compilation_cache_dir": directory,
        "jax_persistent_cache_min_compile_time_secs": 0.0,  # the default keeps only >= 1 s compiles
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for name, value in options.items():
        jax.config.update(name, value)  # this process: jax is imported already
        os.environ[name.upper()] = str(value)  # the processes tests start (CLI runs, multi-process launches)


if os.environ.get("LLMEQ_TEST_COMPILE_CACHE", "1") != "0":
    _use_a_compilation_cache_of_this_run()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or jax.default_backend() == "gpu":
        return
    config.hook.pytest_deselected(items=gpu_items)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture
def unchecked_kernels(monkeypatch):
    """The kernels not yet run on a GPU (``pallas_kernels.hardware_checked.UNCHECKED``) turned on, as the GPU
    session's end-to-end runs turn on those whose gpu cases passed: for tests of what a GPU traces with them."""
    from pallas_kernels import hardware_checked

    monkeypatch.setenv(hardware_checked.ENV, "all")


@pytest.fixture
def cudnn_as_xla(monkeypatch):
    """JAX's cuDNN attention (the entry attention_flash calls: head-major "BNTH" operands) computed by
    jax.nn.dot_product_attention's XLA implementation on the same arguments (a CPU has no cuDNN): what
    attention_flash hands cuDNN -- layout, mask, scale -- checked by the numbers. Records each call."""
    from jax._src.cudnn import fused_attention_stablehlo

    calls = []

    def fake(query, key, value, bias=None, mask=None, *, scale, qkv_layout, **kwargs):
        assert bias is None and not kwargs
        calls.append({"layout": qkv_layout, "key": key.shape, "mask": mask.shape})
        assert qkv_layout == "BNTH", qkv_layout  # the only layout the fake (and attention_flash) speaks
        out = jax.nn.dot_product_attention(*(jnp.swapaxes(a, 1, 2) for a in (query, key, value)), mask=mask,
                                           scale=scale, implementation="xla")
        return jnp.swapaxes(out, 1, 2)

    monkeypatch.setattr(fused_attention_stablehlo, "dot_product_attention", fake)
    return calls
