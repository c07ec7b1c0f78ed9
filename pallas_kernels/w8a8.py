"""W8A8 matmul: quantize activations per token, int8 x int8 -> int32 GEMM with a fused rescale
(or FP8: E4M3 x E4M3 -> float32, on GPUs with FP8 tensor cores).

Contract (``(in, out)`` weights, as everywhere in llmeq_jax):
  x        (M, K)  float32 / bfloat16 / float16
  wq       (K, N)  int8
  w_scale  (G, N)  float32, G = 1 (per channel) or ceil(K / group) (per group; last group shorter)
  w_zero_point (G, N) int8 or None
  bias     (N,)    or None
  act_scale        None -> dynamic per-token absmax; else a static per-tensor scale (scalar)
  -> y     (M, N)  x.dtype

Numerics are the core's (``llmeq_jax.ops.w8a8_xla``): scale_x = max(absmax, tiny) / 127,
x_q = clip(round_half_even(x / scale_x), -127, 127); per group g
acc_g = sum_k x_q w_q (int32) [- sum_k x_q * zp_g]; y = (sum_g acc_g * s_g) * scale_x (+ bias).

Two steps. (1) The activations are quantized once, by jnp ops that XLA fuses into
one pass over x (absmax per row, divide, round, clip): int8 x_q (M, K) and
scale_x (M, 1). (2) A Pallas kernel, one program per (bm x bn) output tile (and
per K split when the grid is small, as in decode), runs int8 tensor-core dots
with int32 accumulation and applies weight scales, zero points, scale_x and bias
in its epilogue. From M >= TRANSPOSE_MIN_M the weight is passed transposed
(N, K), because Hopper's int8 wgmma takes K-major operands only: on an H100
that took M=2048 x 4096 x 11008 from 0.72 ms to 0.25 ms, the per-call transpose
included. A first version quantized x inside the GEMM; measured on an
H100 it ran at ~85 TOP/s (0.11x bf16), the per-tile quantize on the CUDA cores
being redone for every N tile -- see the README.

FP8 (``fp8=True``): the same kernel with E4M3 operands (``llmeq_jax.core.fp8grid``): the
weight codes are E4M3 bit patterns in int8 (bit-cast in the kernel, no copy), x is scaled
per token onto 448 and cast (saturating, ties to even), the dots accumulate in float32,
and there are no zero points. E4M3 dots need sm_89+ (Ada, Hopper): :func:`fp8_supported`.
Each K block's dot is :func:`pallas_kernels.fp8_dot.fp8_dot_acc`, which lets Triton use Hopper's
FP8 wgmma (Pallas's own dot made Triton convert both operands to float16 instead); x's codes, and
the weight where the transpose writes it anyway, reach the kernel as float8 arrays so that the
pipelined loads feed the tensor cores from shared memory without a pass through registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmeq_jax.core import fp8grid
from pallas_kernels import config, fp8_dot, settings
from pallas_kernels.blocks import Blocks, matmul_blocks
from pallas_kernels.common import (
    FLOAT_DTYPES,
    TINY,
    cdiv,
    is_pow2,
    launch_matmul,
    load_tile,
    logical_weight,
    matmul_program,
    one_layer,
    row_major,
    span,
    split_refs,
    store_matmul,
    weight_operands,
)

QMAX = 127
# From this many rows on, the weight is transposed per call to K-major (see w8a8_matmul): int8
# wgmma on Hopper takes K-major operands only. Below it the transpose would cost more than it saves.
TRANSPOSE_MIN_M = 1024


def quantize_rows(x, act_scale=None, fp8: bool = False):
    """(x_q int8 (M, K), scale_x float32 (M, 1)): per-token absmax, or the static per-tensor scale.

    ``fp8``: x_q holds E4M3 bit patterns (the absmax maps onto 448 instead of 127)."""
    xf = x.astype(jnp.float32)
    top = fp8grid.MAX if fp8 else QMAX
    if act_scale is None:
        sx = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), TINY) / top
    else:
        sx = jnp.broadcast_to(jnp.asarray(act_scale, jnp.float32).reshape(1, 1), (x.shape[0], 1))
    if fp8:
        return fp8grid.encode(xf / sx), sx
    return jnp.clip(jnp.round(xf / sx), -QMAX, QMAX).astype(jnp.int8), sx


def fp8_supported(device=None) -> bool:
    """Whether E4M3 dots lower on ``device`` (default: the first device): sm_89+ on CUDA; always in
    interpret mode, where XLA widens them."""
    if config.interpret_enabled():
        return True
    if not fp8_dot.TRITON_LOWERING:  # this JAX's Pallas took no FP8 dot rule: its dots would miss wgmma
        return False
    cc = config.compute_capability(device)
    return cc is not None and cc >= (8, 9)


def _kernel(*refs, m, n, k, blocks, group, has_zp, has_bias, split_blocks, split, w_kmajor, stacked, fp8, fixup=None,
            act=None):
    layer, (xq_ref, sx_ref, w_ref, ws_ref), zp_ref, b_ref, o_ref = split_refs(
        refs, stacked=stacked, inputs=4, has_zp=has_zp, has_bias=has_bias, fixup=fixup)
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    prog = matmul_program(m, n, k, blocks, split_blocks)
    rows, cols, first, last, whole_k = prog[:5]  # whole_k: every K block in bounds, unmasked loads

    def row_of(ref, g, lay=None):  # one (1, bn) row of a per-group array
        return load_tile(ref, span(g, 1, ref.shape[-2], in_bounds=True), cols, 0, lay).astype(jnp.float32)

    exact = jnp.float32 if fp8 else jnp.int32  # what one K block's dot accumulates in

    def operand(t):  # E4M3 codes as the dot's operand: bit-cast here where XLA did not pass float8 already
        return jax.lax.bitcast_convert_type(t, fp8grid.DTYPE) if fp8 and t.dtype == jnp.int8 else t

    def zero(ref):  # what masked loads fill in, in the ref's dtype (Pallas cannot cast 0 to float8)
        return jnp.zeros((), ref.dtype)

    def block_dot(xt, wt, acc):
        """acc + this K block's product (fp8: the tensor cores' own accumulation, see fp8_dot)."""
        if fp8:
            return fp8_dot.fp8_dot_acc(xt, wt, acc, b_kmajor=w_kmajor)
        dims = (((1,), (1,)), ((), ())) if w_kmajor else (((1,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(xt, wt, dims, preferred_element_type=exact)

    def body(kb, carry):
        acc, xsum = carry
        ks = span(kb * bk, bk, k, in_bounds=whole_k)
        xt = operand(load_tile(xq_ref, rows, ks, zero(xq_ref)))
        # w_kmajor: w_ref is (N, K), contracted on its last dim (int8/fp8 tensor cores on Hopper want this)
        w_rows, w_cols = (cols, ks) if w_kmajor else (ks, cols)
        wt = operand(load_tile(w_ref, w_rows, w_cols, zero(w_ref), layer))
        tsum = jnp.sum(xt.astype(jnp.int32), axis=1, keepdims=True) if has_zp else xsum
        if group is None:  # one scale for all of K: keep exact int32 (fp8: float32) accumulation
            return block_dot(xt, wt, acc), (xsum + tsum) if has_zp else xsum
        partf = block_dot(xt, wt, jnp.zeros((bm, bn), exact)).astype(jnp.float32)
        if has_zp:
            partf = partf - tsum.astype(jnp.float32) * row_of(zp_ref, kb, layer)
        return acc + partf * row_of(ws_ref, kb, layer), xsum

    acc_dtype = exact if group is None else jnp.float32
    init = (jnp.zeros((bm, bn), acc_dtype), jnp.zeros((bm, 1), jnp.int32))
    acc, xsum = jax.lax.fori_loop(first, last, body, init)
    if group is None:
        accf = acc.astype(jnp.float32)
        if has_zp:
            accf = accf - xsum.astype(jnp.float32) * row_of(zp_ref, 0, layer)
        acc = accf * row_of(ws_ref, 0, layer)
    y = acc * load_tile(sx_ref, rows, span(0, 1, 1, in_bounds=True), 1.0)
    store_matmul(o_ref, b_ref, y, prog, split=split, has_bias=has_bias, act=act)


def _check(x, wq, w_scale, w_zero_point, group, layer=None, fp8=False):
    if layer is not None:  # a stack of weights [L, ...]: check one layer's shapes
        return _check(x, *one_layer("w8a8_matmul", wq, w_scale, w_zero_point, layer), group, fp8=fp8)
    if fp8 and w_zero_point is not None:
        raise ValueError("w8a8_matmul: fp8 weights are symmetric (E4M3 codes have no zero point)")
    if x.ndim != 2 or wq.ndim != 2 or x.shape[1] != wq.shape[0]:
        raise ValueError(f"w8a8_matmul expects x (M, K) and wq (K, N); got {x.shape} and {wq.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"w8a8_matmul: x must be float32/bfloat16/float16, got {x.dtype}")
    if wq.dtype != jnp.int8:
        raise ValueError(f"w8a8_matmul: wq must be int8 (fp8: E4M3 bit patterns in int8), got {wq.dtype}")
    k, n = wq.shape
    groups = 1 if group is None else cdiv(k, group)
    if w_scale.shape != (groups, n):
        raise ValueError(f"w8a8_matmul: w_scale has shape {w_scale.shape}, expected {(groups, n)} (group={group})")
    if w_zero_point is not None and w_zero_point.shape != w_scale.shape:
        raise ValueError(f"w8a8_matmul: zero point shape {w_zero_point.shape} != scale shape {w_scale.shape}")
    if group is not None and not (is_pow2(group) and group >= 16):
        raise ValueError(f"w8a8_matmul: group size must be a power of two >= 16, got {group}")


def w8a8_matmul(
    x,
    wq,
    w_scale,
    *,
    w_zero_point=None,
    bias=None,
    act_scale=None,
    group: int | None = None,
    blocks: Blocks | None = None,
    k_splits: int | None = None,
    transpose_w: bool | None = None,
    layer=None,
    fp8: bool = False,
    w_layout: str = "kn",
    residual=None,
    codes=None,
    act: str | None = None,
    interpret: bool | None = None,
):
    """Quantize activations + int8 GEMM with fused rescale (see module docstring for the contract); with
    ``residual`` (M, N), ``residual + x @ w`` (added by the kernel where it finishes its product:
    ``pallas_kernels.split_fixup``).

    ``fp8``: ``wq`` holds E4M3 bit patterns; x is quantized to E4M3 and the dots are FP8 x FP8.

    ``transpose_w`` (default: M >= TRANSPOSE_MIN_M) feeds the kernel ``wq.T``, made by XLA
    for each call (K*N bytes read and written), so that the int8 weight tile is K-major.
    ``w_layout="nk"``: ``wq`` is already stored K-major, ``(N, K)`` (a copy made once, e.g. by
    ``llmeq_jax.decode_layout.for_decode`` for a decode loop): the kernel reads it as it is, with
    no per-call transpose; ``w_scale`` and the zero point stay ``(G, N)``.
    With ``layer`` (an int32 scalar), ``wq``, ``w_scale`` and the zero point are stacks [L, ...]
    and the kernel reads that layer in place (the per-call transpose slices it: it copies anyway).
    ``codes``: x's per-token int8 codes and scales made already, ``(x_q (M, K), scale_x (M, 1))``
    (``pallas_kernels.token_codes``: a decode step's, its norm too, in one launch; with ``fp8`` E4M3 bit patterns);
    x then gives the shape and the output's dtype. Dynamic per-token scales only (no ``act_scale``).
    ``act`` "swiglu": ``wq``'s outputs pair a SwiGLU's gate and up (``llmeq_jax.decode_layout.pair_swiglu``), and the
    product comes back gated, (M, N / 2): by the kernel where it finishes the product (``common.launch_matmul``).
    """
    logical = logical_weight("w8a8_matmul", wq, w_layout)
    given_kmajor = w_layout == "nk"
    _check(x, logical, w_scale, w_zero_point, group, layer, fp8)
    m, k = x.shape
    n = logical.shape[-1]
    chosen = settings.of("w8a8", m)
    blocks = blocks or chosen.blocks(matmul_blocks(m, n, k, group, int8=True))
    k_splits = k_splits or chosen.k_splits
    if group is not None and blocks.bk != group:
        raise ValueError(f"w8a8_matmul: with per-group scales the K block must equal the group ({group}), got {blocks.bk}")
    if codes is not None:
        _check_codes(codes, x.shape, act_scale)
        xq, sx = codes
    else:
        xq, sx = quantize_rows(x, act_scale, fp8)
    w_kmajor = given_kmajor or (m >= TRANSPOSE_MIN_M if transpose_w is None else bool(transpose_w))
    transposing = w_kmajor and not given_kmajor
    if transposing and layer is not None:
        one = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)  # noqa: E731
        wq, w_scale, w_zero_point, layer = one(wq), one(w_scale), one(w_zero_point), None
        wq = row_major(wq)
    wk = wq.T if transposing else wq
    if fp8:  # float8 operands for the kernel where XLA writes them anyway: x's quantization, the transpose
        xq = jax.lax.bitcast_convert_type(xq, fp8grid.DTYPE)
        wk = jax.lax.bitcast_convert_type(wk, fp8grid.DTYPE) if transposing else wk
    args = [xq, sx, *weight_operands(wk, w_scale, w_zero_point)]
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias, k_splits=k_splits, out_dtype=x.dtype,
                         interpret=config.resolve_interpret(interpret), name="w8a8_matmul", group=group,
                         has_zp=w_zero_point is not None, w_kmajor=w_kmajor, layer=layer, fp8=fp8,
                         programs=chosen.programs, residual=residual, fixup=chosen.reduce != "xla", act=act)


def _check_codes(codes, x_shape, act_scale) -> None:
    xq, sx = codes
    if act_scale is not None:
        raise ValueError("w8a8_matmul: codes= are dynamic per-token codes (no act_scale)")
    if xq.shape != tuple(x_shape) or xq.dtype != jnp.int8 or sx.shape != (x_shape[0], 1):
        raise ValueError(f"w8a8_matmul: codes= must be int8 {tuple(x_shape)} codes and float32 ({x_shape[0]}, 1) "
                         f"scales, got {xq.dtype} {tuple(xq.shape)} and {tuple(sx.shape)}")


def w8a8_reference(x, wq, w_scale, *, w_zero_point=None, bias=None, act_scale=None, group=None, fp8=False):
    """Pure-jnp W8A8 with the kernel's math (jnp.round, int32 dots per group; ``fp8``: the E4M3 values
    widened to float32, float32 dots at full precision)."""
    _check(x, wq, w_scale, w_zero_point, group, fp8=fp8)
    k, n = wq.shape
    xf = x.astype(jnp.float32)
    top = fp8grid.MAX if fp8 else QMAX
    if act_scale is None:
        sx = jnp.maximum(jnp.max(jnp.abs(xf), axis=1, keepdims=True), TINY) / top
    else:
        sx = jnp.asarray(act_scale, jnp.float32)
    if fp8:
        xq, wq = fp8grid.decode(fp8grid.encode(xf / sx)), fp8grid.decode(wq)
    else:
        xq = jnp.clip(jnp.round(xf / sx), -QMAX, QMAX).astype(jnp.int8)
    g = k if group is None else group
    y = jnp.zeros((x.shape[0], n), jnp.float32)
    for gi, k0 in enumerate(range(0, k, g)):
        xs, ws = xq[:, k0 : k0 + g], wq[k0 : k0 + g]
        acc = jax.lax.dot(xs, ws, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32 if fp8 else jnp.int32).astype(jnp.float32)
        if w_zero_point is not None:
            acc = acc - jnp.sum(xs.astype(jnp.int32), axis=1, keepdims=True).astype(jnp.float32) * w_zero_point[gi]
        y = y + acc * w_scale[gi]
    y = y * sx
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def can_use(x_shape, x_dtype, wq_dtype, k: int, group: int | None) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    if len(x_shape) != 2 or x_shape[1] != k:
        return False, f"x must be (M, {k}), got {tuple(x_shape)}"
    if jnp.dtype(x_dtype) not in FLOAT_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not float32/bfloat16/float16"
    if jnp.dtype(wq_dtype) != jnp.int8:
        return False, f"weight values must be int8, got {jnp.dtype(wq_dtype).name}"
    if group is not None and not (is_pow2(group) and group >= 16):
        return False, f"group size {group} is not a power of two >= 16"
    return True, ""
