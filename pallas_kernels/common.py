"""Pieces every kernel shares: Triton-safe rounding, nibble unpacking, masked tile I/O, blocks.

Why hand-written rounding: the Pallas Triton lowering of this JAX version
(0.10.2) has no rule for ``lax.round_p`` (``jnp.round`` and ``jnp.rint`` both
lower to it), so a kernel that calls ``jnp.round`` fails to lower for CUDA.
:func:`round_half_even` builds the same IEEE round-half-to-even from ``floor``,
``where`` and arithmetic, all of which lower.

Why explicit masks: Pallas' Triton lowering turns a block index into plain
pointer offsets without bounds checks, so a block that runs past the end of an
array reads (and writes) out of bounds. Every tile load/store here carries a
mask built from the logical sizes, so ragged M/N/K are handled, not rejected.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import offsets

TINY = float(jnp.finfo(jnp.float32).tiny)
# tl.dot needs every operand dim >= 16 on NVIDIA tensor cores.
MIN_DOT = 16


def div_rn(a: jax.Array, b: jax.Array, interpreted: bool) -> jax.Array:
    """``a / b`` for float32 rounded as IEEE divides (what XLA's own division gives): Triton compiles ``/`` to
    ``div.full.f32`` (within 2 ulp), so a quotient near a rounding boundary could round to another code than
    XLA's path. Inline PTX ``div.rn.f32`` on the GPU; interpret mode divides exactly anyway."""
    a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
    if interpreted:
        return a / b
    out = jax.ShapeDtypeStruct(a.shape, jnp.float32)
    return plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                        result_shape_dtypes=[out])[0]


def round_half_even(v: jax.Array) -> jax.Array:
    """``jnp.round`` (ties to even) for float32 without ``round_p``.

    f = floor(v) and d = v - f are exact for float32; ties (d == 0.5) go to the
    even neighbour: f + (f mod 2). Values with |v| >= 2^23 are integers (d == 0).
    """
    f = jnp.floor(v)
    d = v - f
    odd = f - 2.0 * jnp.floor(f * 0.5)  # 1.0 when f is odd, else 0.0
    up = jnp.where(d == 0.5, odd, 0.0)
    return jnp.where(d > 0.5, f + 1.0, f + up)


def quantize_sym(v: jax.Array, scale: jax.Array, qmax: int) -> jax.Array:
    """Symmetric grid, core numerics: clip(round(v / scale), -qmax, qmax) as int32."""
    q = round_half_even(v / scale)
    return jnp.clip(q, -float(qmax), float(qmax)).astype(jnp.int32)


def low_nibble(b: jax.Array) -> jax.Array:
    """Signed value of the low 4 bits of each (int32-widened) byte."""
    return ((b & 15) ^ 8) - 8


def high_nibble(b: jax.Array) -> jax.Array:
    """Signed value of the high 4 bits of each (int32-widened) byte."""
    return (((b >> 4) & 15) ^ 8) - 8


def pack_nibbles(even: jax.Array, odd: jax.Array) -> jax.Array:
    """Two int32 arrays of 4-bit values -> bytes ``(even & 0xF) | ((odd & 0xF) << 4)`` (as int32)."""
    return (even & 15) | ((odd & 15) << 4)


