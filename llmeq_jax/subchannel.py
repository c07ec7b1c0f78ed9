"""A prompt's int4 group-wise weight-only product as one XLA GEMM over its codes: XLA's sub-channel fusion.

Why: on a GPU, XLA's path for a prompt's int4 product (``ops.weight_only_xla``) writes the whole weight dequantized
in the activations' dtype before every GEMM -- four times the codes' bytes written, then read -- and the Pallas
kernels that read the codes in their tiles lost to it at prompt rows (issue #15: 0.27-0.34x bf16). jax 0.11's XLA
can instead fuse a group-wise int4 dequantization into its Triton GEMM's operand loads when asked
(:data:`FLAG`, experimental, off by default), in one form only (deviceless H100 compiles, docs/kernels.md):
``jnp.int4`` codes ``(K, N)`` converted to x's dtype and multiplied by the group scales in x's dtype.

This module writes a QArray's product in that form:

* the codes, stored as signed nibble pairs along K (``core.qarray.pack``), unpacked to ``jnp.int4`` by two shifts in
  a small fusion of their own (0.5 byte a weight written and read again) behind ``lax.optimization_barrier`` --
  fused into the GEMM's operand the unpacking hides the form and XLA keeps the dequantized copy;
* an integer zero point ``z`` (asymmetric recipes: rtn-w4-g128, GPTQ, AWQ), which no fused form takes, joins the
  same GEMM: ``x @ ((q - z) s) = x @ (q s) + (-xg) @ (z s)``, ``xg`` the sums of x over each group's K positions, as
  two more rows a group (codes ``z`` under the group's scales) met by two more columns of x (``-xg`` in two
  half-precision parts). Apart, that share cost a second GEMM and a float32 pass over both outputs (deviceless H100).

The scales are rounded to x's dtype, then each code times its scale (a weight, as the dequantized copy rounds it);
the GEMM accumulates in float32 and writes its output in x's dtype (a float32 output rounded after was not fused where
XLA merged two products of one x into one GEMM: a float32 output and a conversion pass, deviceless).

When: a product of more rows than a decode step's (``ops.weight_only_xla`` keeps its few-row forms), on a GPU,
where the switch allows it (``pallas_kernels.hardware_checked``, as for a kernel: kernel name :data:`KERNEL`; off on
a GPU until its gpu cases pass on one, since the flag is experimental and has crashed XLA's compile on another form)
and no dispatch table measured XLA's usual path faster (``scripts/bench_kernels.py`` kind
``w4_xla_subchannel_packed``, ``w4_xla_subchannel_zp``). The jits that run prompts compile with the flag where it may run
(:func:`compiler_options`, :func:`prompt_jit`); without it the same program is correct, only unfused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llmeq_jax import dispatch_table
from llmeq_jax.core.qarray import QArray
from llmeq_jax.kernel_dispatch import table_key
from pallas_kernels import config, hardware_checked

FLAG = "xla_gpu_experimental_enable_subchannel_dequantisation_fusion"
# The name the switch (pallas_kernels.hardware_checked) and the dispatch tables know this path by (the tables:
# "xla_subchannel_zp" for codes with zero points, a larger GEMM).
KERNEL = "xla_subchannel"
# Activation dtypes the fused form was seen to take: the GEMM's operands are x's dtype.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Rows a group gains for its zero point: its sum of x in two half-precision parts (high, then what it rounded off).
ZERO_POINT_ROWS = 2


def why_not(x_dtype, w) -> str:
    """"" where ``x @ w`` has the form this module writes, else why not."""
    if not isinstance(w, QArray) or len(w.shape) != 2:
        return "not a 2-D QArray"
    if w.grid != "uniform" or w.bits != 4 or w.pack_axis != 0:
        return f"{w.grid} int{w.bits} codes packed along axis {w.pack_axis} (takes uniform int4 packed along K)"
    if w.act_spec is not None:
        return "quantized activations (W8A8 has kernels of its own)"
    k, n = w.shape
    if w.scale.shape != (k // w.tile[0], n) or w.tile[0] in (1, k) or k % w.tile[0] or w.tile[0] % 2:
        return f"scales of shape {w.scale.shape} for tile {w.tile} (takes even groups along K dividing it, per column)"
    if w.zero_point is not None and not jnp.issubdtype(w.zero_point.dtype, jnp.integer):
        return "float zero points (GGUF's block minima)"
    if jnp.dtype(x_dtype) not in HALF_DTYPES:
        return f"{jnp.dtype(x_dtype).name} activations (takes bfloat16 or float16)"
    return ""


def allowed() -> bool:
    """Whether this path may run here: on a GPU (it is XLA's GPU fusion), where the switch allows it, kernels not
    turned off (``pallas_kernels.config.disabled()``: XLA's usual path everywhere, what the benchmarks compare with)."""
    return config.on_gpu() and not config.is_disabled() and hardware_checked.allowed(KERNEL)


def takes(rows: int, x_dtype, w) -> bool:
    """Whether a prompt's product of ``rows`` rows with ``w`` runs in this form: it has it, the path is allowed
    here, and no dispatch table measured XLA's dequantizing path faster for it."""
    if why_not(x_dtype, w) or not allowed():
        return False
    kind = KERNEL if w.zero_point is None else f"{KERNEL}_zp"
    return dispatch_table.choice(table_key(kind, rows, x_dtype, w, w.tile[0])) != "xla"


def compiler_options() -> dict | None:
    """XLA options for a jit that runs prompts: the fusion's flag where this path may run, else None."""
    return {FLAG: True} if allowed() else None


def _codes(packed: jax.Array, groups: int) -> jax.Array:
    """The codes of nibble pairs packed along K, ``(K / 2, N)`` bytes, the low nibble first, as int8
    ``(groups, K / groups, N)``: each byte broadcast to its two rows, shifted by the row's amount -- one elementwise
    fusion, which XLA writes in the layout the GEMM reads (K minor). (Unpacked by stacking the two nibbles, the
    codes were written twice in a model's scan: the stack, then a transpose; deviceless H100.)"""
    b = jax.lax.bitcast_convert_type(packed, jnp.int8)
    pairs = jnp.broadcast_to(b[:, None, :], (b.shape[0], 2, b.shape[1]))  # each byte for both of its codes
    up = jnp.asarray([4, 0], jnp.int8)[None, :, None]  # the low nibble shifted up first
    codes = jnp.left_shift(pairs, up) >> 4  # arithmetic shift: each nibble sign-extended
    return codes.reshape(groups, -1, packed.shape[1])


def _int4(codes: jax.Array) -> jax.Array:
    """``codes`` as ``jnp.int4`` in a fusion of their own: the barrier keeps XLA from fusing the unpacking into the
    GEMM's operand, where the sub-channel fusion no longer recognizes its form."""
    return jax.lax.optimization_barrier(codes.astype(jnp.int4))


def _with_zero_point_rows(codes: jax.Array, zero_point: jax.Array) -> jax.Array:
    """``codes`` ``(G, group, N)`` with :data:`ZERO_POINT_ROWS` rows of each group's zero points after each group's
    codes: ``(G, group + 2, N)``, in one fusion with the unpacking (a select, where a concatenation split it)."""
    group = codes.shape[1]
    row = jnp.arange(group + ZERO_POINT_ROWS)[None, :, None]
    padded = jnp.pad(codes, ((0, 0), (0, ZERO_POINT_ROWS), (0, 0)))
    return jnp.where(row < group, padded, zero_point.astype(jnp.int8)[:, None, :])


def _with_group_sums(x: jax.Array, groups: int) -> jax.Array:
    """``x`` ``(..., K)`` with minus each group's sum after the group's columns, as two columns of x's dtype (the sum's
    float32 value rounded, then what that rounding lost): ``(..., K + 2 G)``, the zero point rows' partners."""
    xg = x.reshape(*x.shape[:-1], groups, -1)
    sums = jnp.sum(xg.astype(jnp.float32), axis=-1, keepdims=True)
    high = sums.astype(x.dtype)
    low = (sums - high.astype(jnp.float32)).astype(x.dtype)
    return jnp.concatenate([xg, -high, -low], axis=-1).reshape(*x.shape[:-1], -1)


def matmul(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ dequantize(w)`` for a ``w`` of this form (:func:`why_not`) as one GEMM over int4 codes and x's-dtype
    scales. An integer zero point ``z`` joins the GEMM as two more rows a group, codes ``z`` under the group's scales,
    met by minus the group's sum of x: ``sum_k x_k (q_k - z) s = sum_k x_k q_k s + (-sum_k x_k) z s``. The zero
    points must be int4 values, as every quantizer here clips them (``core.quantize.scale_from_range``)."""
    (k, n), group = w.shape, w.tile[0]
    groups = k // group
    codes = _codes(w.qvalue, groups)
    if w.zero_point is not None:
        codes, x = _with_zero_point_rows(codes, w.zero_point), _with_group_sums(x, groups)
    weight = _int4(codes).astype(x.dtype) * w.scale.astype(x.dtype)[:, None, :]
    return jnp.matmul(x, weight.reshape(-1, n))


def prompt_jit(fun, **jit_kwargs):
    """``jax.jit(fun, **jit_kwargs)`` compiled with :func:`compiler_options` as they are at each call (one jit per
    set of options): for the functions that run a prompt's products. ``lower`` / ``trace`` as a jit's;
    ``__wrapped__`` is ``fun``."""
    jits = {}

    def jitted():
        options = compiler_options()
        key = tuple(sorted(options.items())) if options else ()
        if key not in jits:
            jits[key] = jax.jit(fun, compiler_options=options, **jit_kwargs)
        return jits[key]

    @functools.wraps(fun)
    def call(*args, **kwargs):
        return jitted()(*args, **kwargs)

    call.lower = lambda *args, **kwargs: jitted().lower(*args, **kwargs)
    call.trace = lambda *args, **kwargs: jitted().trace(*args, **kwargs)
    return call
