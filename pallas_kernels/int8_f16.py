"""Weight-only int8 matmul for decode with float16 tensor-core operands: one ``prmt`` per two weights.

Why: an int8 code cannot become a bf16 operand by bit patterns (bf16 holds 7 mantissa bits, a code
needs 8), so the K-major int8 kernel (:mod:`pallas_kernels.weight_only`, ``w_layout="nk"``) leaves the
conversion to Triton, which spends ``LOP3`` + ``PRMT`` + ``HADD2`` and register moves on it: 4.5
instructions per weight in its sm_90 decode loop, against 1.2 for a bf16 weight. A float16 operand
has 10 mantissa bits: the byte ``u = v + 128`` (offset binary) under the bits of 1024.0 is the float16
``1024 + u`` exactly, and one ``prmt`` (:data:`CODE_ASM`) builds two such operands from a word of four
K-consecutive codes (an ``xor`` first moves four signed codes to offset binary). The offset
``1152 + zero point`` comes off once, after the K loop, through x's row sums (carried in the loop).

The activations become float16 operands: float16 x as it is, bfloat16 x multiplied by
:data:`X_SCALE` (a power of two: exact) first, which leaves room up to 65504 / X_SCALE = 1.7e7 (a bf16
value beyond that would become inf; nothing checks, LLM activations stay orders of magnitude below) and
puts values under 2^-6 in float16's subnormal range, where their absolute error is at most 2^-17 --
below what bf16 itself resolves at that size. The result is scaled back before it is stored.
Where: in the kernel, each K step's x tile, or by XLA before the launch (``settings.override("int8_f16",
convert="xla")``; on a GPU by default while the norm kernel has not run on one: :func:`converts_in_xla`). XLA fuses
its conversion into the op that makes x, but a decode step's x comes from an RMSNorm, which at batch 1 XLA compiles
to two kernels and the norm kernel (``pallas_kernels.rms_norm``) to one: converted in the kernel, the norms can be
the one-launch kernel (``models.stacked.norms_in_place``), 14 -> 12 launches a Llama-2-7B rtn-w8 decode layer, for
0.3 more instructions per weight (2.21 -> 2.52 in sm_90 SASS at M = 1; the kernels measured bound by something
other than instructions on an H200: this kernel, with half ``w8_nk``'s instructions, was 0.60-1.21x of it).

With ``norm=`` the kernel folds the RMSNorm before it (:mod:`pallas_kernels.norm_fold`; bf16 x, converted here):
the norm kernel's two launches a rtn-w8 decode layer go (9 -> 7, deviceless H100 compile).

sm_90 SASS at M = 1 (``scripts/kernel_sass.py`` cases ``wo_int8_m1_kmajor_f16*``): 2.2 instructions per
weight (256 columns, K steps of 128; 2.0 with 256, 1.8 with 512 columns) against 4.5; float32
accumulation in the MMAs. ``weight_only_matmul(..., w_layout="nk", dequant="f16")``; a GPU decode step's
K-major int8 weight-only products with half-precision x and per-channel scales take it
(``llmeq_jax.kernel_dispatch``) unless a measured table found it slower than the kernel it replaces
(kernel ``int8_f16``). On an H200 (2026-11-28, docs/kernels.md): 0.66-1.42x bf16.

Contract:
  x            (M, K) bfloat16 / float16
  wq           (N, K) int8, K-major (what ``decode_layout.for_decode`` stores for GPU decode), or a stack
               [L, N, K] with ``layer``
  w_scale      (1, N) per output channel
  w_zero_point (1, N) int8 or None
  bias         (N,) or None
  -> y         (M, N) x.dtype
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import hardware_checked, norm_fold, settings
from pallas_kernels.blocks import Blocks
from pallas_kernels.common import (
    launch_matmul,
    load_tile,
    matmul_program,
    span,
    split_refs,
    store_matmul,
    weight_operands,
)

X_SCALE = 2.0**-8  # bf16 activations times this become float16 operands (see the module doc)
CODE_BASE = 1024.0 + 128.0  # what every weight operand carries: float16 1024's bits + the offset-binary 128
# (bm, bn, bk, warps, stages) for decode rows: 256 columns issue fewer instructions per weight (SASS)
DEFAULT_BLOCKS = (16, 256, 128, 4, 3)
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# xor moves four signed codes to offset binary; prmt selects bytes of (w, 0x64646464): d = {w.b0, 0x64,
# w.b1, 0x64} = two float16 1024 + u for K values 0, 1 of the word, and {w.b2, 0x64, w.b3, 0x64} for 2, 3
CODE_ASM = ("{\n.reg .b32 w;\nxor.b32 w, $2, 0x80808080;\n"
            "prmt.b32 $0, w, 0x64646464, 0x5150;\nprmt.b32 $1, w, 0x64646464, 0x5352;\n}")


def codes(wq):
    """int8 codes -> float16 ``1024 + 128 + code`` (jnp; what :data:`CODE_ASM` computes bit for bit)."""
    return (wq.astype(jnp.int32) + int(CODE_BASE)).astype(jnp.float16)


def _codes(wq, interpret: bool):
    """:func:`codes` by inline PTX on a GPU, four codes (one 32-bit word) per call."""
    if interpret:
        return codes(wq)
    out = jax.ShapeDtypeStruct(wq.shape, jnp.float16)
    return plgpu.elementwise_inline_asm(CODE_ASM, args=[wq], constraints="=r,=r,r", pack=4,
                                        result_shape_dtypes=[out])[0]


def _kernel(*refs, m, n, k, blocks, has_zp, has_bias, split_blocks, split, stacked, x_scale, interpreted, eps=None,
            fixup=None, act=None):
    """``x_scale``: what x is multiplied by to become float16 operands here (bf16 x: :data:`X_SCALE`), or 1.0 (x
    float16 already). ``eps``: x is an RMSNorm's input, folded here (:mod:`pallas_kernels.norm_fold`: x times the
    norm's scale in bf16, then into float16; its scale the fourth input). ``act``: ``common.store_matmul``'s."""
    folded = eps is not None
    layer, (x_ref, w_ref, ws_ref, *scale_ref), zp_ref, b_ref, o_ref = split_refs(
        refs, stacked=stacked, inputs=3 + folded, has_zp=has_zp, has_bias=has_bias,
        outputs=norm_fold.outputs(folded, split), fixup=fixup)
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    prog = matmul_program(m, n, k, blocks, split_blocks)

    def row_of(ref, lay=None):
        return load_tile(ref, span(0, 1, 1, in_bounds=True), prog.cols, 0, lay).astype(jnp.float32)

    def body(kb, carry, squared: bool):
        acc, x_sum, sumsq = carry
        ks = span(kb * bk, bk, k, in_bounds=prog.whole_k)
        xt = load_tile(x_ref, prog.rows, ks, 0)
        if folded:
            xt, squares = norm_fold.fold_tile(xt, scale_ref[0], ks, layer, squared)
            sumsq = sumsq + squares if squared else sumsq
        if xt.dtype != jnp.float16:  # bf16 x into float16 operands, scaled (module doc)
            xt = (xt.astype(jnp.float32) * x_scale).astype(jnp.float16)
        wt = load_tile(w_ref, prog.cols, ks, 0, layer)  # (bn, bk): K-major, contracted on its last dim
        part = jax.lax.dot_general(xt, _codes(wt, interpreted), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        # x's row sums in the loop (a dot against ones would double the MMAs; a narrow one re-laid the
        # whole loop out, four warps repeating each other's work, in sm_90 SASS)
        return acc + part, x_sum + jnp.sum(xt.astype(jnp.float32), axis=1, keepdims=True), sumsq

    def loop(squared: bool):
        zero = jnp.zeros((bm, bn), jnp.float32)
        rows = jnp.zeros((bm, 1), jnp.float32)
        acc, x_sum, sumsq = jax.lax.fori_loop(prog.first, prog.last, functools.partial(body, squared=squared),
                                              (zero, rows, rows if folded else ()))
        return (acc, x_sum), sumsq

    (acc, x_sum), sumsq = norm_fold.run(loop, folded, split, squares_after=bool(fixup))
    base = CODE_BASE + (row_of(zp_ref, layer) if has_zp else 0.0)
    acc = (acc - x_sum * base) * (row_of(ws_ref, layer) / x_scale)
    if folded:
        norm_fold.store(o_ref, b_ref, acc, sumsq, prog, split=split, has_bias=has_bias, k=k, eps=eps, fixup=fixup,
                        x_ref=x_ref, act=act)
    else:
        store_matmul(o_ref, b_ref, acc, prog, split=split, has_bias=has_bias, act=act)


def converts_in_xla(m: int) -> bool:
    """Whether a launch of ``m`` rows has XLA make its float16 x: where a setting says (``convert``; rows past the
    decode settings' take the default), else on a GPU unless the norm kernel may run there
    (``hardware_checked.allowed("rms_norm")``). Converting in the kernel pays only by letting that one-launch norm
    make x (``models.stacked.norms_in_place``); with XLA's norm, XLA fuses the conversion into it and the kernel's
    would cost 0.3 instructions per weight for nothing. XLA's conversion is also the way this kernel's gpu cases
    passed (H200, 2026-12-04); the kernel's own has not run on a GPU (``pallas_kernels.fingerprints``)."""
    chosen = settings.of("int8_f16", m).convert
    if chosen is not None:
        return chosen == "xla"
    return not hardware_checked.allowed("rms_norm")


def folds(m: int, x_dtype) -> bool:
    """Whether the kernel may fold an RMSNorm into a launch of ``m`` rows of ``x_dtype``: bfloat16 x (float16 x
    times the norm's scale could overflow where the norm's output would not) converted in the kernel (a setting
    ``convert="xla"`` makes the float16 x before the launch, from the norm's output)."""
    return jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16) and settings.of("int8_f16", m).convert != "xla"


