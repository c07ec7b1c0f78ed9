"""The XLA flags every test process runs with: conftest sets them, and the processes tests start keep them.

Most of the suite's time went into XLA:CPU compiling programs that then ran on tiny shapes -- tests/kv/test_cache.py
spent 60 of its 92 s in backend compiles, most of that in LLVM's optimization passes. Tests compile at LLVM -O0
(``--xla_backend_optimization_level=0``): the whole suite on 2 cores and 2 workers, 26.4 -> 18.5 min. What a
program computes is unchanged, but float results may differ in their last bits from an optimized build's (whether
a multiply and an add contract into one FMA), so processes whose results a test compares bit for bit must share the
flags: :func:`with_test_flags` gives a child process's ``XLA_FLAGS``.

Fusions are emitted by XLA:CPU's older LLVM emitters, not its MLIR fusion emitters
(``--xla_cpu_use_fusion_emitters=false``), which spent most of the remaining compile time lowering each fusion
through MLIR: one GPU-interpret-mode decode test's compiles 16.0 -> 7.3 s, tests/kv/test_cache.py 94 -> 67 s, the
whole suite on 2 cores and 2 workers 26.8 -> 21.0 min (2026-12-08, the same machine, all 2279 tests passing).

Only where no CUDA plugin is installed: a GPU machine's test run (``scripts/gpu_session.sh``) compiles as users'
programs do. ``LLMEQ_TEST_XLA_OPT=1`` keeps XLA's default optimization on a CPU too.
"""

from __future__ import annotations

import importlib.metadata
import os


def _fast_compile() -> bool:
    if os.environ.get("LLMEQ_TEST_XLA_OPT", "0") != "0":
        return False
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    return not any(name.lower().replace("_", "-").startswith("jax-cuda") for name in names)


TEST_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false") if _fast_compile() else ()


def with_test_flags(flags: str = "") -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the test flags it does not set itself."""
    own = flags.split()
    missing = [f for f in TEST_FLAGS if not any(o.split("=")[0] == f.split("=")[0] for o in own)]
    return " ".join([*own, *missing])
