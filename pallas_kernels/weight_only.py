"""Weight-only matmul for int8 and packed int4 weights, dequantized in registers.

Contract (``(in, out)`` weights):
  x        (M, K)            float32 / bfloat16 / float16
  wq       (K, N) int8       (bits=8), or
           (ceil(K/2), N) uint8 (bits=4): byte = (v[2i] & 0xF) | ((v[2i+1] & 0xF) << 4),
                             two's complement nibbles packed along K (QArray layout)
  w_scale  (G, N) float32    G = 1 (per channel) or ceil(K / group)
  w_zero_point (G, N) int8 or None
  bias     (N,) or None
  -> y     (M, N) x.dtype

Math: y = sum_g (x_g @ (q_g - zp_g)) * s_g (+ bias), with the integer weights
converted to x's dtype in registers (exact: |q - zp| <= 255 fits bf16/fp16) and
float32 accumulation. No full-precision copy of the weight is ever written.

For int4 the kernel does not interleave the two nibbles of a byte back into
K order (Triton cannot stack along a non-last axis); it splits the x tile into
its even and odd K columns instead and runs two dots: x_even @ low + x_odd @ high.

Float32 activations use TF32x3 dots on the GPU (``common.f32_dot_precision``): a
default-precision float32 dot ran as single-pass TF32 on an H100 with jax 0.11.2.
Small (M, N) grids (decode) split the K loop over several programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import config, settings
from pallas_kernels.blocks import Blocks, matmul_blocks
from pallas_kernels.common import (
    FLOAT_DTYPES,
    cdiv,
    dot,
    f32_dot_precision,
    high_nibble,
    is_pow2,
    launch_matmul,
    load_tile,
    logical_weight,
    low_nibble,
    matmul_program,
    one_layer,
    span,
    split_pairs,
    split_refs,
    store_matmul,
    weight_operands,
)

SUPPORTED_BITS = (4, 8)


# Dequantization by bit patterns instead of int->float conversions (Marlin's trick; the
# conversion instructions run at a quarter of the float rate and were the decode kernel's
# cost): OR-ing an unsigned code u into the low mantissa bits of MAGIC gives the float
# MAGIC + u exactly, one bitcast away. Nibbles are two's complement, so u = nibble ^ 8 and
# the value is (MAGIC + u) - (MAGIC + 8). Per dot dtype: (integer type, MAGIC bits, MAGIC).
_MAGIC = {
    jnp.dtype(jnp.bfloat16): (jnp.int16, 0x4300, 128.0),  # 7 mantissa bits: u < 128
    jnp.dtype(jnp.float16): (jnp.int16, 0x6400, 1024.0),  # 10 mantissa bits
    jnp.dtype(jnp.float32): (jnp.int32, 0x4B000000, 8388608.0),  # 23 mantissa bits
}
DEQUANT_MODES = ("convert", "magic", "fold", "scaled", "asm", "f16")
# ``f16`` (int8, K-major, per-channel scales, half-precision x): float16 tensor-core operands, each code one
# byte under float16 1024's bits by prmt (pallas_kernels/int8_f16.py); what kernel_dispatch gives a decode
# step's K-major int8 products (0.66-1.42x bf16 on an H200, 2026-11-28).
# ``scaled`` (int4 with group scales, half-precision x): each weight tile is dequantized with its scale
# and zero point, (code - zp) * s in float32 rounded once to x's dtype -- the weights XLA's path
# multiplies -- so the dots accumulate across groups in the MMA, with no float32 epilogue per K step.
# For prefill: compiled for sm_90 at M = 2048 its K loop issues 0.046 instructions per weight and row
# of x (256-row tiles) against fold's 0.100 (128-row tiles; fold spills at 256), scripts/kernel_sass.py.
# Not timed yet: off by default; scripts/tune_weight_only.py tries it.
SCALED_WIDE_M = 1024


def int4_offset(cdt) -> float:
    """What ``dequant_int4(..., "fold")`` leaves added to every value: MAGIC + 8."""
    return _MAGIC[jnp.dtype(cdt)][2] + 8.0


def dequant_int4(packed, cdt, mode: str):
    """(r, n) packed bytes -> (low, high) nibble values as ``cdt`` arrays, each (r, n).

    ``convert``: int32 arithmetic and an int->float conversion per value. ``magic``: bit
    patterns (see _MAGIC), exact. ``fold``: the bit patterns alone, each value carrying
    ``int4_offset(cdt)``, which the caller removes after the dot through the sum of x
    (one (M, N) correction instead of a subtraction per weight; float32 excluded, since
    its offset 2^23 would swamp the accumulator).
    """
    if mode == "convert":
        b = packed.astype(jnp.int32)
        return low_nibble(b).astype(cdt), high_nibble(b).astype(cdt)
    itype, bits, magic = _MAGIC[jnp.dtype(cdt)]
    b = packed.astype(itype) ^ 0x88  # both nibbles to offset-8 unsigned codes
    low = jax.lax.bitcast_convert_type((b & 15) | bits, cdt)
    high = jax.lax.bitcast_convert_type(((b >> 4) & 15) | bits, cdt)
    if mode == "fold":
        return low, high
    off = jnp.asarray(magic + 8.0, cdt)
    return low - off, high - off


# ``asm``: ``fold``'s values from inline PTX, four bytes (four columns) per 32-bit register: the
# nibbles moved to offset binary with one xor, two bytes spread to the halves of a word by prmt, and
# one lop3 per two values OR-ing them into bf16/f16 MAGIC patterns -- Marlin's dequantization, which
# Pallas's jnp ops cannot spell (they work one value at a time). The values equal ``fold``'s, which
# interpret mode runs instead (no PTX there).
_ASM_MAGIC = {jnp.dtype(jnp.bfloat16): "0x43004300", jnp.dtype(jnp.float16): "0x64006400"}


def _asm_nibbles(high: bool, magic: str) -> str:
    """PTX: 4 packed bytes ($2) -> their low (or high) nibbles as 4 MAGIC + code halves ($0, $1)."""
    shift = "shr.b32 t0, t0, 4;\nshr.b32 t1, t1, 4;\n" if high else ""
    return ("{\n.reg .b32 w, t0, t1;\nxor.b32 w, $2, 0x88888888;\n"
            "prmt.b32 t0, w, 0, 0x4140;\nprmt.b32 t1, w, 0, 0x4342;\n" + shift +
            f"lop3.b32 $0, t0, 0x000F000F, {magic}, 0xEA;\nlop3.b32 $1, t1, 0x000F000F, {magic}, 0xEA;\n}}")


def dequant_int4_asm(packed, cdt, interpret: bool):
    """(r, n) packed bytes -> (low, high) as ``cdt`` (bfloat16/float16), each value + ``int4_offset(cdt)``:
    ``dequant_int4(..., "fold")``'s values, by inline PTX on a GPU."""
    if interpret:
        return dequant_int4(packed, cdt, "fold")
    magic = _ASM_MAGIC[jnp.dtype(cdt)]
    out = jax.ShapeDtypeStruct(packed.shape, cdt)
    return tuple(plgpu.elementwise_inline_asm(_asm_nibbles(high, magic), args=[packed], constraints="=r,=r,r", pack=4,
                                              result_shape_dtypes=[out])[0] for high in (False, True))


