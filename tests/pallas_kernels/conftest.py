"""Shared helpers: lowering a jitted function for CUDA on a CPU-only machine."""

import jax
import pytest

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *args) -> str:
    """StableHLO text of ``fn`` lowered for the CUDA platform (runs the Pallas -> Triton lowering).

    No GPU is needed: jax lowers for a platform it does not run on. What this
    cannot check is the Triton compiler itself (PTX generation), which needs CUDA.
    """
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def cuda_lowering():
    def check(fn, *args, calls: int = 1):
        text = lower_for_cuda(fn, *args)
        assert text.count(TRITON_CALL) == calls, "expected the kernel to lower to a Triton custom call"
        return text

    return check