def int8_f16_matmul(x, wq, w_scale, *, w_zero_point=None, bias=None, blocks: Blocks | None = None,
                    k_splits: int | None = None, layer=None, norm: norm_fold.NormFold | None = None, residual=None,
                    act: str | None = None, interpret: bool = False):
    """``x @ dequantize(w)`` for K-major int8 weights with per-channel scales, float16 operands (module doc).
    The caller (``weight_only_matmul(..., dequant="f16")``) has checked the shapes. ``norm``: ``rms_norm(x) @ w``,
    the norm folded in (:mod:`pallas_kernels.norm_fold`; where :func:`folds`). ``residual``:
    ``common.launch_matmul``'s (added by the kernel where it finishes its product: ``pallas_kernels.split_fixup``).
    ``act`` "swiglu": the rows of ``wq`` pair a SwiGLU's gate and up (``llmeq_jax.decode_layout.pair_swiglu``), and
    the product comes back gated, (M, N / 2) (``common.launch_matmul``'s)."""
    if jnp.dtype(x.dtype) not in HALF_DTYPES:
        raise ValueError(f"int8_f16_matmul: x must be bfloat16/float16 (float16 operands), got {x.dtype}")
    if w_scale.shape[-2] != 1:
        raise ValueError(f"int8_f16_matmul takes per-channel scales (1, N), got {w_scale.shape[-2:]}")
    m, k = x.shape
    n = wq.shape[-2]
    if norm is not None:
        norm_fold.check("int8_f16_matmul", norm, k, layer)
        if not folds(m, x.dtype):
            raise ValueError(f"int8_f16_matmul: a folded norm needs bfloat16 x converted in the kernel, got {x.dtype}"
                             f" with convert={settings.of('int8_f16', m).convert!r}")
    x_scale = 1.0 if x.dtype == jnp.float16 else X_SCALE
    bm, bn, bk, warps, stages = DEFAULT_BLOCKS
    chosen = settings.of("int8_f16", m)
    x16 = x  # bf16 x converted each K step in the kernel, or here by XLA (module doc: where)
    if x.dtype != jnp.float16 and norm is None and converts_in_xla(m):
        x16 = (x.astype(jnp.float32) * x_scale).astype(jnp.float16)
    blocks = blocks or chosen.blocks(Blocks(bm if m <= bm else 64, bn, bk, warps, stages))
    args, fold = [x16, *weight_operands(wq, w_scale, w_zero_point)], {}
    if norm is not None:  # the norm's scale after the weights' scales (split_refs: inputs, then the zero points)
        args, fold = [*args[:3], norm_fold.operand(norm, layer), *args[3:]], dict(eps=float(norm.eps),
                                                                                   fold_eps=float(norm.eps))
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias, k_splits=k_splits or chosen.k_splits,
                         out_dtype=x.dtype, interpret=interpret, name="weight_only_int8_f16_matmul", layer=layer,
                         programs=chosen.programs, residual=residual, fixup=chosen.reduce != "xla", act=act,
                         has_zp=w_zero_point is not None, x_scale=x_scale, interpreted=interpret, **fold)


__all__ = ["CODE_ASM", "CODE_BASE", "X_SCALE", "codes", "converts_in_xla", "folds", "int8_f16_matmul"]