def _kernel(*refs, m, n, k, bits, blocks, group, has_zp, has_bias, split_blocks, split, precision, dequant,
            strided_x, stacked, kmajor, interpreted, fixup=None, act=None):
    layer, (x_ref, w_ref, ws_ref), zp_ref, b_ref, o_ref = split_refs(
        refs, stacked=stacked, inputs=3, has_zp=has_zp, has_bias=has_bias, fixup=fixup)
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    # one K step covers `steps` scale groups (per-channel scales: one step, scaled at the end)
    sub = group if group is not None else bk
    steps = bk // sub
    cdt = x_ref.dtype  # dot operand dtype: integer weights are exact in it
    prec = precision if jnp.dtype(cdt) == jnp.float32 else None
    fold = dequant in ("fold", "asm") and bits == 4  # int8 values are converted: no offset to fold
    scaled = dequant == "scaled"  # int4 with group scales (the wrapper refuses it otherwise)
    prog = matmul_program(m, n, k, blocks, split_blocks)
    rows, cols, first, last, whole_k = prog[:5]  # whole_k: every K step (and scale group it reads) in bounds

    def row_of(ref, g, lay=None):
        return load_tile(ref, span(g, 1, ref.shape[-2], in_bounds=whole_k), cols, 0, lay).astype(jnp.float32)

    def group_part(k0, g, acc):
        """x[:, k0:k0+sub] @ (q - zp)[k0:k0+sub] for scale group g, float32 (M, N) (``scaled``: the
        weights carry the scale, and ``acc`` plus the product comes back)."""
        if bits == 8:
            ks = span(k0, sub, k, in_bounds=whole_k)
            xt = load_tile(x_ref, rows, ks, 0)
            if kmajor:  # w_ref is (N, K): contract its last dim
                wt = load_tile(w_ref, cols, ks, 0, layer).astype(jnp.int32).astype(cdt)
                part = jax.lax.dot_general(xt, wt, (((1,), (1,)), ((), ())), precision=prec,
                                           preferred_element_type=jnp.float32)
            else:
                wt = load_tile(w_ref, ks, cols, 0, layer).astype(jnp.int32)
                part = dot(xt, wt.astype(cdt), precision=prec)
            x_parts = (xt,)
        else:
            half = sub // 2
            packed = load_tile(w_ref, span(k0 // 2, half, w_ref.shape[-2], in_bounds=whole_k), cols, 0, layer)
            if scaled:  # the weights themselves dequantized: (code - zp) * scale, one rounding to cdt
                codes = dequant_int4(packed, jnp.float32, "magic")
                zp = row_of(zp_ref, g, layer) if has_zp else 0.0
                scale = row_of(ws_ref, g, layer)
                low, high = (((c - zp) * scale).astype(cdt) for c in codes)
            elif dequant == "asm":
                low, high = dequant_int4_asm(packed, cdt, interpreted)
            else:
                low, high = dequant_int4(packed, cdt, dequant)
            if strided_x:  # even and odd K columns straight from memory: no shuffle in registers
                x_even = load_tile(x_ref, rows, span(k0, half, k, stride=2), 0)
                x_odd = load_tile(x_ref, rows, span(k0 + 1, half, k, stride=2), 0)
            else:
                x_even, x_odd = split_pairs(load_tile(x_ref, rows, span(k0, sub, k, in_bounds=whole_k), 0))
            if scaled:  # each dot straight into the accumulator (Triton folds acc + dot into the MMA)
                return acc + dot(x_even, low, precision=prec) + dot(x_odd, high, precision=prec)
            part = dot(x_even, low, precision=prec) + dot(x_odd, high, precision=prec)
            x_parts = (x_even, x_odd)
        # zero points (and the folded offset) come off through the row sums of x: exact algebra
        if (has_zp or fold) and not scaled:
            x_sum = sum(jnp.sum(a.astype(jnp.float32), axis=1, keepdims=True) for a in x_parts)
            shift = (row_of(zp_ref, g, layer) if has_zp else 0.0) + (int4_offset(cdt) if fold else 0.0)
            part = part - x_sum * shift
        return part

    def body(kb, acc):
        for j in range(steps):  # static: the groups of one K step
            g = kb * steps + j
            part = group_part(g * sub, g if group is not None else 0, acc)
            if scaled:
                acc = part
            else:
                acc = acc + (part * row_of(ws_ref, g, layer) if group is not None else part)
        return acc

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((bm, bn), jnp.float32))
    if group is None:
        acc = acc * row_of(ws_ref, 0, layer)
    store_matmul(o_ref, b_ref, acc, prog, split=split, has_bias=has_bias, act=act)


def _check(x, wq, w_scale, w_zero_point, bits, group, layer=None):
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"weight_only_matmul: bits={bits} is not supported; expected one of {SUPPORTED_BITS}")
    if layer is not None:  # a stack of weights [L, ...]: check one layer's shapes
        return _check(x, *one_layer("weight_only_matmul", wq, w_scale, w_zero_point, layer), bits, group)
    if x.ndim != 2 or wq.ndim != 2:
        raise ValueError(f"weight_only_matmul expects 2-D x and wq; got {x.shape} and {wq.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"weight_only_matmul: x must be float32/bfloat16/float16, got {x.dtype}")
    k = x.shape[1]
    want_rows, want_dtype = (k, jnp.int8) if bits == 8 else (cdiv(k, 2), jnp.uint8)
    if wq.shape[0] != want_rows or wq.dtype != want_dtype:
        raise ValueError(
            f"weight_only_matmul: int{bits} weights for K={k} must be {jnp.dtype(want_dtype).name} with "
            f"{want_rows} rows, got {wq.dtype} {wq.shape}"
        )
    groups = 1 if group is None else cdiv(k, group)
    if w_scale.shape != (groups, wq.shape[1]):
        raise ValueError(f"weight_only_matmul: w_scale has shape {w_scale.shape}, expected {(groups, wq.shape[1])}")
    if w_zero_point is not None and w_zero_point.shape != w_scale.shape:
        raise ValueError(f"weight_only_matmul: zero point shape {w_zero_point.shape} != scale shape {w_scale.shape}")
    if group is not None and not (is_pow2(group) and group >= 32):
        raise ValueError(f"weight_only_matmul: group size must be a power of two >= 32, got {group}")


def weight_only_matmul(
    x,
    wq,
    w_scale,
    *,
    bits: int,
    w_zero_point=None,
    bias=None,
    group: int | None = None,
    blocks: Blocks | None = None,
    k_splits: int | None = None,
    dequant: str | None = None,
    strided_x: bool | None = None,
    gemv: bool | None = None,
    layer=None,
    w_layout: str = "kn",
    residual=None,
    norm=None,
    act: str | None = None,
    interpret: bool | None = None,
):
    """``x @ dequantize(w)`` with the weight dequantized tile by tile in registers; with ``residual`` (M, N),
    ``residual + x @ dequantize(w)`` (added by the kernel where it finishes its product: ``pallas_kernels.split_fixup``).
    ``norm`` (``dequant="f16"`` only): ``rms_norm(x) @ dequantize(w)``, folded by ``pallas_kernels.int8_f16``.
    ``act`` "swiglu" (not ``gemv``): ``w``'s outputs pair a SwiGLU's gate and up
    (``llmeq_jax.decode_layout.pair_swiglu``), and the product comes back gated, (M, N / 2): by the kernel where it
    finishes the product (``common.launch_matmul``).

    ``gemv=True`` (M <= ``gemv.GEMV_MAX_ROWS``) runs the multiply-and-sum formulation of
    :mod:`pallas_kernels.gemv` instead of tensor-core dots (``blocks`` then gives its N and K blocks;
    ``dequant`` and ``strided_x`` do not apply). Off by default until measured on a GPU.

    When the (M, N) tile grid is too small to fill the GPU (decode), the K loop is
    split over ``k_splits`` programs (default :func:`common.splits_for`) whose float32
    partial sums are added afterwards. With per-group scales a K block spans one or
    more whole groups. ``dequant`` picks how int4 codes become floats (:func:`dequant_int4`;
    default :func:`default_dequant`). ``strided_x`` loads int4's even and odd K columns of x
    with strided loads instead of splitting one tile in registers (compiled kernels only:
    interpret mode has no strided loads). With ``layer`` (an int32 scalar, traced or not), ``wq``,
    ``w_scale`` and the zero point are stacks [L, ...] of that shape and the kernel reads layer
    ``layer`` of them in place: inside a scan over stacked blocks no layer's weights are copied out.
    ``w_layout="nk"`` (int8 only): ``wq`` is stored K-major, ``(N, K)``, a copy made once (e.g. by
    ``llmeq_jax.decode_layout.for_decode``); each thread then loads consecutive K values for its MMA
    operands instead of gathering N-major bytes one at a time (SASS at M = 1: 4.5 instructions per
    weight instead of 7.1, ``scripts/kernel_sass.py``).
    """
    logical = logical_weight("weight_only_matmul", wq, w_layout)
    kmajor = w_layout == "nk"
    if kmajor and (bits != 8 or gemv):
        raise ValueError(f"weight_only_matmul: w_layout={w_layout!r} is not one of 'kn' (K, N) or 'nk' (N, K, int8 "
                         "weights and the dot kernel only: K-major int4 bytes would be gathered one at a time)")
    _check(x, logical, w_scale, w_zero_point, bits, group, layer)
    if norm is not None and (gemv or dequant != "f16"):
        raise ValueError(f"weight_only_matmul: a folded norm needs dequant='f16' (pallas_kernels.int8_f16), got "
                         f"dequant={dequant!r}{', gemv' if gemv else ''}")
    if gemv and act is not None:
        raise ValueError(f"weight_only_matmul: act={act!r} is for the dot kernels, not gemv")
    if gemv:
        from pallas_kernels.gemv import weight_only_gemv

        y = weight_only_gemv(x, wq, w_scale, bits=bits, w_zero_point=w_zero_point, bias=bias, group=group,
                             blocks=blocks, k_splits=k_splits, layer=layer, interpret=config.resolve_interpret(interpret))
        return y if residual is None else residual + y
    m, k = x.shape
    n = logical.shape[-1]
    dequant = dequant or default_dequant(x.dtype)
    half = jnp.dtype(x.dtype) != jnp.float32
    if dequant == "f16":
        from pallas_kernels.int8_f16 import int8_f16_matmul

        if not (kmajor and half and group is None):
            raise ValueError("weight_only_matmul: dequant='f16' takes int8 weights stored K-major (w_layout='nk') "
                             "with per-channel scales and bfloat16/float16 activations")
        return int8_f16_matmul(x, wq, w_scale, w_zero_point=w_zero_point, bias=bias, blocks=blocks,
                               k_splits=k_splits, layer=layer, norm=norm, residual=residual, act=act,
                               interpret=config.resolve_interpret(interpret))
    if dequant not in DEQUANT_MODES or (dequant in ("fold", "asm") and not half) or (
            dequant == "scaled" and not (half and bits == 4 and group is not None)):
        raise ValueError(f"weight_only_matmul: dequant={dequant!r} is not one of {DEQUANT_MODES} "
                         "('fold' and 'asm' need bfloat16/float16 activations; 'scaled' those and int4 group scales)")
    if blocks is None and dequant == "scaled" and m >= SCALED_WIDE_M:
        blocks = Blocks(256, 128, group, 8, 3)  # no epilogue per K step: room for 256-row tiles (no spills)
    # int4 splits the K tile in halves that feed dots: each half needs >= 16.
    chosen = settings.of("weight_only", m)
    blocks = blocks or chosen.blocks(matmul_blocks(m, n, k, group, min_bk=32 if bits == 4 else 16))
    k_splits = k_splits or chosen.k_splits
    if group is not None and blocks.bk % group:
        raise ValueError(f"weight_only_matmul: with per-group scales the K block ({blocks.bk}) must be a multiple "
                         f"of the group ({group})")
    interpret = config.resolve_interpret(interpret)
    args = [x, *weight_operands(wq, w_scale, w_zero_point)]
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias, k_splits=k_splits, out_dtype=x.dtype,
                         interpret=interpret, name=f"weight_only_int{bits}_matmul", bits=bits, group=group,
                         has_zp=w_zero_point is not None, precision=f32_dot_precision(interpret), dequant=dequant,
                         strided_x=bool(strided_x) and not interpret, layer=layer, kmajor=kmajor, interpreted=interpret,
                         programs=chosen.programs, residual=residual, fixup=chosen.reduce != "xla", act=act)


