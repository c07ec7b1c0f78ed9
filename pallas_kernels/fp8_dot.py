"""FP8 dots that run on Hopper's FP8 tensor cores (wgmma) from Pallas on Triton.

Pallas (jax 0.10.2) lowers ``dot_general`` to a Triton dot without ``maxNumImpreciseAcc``.
For E4M3 x E4M3 -> float32 Triton then refuses Hopper's FP8 wgmma (which accumulates in the
tensor core's reduced precision) and falls back to converting both operands to float16 for
mma.sync, one conversion per operand element -- found by compiling the W8A8 kernel to SASS on a
CPU (``scripts/kernel_sass.py``: ``F2FP.F16.E4M3.UNPACK_B`` + ``HMMA.16816`` instead of ``QGMMA``).

:func:`fp8_dot_acc` is ``acc + a @ b`` as a primitive of its own. Its Triton lowering emits the
dot with the accumulator inside (as Triton's own ``tl.dot(a, b, acc)`` does: no separate add
of a second float32 tile) and ``maxNumImpreciseAcc = PROMOTE_EVERY``: the tensor core sums
128 products at a time, which Triton then adds into the float32 accumulator -- the promotion
interval DeepSeek-V3 uses for FP8 GEMMs, since Hopper's FP8 accumulation keeps only about 14
mantissa bits. Everywhere else (interpret mode, XLA) it is the exact float32 ``acc + a @ b``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

PROMOTE_EVERY = 128

fp8_dot_acc_p = Primitive("llmeq_fp8_dot_acc")


def fp8_dot_acc(a, b, acc, *, b_kmajor: bool):
    """``acc + a @ b`` (``b_kmajor``: ``a @ b.T``), float32; a, b float8_e4m3fn tiles, acc float32."""
    _check(a.shape, b.shape, acc.shape, b_kmajor)
    return fp8_dot_acc_p.bind(a, b, acc, b_kmajor=bool(b_kmajor))


def _exact(a, b, acc, *, b_kmajor):
    dims = (((1,), (1 if b_kmajor else 0,)), ((), ()))
    prod = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return acc + prod


def _check(a, b, acc, b_kmajor):
    if len(a) != 2 or len(b) != 2 or a[1] != b[1 if b_kmajor else 0] or acc != (a[0], b[0 if b_kmajor else 1]):
        raise ValueError(f"fp8_dot_acc: shapes a {a}, b {b} (b_kmajor={b_kmajor}), acc {acc} do not make acc + a @ b")


def _abstract(a, b, acc, *, b_kmajor):
    return jax.core.ShapedArray(acc.shape, jnp.float32)


fp8_dot_acc_p.def_impl(_exact)
fp8_dot_acc_p.def_abstract_eval(_abstract)
mlir.register_lowering(fp8_dot_acc_p, mlir.lower_fun(_exact, multiple_results=False))


def _triton_lowering(ctx, a, b, acc, *, b_kmajor):
    from jax._src.lib.triton import dialect as tt_dialect

    if b_kmajor:
        b = tt_dialect.trans(b, [1, 0])
    return tt_dialect.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_EVERY)


def _register_triton_lowering() -> bool:
    """Register the Triton rule; False where this JAX has no such table (then no FP8 kernel runs:
    ``w8a8.fp8_supported`` says so and dispatch keeps XLA's FP8 dot)."""
    # Pallas's Triton lowering keeps its rules in a private table; registering a rule for our own
    # primitive there is the one hook it offers (tests/pallas_kernels/test_fp8_dot.py lowers it).
    try:
        from jax._src.pallas.triton import lowering as triton_lowering

        triton_lowering.register_lowering(fp8_dot_acc_p)(_triton_lowering)
    except (ImportError, AttributeError):
        return False
    return True


TRITON_LOWERING = _register_triton_lowering()