def split_pairs(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(..., 2n) -> elements at even and odd positions of the last dim, each (..., n).

    Written as reshape + split because the Triton lowering supports that (a
    strided slice is not supported by interpret mode, and stacking along a
    non-last axis is not supported by the Triton lowering).
    """
    *lead, n = v.shape
    pairs = v.reshape(*lead, n // 2, 2)
    even, odd = jnp.split(pairs, 2, axis=-1)
    return even.reshape(*lead, n // 2), odd.reshape(*lead, n // 2)


def interleave_pairs(even: jax.Array, odd: jax.Array) -> jax.Array:
    """Inverse of :func:`split_pairs` (stack along the last dim, which Triton supports)."""
    *lead, n = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(*lead, 2 * n)


def logical_weight(name: str, wq, w_layout: str):
    """The ``(K, N)`` (or [L, K, N]) shape of a matmul kernel's weight stored as ``w_layout``: "kn" as
    given, "nk" (K-major, a copy made once) with its last two dims swapped; an unknown layout refused."""
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"{name}: w_layout must be 'kn' (K, N) or 'nk' (N, K), got {w_layout!r}")
    if w_layout == "kn":
        return wq
    return jax.ShapeDtypeStruct((*wq.shape[:-2], wq.shape[-1], wq.shape[-2]), wq.dtype)


def row_major(a: jax.Array) -> jax.Array:
    """``a`` pinned to the row-major layout. Why: a layer sliced out of a stack and transposed for a kernel
    (w8a8's per-call K-major weight) let XLA's layout assignment make the transpose free by laying out the whole
    stack transposed inside the layer loop -- a transposed copy of every layer before the loop (the model's int8
    bytes once more in memory: 6.7 GB for a Llama-2-7B's prefill) -- after which each layer was still copied out
    of it. Pinned, the transpose is each layer's own copy and the stack stays as it is."""
    from jax.experimental.layout import Layout, with_layout_constraint

    return with_layout_constraint(a, Layout(major_to_minor=tuple(range(a.ndim))))


def check_int_scalar(kernel: str, name: str, value) -> None:
    """One clear error unless ``value`` (a kernel's ``layer=`` or slot, possibly traced) is an integer scalar."""
    if jnp.shape(value) != () or not jnp.issubdtype(jnp.asarray(value).dtype, jnp.integer):
        raise ValueError(f"{kernel}: {name} must be an integer scalar, got shape {jnp.shape(value)} "
                         f"({jnp.asarray(value).dtype})")


def one_layer(name: str, wq, w_scale, w_zero_point, layer):
    """Check the ``layer=`` form of a matmul kernel -- ``wq``, ``w_scale`` (and the zero point) stacks
    [L, ...] of one length, ``layer`` an integer scalar -- and return one layer's (wq, w_scale,
    w_zero_point) as shapes, for the kernel's usual checks."""
    lead = wq.shape[:1]
    if wq.ndim != 3 or w_scale.shape[:1] != lead or (w_zero_point is not None and w_zero_point.shape[:1] != lead):
        raise ValueError(f"{name}: with layer=, wq, w_scale (and the zero point) must be stacks [L, ...] of one "
                         f"length; got {wq.shape}, {w_scale.shape}")
    check_int_scalar(name, "layer", layer)
    return tuple(None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (wq, w_scale, w_zero_point))


def span(start, size: int, limit: int, stride: int = 1, in_bounds: bool = False):
    """(pl.ds(start, size, stride), in-bounds mask of length ``size``) for one dim.

    ``in_bounds``: the caller knows every index is below ``limit`` (a static block grid over a
    dim that the block size divides); the mask is then None and the loads and stores it feeds are
    unpredicated (no per-element compare, full-width vector accesses).
    Strided spans lower for Triton but not in interpret mode (jax 0.10.2)."""
    ds = pl.ds(start, size) if stride == 1 else pl.ds(start, size, stride)
    if in_bounds:
        return ds, None
    idx = start + stride * jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    return ds, idx < limit


def tile_mask(rows, cols):
    """The (rows, cols) mask of two :func:`span` results; None when both are in bounds."""
    (_, rm), (_, cm) = rows, cols
    if rm is None and cm is None:
        return None
    if rm is None:
        return jnp.broadcast_to(cm[None, :], (rows[0].size, cm.shape[0]))
    if cm is None:
        return jnp.broadcast_to(rm[:, None], (rm.shape[0], cols[0].size))
    return rm[:, None] & cm[None, :]


def load_tile(ref, rows, cols, other=0, layer=None):
    """Masked 2-D tile load; ``rows``/``cols`` are :func:`span` results. With ``layer`` (a traced
    scalar), ``ref`` holds a stack of such arrays and the tile comes from ``ref[layer]``."""
    (rs, _), (cs, _) = rows, cols
    view = ref.at[rs, cs] if layer is None else ref.at[layer, rs, cs]
    mask = tile_mask(rows, cols)
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=other)


def store_tile(ref, rows, cols, value):
    (rs, _), (cs, _) = rows, cols
    plgpu.store(ref.at[rs, cs], value, mask=tile_mask(rows, cols))


def f32_dot_precision(interpret: bool):
    """Precision for dots with float32 operands: TF32x3 on the GPU, default (exact f32) in interpret mode.

    Seen on an H100 with jax 0.11.2: a float32 ``dot_general`` with default precision
    ran as single-pass TF32 (errors ~5e-4 relative). TF32x3 splits each operand into
    two TF32 halves (about float32 accuracy); integer weights and cache values
    (|v| <= 255) are exact in TF32, so the dot is as exact as the float32 reference
    up to accumulation order. XLA's CPU backend does not take this algorithm, and
    interpret mode is exact in float32 anyway, so it is used only when compiling.
    """
    return None if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot(a, b, *, precision=None, preferred=jnp.float32):
    """(m, k) x (k, n) with ``preferred`` accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred)


# Programs to aim for when a loop is split over several: 2 per SM of an H100 (132 SMs).
TARGET_PROGRAMS = 264


def splits_for(programs: int, k_blocks: int, min_blocks: int = 4, target: int = TARGET_PROGRAMS) -> int:
    """Split the K loop so that ``programs`` x splits reaches ~``target`` programs,
    each split at least ``min_blocks`` K blocks long; 1 when the grid is large enough already."""
    if programs >= target // 2:
        return 1
    return max(1, min(-(-target // programs), k_blocks // min_blocks))


def fit_splits(n_blocks: int, wanted: int) -> tuple[int, int]:
    """(splits, blocks per split) covering ``n_blocks`` loop blocks in at most ``wanted`` equal
    ranges, with no range left empty."""
    per_split = cdiv(n_blocks, max(1, min(wanted, n_blocks)))
    return cdiv(n_blocks, per_split), per_split


def sum_splits(y: jax.Array, splits: int, bias, dtype, fold: tuple[int, float] | None = None) -> jax.Array:
    """Finish a split-K matmul: add the float32 partial sums ``[splits, M, N]``, then bias, then cast.

    With one split the kernel already wrote the finished ``[M, N]`` result. ``fold`` (K, eps): the kernel folded
    an RMSNorm (:class:`NormFold`) and ``y`` is (partial sums, partial sums of squares ``[splits, M, 1]``): the
    sum is scaled by the rows' norm factor before the bias.
    """
    if splits == 1:
        return y
    if fold is not None:
        y, sumsq = y
        k, eps = fold
        # the splits' squares added one by one: XLA fuses those adds into the loop that sums the partials, where
        # a reduce over the splits would be a kernel of its own (deviceless H100 compile)
        total = sumsq[0]
        for s in range(1, splits):
            total = total + sumsq[s]
        return _finish(jnp.sum(y, axis=0) * jax.lax.rsqrt(total / k + eps), bias, dtype)
    return _finish(jnp.sum(y, axis=0), bias, dtype)


def _finish(y: jax.Array, bias, dtype) -> jax.Array:
    """A finished float32 product plus the bias, in ``dtype``."""
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def weight_operands(w, w_scale, w_zero_point) -> list:
    """A matmul kernel's weight operands in :func:`split_refs`' order: the codes as given, the scales as
    float32, the zero points as int8 when there are any."""
    return [w, w_scale.astype(jnp.float32)] + ([] if w_zero_point is None else [w_zero_point.astype(jnp.int8)])


def split_refs(refs, *, stacked: bool, inputs: int, has_zp: bool, has_bias: bool, outputs: int = 1,
               fixup: dict | None = None):
    """A :func:`launch_matmul` kernel's refs in the order it passes them: (the layer index or None, the
    first ``inputs`` operand refs, the zero point ref or None, the bias ref or None, the output ref -- a tuple
    of ``outputs`` refs where there are several: ``pallas_kernels.norm_fold.outputs``). ``fixup`` (the kernel's
    static argument of that name, :func:`launch_matmul`): the output is a ``pallas_kernels.split_fixup.Refs``."""
    rest = list(refs)
    layer = rest.pop(0)[0] if stacked else None  # the weights are a stack: this layer of it
    operands, rest = rest[:inputs], rest[inputs:]
    zp_ref = rest.pop(0) if has_zp else None
    b_ref = rest.pop(0) if has_bias else None
    if fixup:
        from pallas_kernels import split_fixup

        residual = rest.pop(0) if fixup["residual"] else None
        counters = partials = None
        if fixup["splits"] > 1:  # inputs: ..., counters; outputs: out, partials, counters (aliased: the same)
            counters, out, partials, _ = rest
        else:
            (out,) = rest
        rest, outputs = [], 0
        final = split_fixup.Refs(out, residual, partials, counters, fixup["splits"], fixup["interpret"])
    if len(rest) != outputs:
        raise ValueError(f"split_refs: {len(rest)} output refs left, expected {outputs}")
    if fixup:
        return layer, operands, zp_ref, b_ref, final
    return layer, operands, zp_ref, b_ref, rest[0] if outputs == 1 else tuple(rest)


class MatmulProgram(NamedTuple):
    """Where one program of a :func:`launch_matmul` grid works: its row and column :func:`span` s, its K
    blocks ``[first, last)`` (its split of the K loop), whether K is whole blocks (unmasked loads), and the
    product's N."""

    rows: tuple
    cols: tuple
    first: jax.Array
    last: jax.Array
    whole_k: bool
    n: int


def matmul_program(m: int, n: int, k: int, blocks, split_blocks: int) -> MatmulProgram:
    """The :class:`MatmulProgram` of the running program (``pl.program_id`` 0, 1, 2: M tile, N tile, K split)."""
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    first = pl.program_id(2) * split_blocks
    return MatmulProgram(rows=span(pl.program_id(0) * bm, bm, m, in_bounds=m % bm == 0),
                         cols=span(pl.program_id(1) * bn, bn, n, in_bounds=n % bn == 0),
                         first=first, last=jnp.minimum(first + split_blocks, cdiv(k, bk)), whole_k=k % bk == 0, n=n)


ACTS = ("swiglu",)


def swiglu_pairs(y: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of a product whose columns pair a SwiGLU's gate and up (column ``2 i`` gate ``i``,
    ``2 i + 1`` up ``i``: ``llmeq_jax.decode_layout.pair_swiglu``), in float32, back in ``y``'s dtype. On a
    kernel's float32 tile too (a reshape and a split of the last axis: what Triton lowers; a strided slice is not)."""
    pairs = y.astype(jnp.float32).reshape(*y.shape[:-1], y.shape[-1] // 2, 2)
    gate, up = (half.reshape(pairs.shape[:-1]) for half in jnp.split(pairs, 2, axis=-1))
    return (gate * jax.nn.sigmoid(gate) * up).astype(y.dtype)


def store_matmul(o_ref, b_ref, acc, program: MatmulProgram, *, split: bool, has_bias: bool, factor=None,
                 act: str | None = None) -> None:
    """Write a program's float32 (bm, bn) result: with K splits as its float32 partial sum (bias and the cast
    come after :func:`sum_splits` adds them), else plus the bias row, cast to the output's dtype. A
    ``pallas_kernels.split_fixup.Refs`` ``o_ref``: the kernel finishes the sum itself (that module), and
    ``factor()`` (if given, called where the finished sum is made) scales its rows before the bias. ``act``
    "swiglu": the finished tile's column pairs gated (:func:`swiglu_pairs`), half as many output columns."""
    rows, cols = program.rows, program.cols
    out_cols = cols
    if act is not None:  # read here: interpret mode has no program ids inside a branch (split_fixup's)
        half = cols[0].size // 2
        out_cols = span(pl.program_id(1) * half, half, program.n // 2, in_bounds=cols[1] is None)

    def finished(total):
        """(the finished float32 tile, its output columns)."""
        if factor is not None:
            total = total * factor()
        if has_bias:
            total = total + load_tile(b_ref, span(0, 1, 1, in_bounds=True), cols, 0).astype(jnp.float32)
        return (total if act is None else swiglu_pairs(total)), out_cols

    from pallas_kernels import split_fixup  # (it imports this module)

    if isinstance(o_ref, split_fixup.Refs):
        split_fixup.finish(o_ref, acc, program, finished)
    elif split:
        plgpu.store(o_ref.at[pl.program_id(2), rows[0], cols[0]], acc, mask=tile_mask(rows, cols))
    else:
        total, out_cols = finished(acc)
        store_tile(o_ref, rows, out_cols, total.astype(o_ref.dtype))


def launch_matmul(kernel, args: list, *, m: int, n: int, k: int, blocks, bias, k_splits: int | None, out_dtype,
                  interpret: bool, name: str, layer=None, programs: int | None = None,
                  fold_eps: float | None = None, residual=None, fixup: bool = False, act: str | None = None,
                  **static):
    """Run a tiled ``(M, N)`` matmul kernel over the grid ``(M / bm, N / bn, K splits)``: the launch
    shared by the W8A8 and weight-only kernels.

    The K loop is split over programs when the (M, N) grid is too small to fill the GPU
    (:func:`splits_for` aiming at ``programs``, default :data:`TARGET_PROGRAMS`, or ``k_splits``); split
    programs write float32 partials that :func:`sum_splits` adds. ``bias`` is fused into the kernel
    (appended as the last operand) only without splits, else added after the sum. With ``layer`` (an
    integer scalar, the weights being stacks [L, ...]) a (1,) int32 operand holding it goes first, and
    ``stacked=True``.
    ``kernel`` gets ``m, n, k, blocks, has_bias, split_blocks, split, stacked`` and ``static`` as
    keyword arguments (and ``fixup`` where asked for).

    ``fold_eps``: the kernel folds an RMSNorm of this eps into its x (``pallas_kernels.norm_fold``): split programs
    write their rows' partial sums of squares as a second output ``[splits, M, 1]``, which :func:`sum_splits`
    turns into the rows' norm factor.

    ``residual`` (M, N): added to the product (``residual + x @ w``, the residual stream of a decoder block).
    ``fixup`` (the kernel can): the kernel finishes the product itself -- bias, norm factor, residual and cast,
    with split K by the last program of each tile (``pallas_kernels.split_fixup``) -- where it holds no splits or
    takes the scan's counters; its ``fixup`` argument is then ``{splits, residual, interpret}``, else None.
    Elsewhere the residual is added after the product (rounded first, as ``residual + linear(x)`` would).
    ``act`` "swiglu" (a kernel that takes it): the product's column pairs gated (:func:`swiglu_pairs`), (M, N / 2)
    out -- by the kernel where it finishes the product, else after XLA's sum.
    """
    from pallas_kernels import split_fixup  # (it imports this module)

    grid_mn = (cdiv(m, blocks.bm), cdiv(n, blocks.bn))
    k_blocks = cdiv(k, blocks.bk)
    wanted = k_splits or splits_for(grid_mn[0] * grid_mn[1], k_blocks, target=programs or TARGET_PROGRAMS)
    splits, split_blocks = fit_splits(k_blocks, wanted)
    counters = split_fixup.take(grid_mn[0] * grid_mn[1]) if fixup and splits > 1 else None
    finishes = fixup and (splits == 1 or counters is not None)
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"{name}: the residual must be ({m}, {n}) like the product, got {tuple(residual.shape)}")
    if act is not None and (act not in ACTS or n % 2 or blocks.bn % 2 or residual is not None):
        raise ValueError(f"{name}: act must be one of {ACTS} on an even N and column tile, without a residual; got "
                         f"{act!r}, N={n}, bn={blocks.bn}{', a residual' if residual is not None else ''}")
    fused_bias = bias is not None and (splits == 1 or finishes)
    if fused_bias:
        args = [*args, bias.astype(jnp.float32).reshape(1, n)]
    if layer is not None:
        args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *args]
    out_shape = jax.ShapeDtypeStruct((splits, m, n) if splits > 1 else (m, n if act is None else n // 2),
                                     jnp.float32 if splits > 1 else out_dtype)
    if fold_eps is not None and splits > 1:
        out_shape = (out_shape, jax.ShapeDtypeStruct((splits, m, 1), jnp.float32))
    aliases, fixed = {}, None
    if finishes:
        fixed = dict(splits=splits, residual=residual is not None, interpret=interpret)
        args = [*args, residual] if residual is not None else args
        out_shape = jax.ShapeDtypeStruct((m, n if act is None else n // 2), out_dtype)
        if splits > 1:  # the partials' scratch, and the counters back (aliased: updated in place)
            aliases = {len(args): 2}
            args = [*args, counters]
            out_shape = (out_shape, jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
                         jax.ShapeDtypeStruct(counters.shape, counters.dtype))
    body = functools.partial(kernel, m=m, n=n, k=k, blocks=blocks, has_bias=fused_bias, split_blocks=split_blocks,
                             split=splits > 1, stacked=layer is not None, **static,
                             **({"fixup": fixed} if fixup else {}), **({"act": act} if act else {}))
    offsets.check(args, name)
    y = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(*grid_mn, splits),
        input_output_aliases=aliases,
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    if finishes:
        if splits > 1:
            y, _, counters = y
            split_fixup.give(counters)
        return y
    y = sum_splits(y, splits, None if fused_bias else bias, out_dtype, fold=None if fold_eps is None else (k, fold_eps))
    if act is not None and splits > 1:  # the kernel gated its tiles where it finished them
        y = swiglu_pairs(y)
    return y if residual is None else residual + y


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler params; passing them also selects the Triton (not Mosaic GPU) backend."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