def default_dequant(x_dtype) -> str:
    """How int4 codes become floats by default: ``fold`` for bfloat16/float16 activations (the fastest
    of the three on an H200, jax 0.11.2: 26.8 us vs convert 29.9 and magic 40.7 at M=1, 4096x11008;
    M=16 28.8 / 32.4 / 44.3; scripts/tune_weight_only.py), ``convert`` for float32."""
    return "convert" if jnp.dtype(x_dtype) == jnp.float32 else "fold"


def unpack_int4_rows(wq, k: int):
    """(ceil(K/2), N) packed bytes -> (K, N) int8 values (reference-side unpacking)."""
    b = wq.astype(jnp.int32)
    v = jnp.stack([low_nibble(b), high_nibble(b)], axis=1).reshape(-1, wq.shape[1])
    return v[:k].astype(jnp.int8)


def weight_only_reference(x, wq, w_scale, *, bits, w_zero_point=None, bias=None, group=None):
    """Pure-jnp reference of the kernel's math: per-group dots on integer weights, f32 accumulation."""
    _check(x, wq, w_scale, w_zero_point, bits, group)
    k = x.shape[1]
    q = wq if bits == 8 else unpack_int4_rows(wq, k)
    g = k if group is None else group
    y = jnp.zeros((x.shape[0], q.shape[1]), jnp.float32)
    for gi, k0 in enumerate(range(0, k, g)):
        qi = q[k0 : k0 + g].astype(jnp.int32)
        if w_zero_point is not None:
            qi = qi - w_zero_point[gi].astype(jnp.int32)
        part = jax.lax.dot(x[:, k0 : k0 + g], qi.astype(x.dtype), preferred_element_type=jnp.float32)
        y = y + part * w_scale[gi]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def can_use(x_shape, x_dtype, bits: int, k: int, group: int | None) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    if bits not in SUPPORTED_BITS:
        return False, f"int{bits} weights (kernels exist for {SUPPORTED_BITS})"
    if len(x_shape) != 2 or x_shape[1] != k:
        return False, f"x must be (M, {k}), got {tuple(x_shape)}"
    if jnp.dtype(x_dtype) not in FLOAT_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not float32/bfloat16/float16"
    if group is not None and not (is_pow2(group) and group >= 32):
        return False, f"group size {group} is not a power of two >= 32"
    return True, ""
