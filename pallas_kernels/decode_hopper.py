"""int4 and int8 weight-only, and int8 / FP8 W8A8, decode (M <= 16 rows) on Hopper, in Mosaic GPU: the weights
streamed by TMA through a deep ring, dequantized in registers as wgmma's A operand (W8A8: read by wgmma as they are).

Why another int4 decode kernel: the Triton word kernel (:mod:`pallas_kernels.int4_words`) reached 1.05-1.65x bf16 on
an H200 per product and 1.84x end to end for Llama-2-7B, where issue #15 wants 2.5x. Its probe (docs/kernels.md,
2026-12-04) found the dequantization and the MMAs cost ~15 %: the rest was the launch's structure -- a program's
time before its first word arrived and after its last (the pipeline's fill, float32 partials, the split-K sum),
7.3 µs fixed against ~3 µs for streaming a 4096 x 4096 int4 weight at bf16's rate. Its conclusion: fewer,
longer-lived programs streaming more bytes each. This kernel is that structure, as Hopper's mixed-input GEMMs are
built (Machete; JAX's ``hopper_mixed_type_matmul_mgpu``):

- **One program per SM, walking work items** (a 128-row block of the outputs and a split of K), a producer
  warpgroup issuing TMA copies of the weights' ``(128, 128)`` int4 tiles (two a 256-value step by default), x's
  ``(Mp, tile_k)`` tile and the step's group rows into a ring of ``stages`` slots -- it runs ahead into the next item
  while the last one's steps are computed, so the ring is filled once per call, not once per item.
- **The transposed product**, ``y^T = dequantize(W)^T @ x^T``: the weights are wgmma's A operand (64 output rows a
  compute warpgroup) and x's few rows its N dimension (8 or 16), so no MMA is spent on padding rows of x beyond 8.
  A warpgroup loads its half of the int4 tile from shared memory eight codes a register, moves them into wgmma's
  layout and converts them there with Mosaic GPU's int4 -> bf16 bit tricks (:func:`_load_codes`); zero points come
  off in bf16 (``q - z`` is exact). A step's second 128-value chunk is converted while the first one's wgmma runs.
  sm_90a SASS (deviceless): 451 instructions a compute thread a 256-value step with zero points, 378 without (3.5 /
  3.0 a weight), sixteen ``HGMMA.64x8x16``, 168 registers, no spills.
- **Scales on the accumulator**: each chunk's product ``(q - z) @ x^T`` (128 K values, within one group) runs
  into a fresh (64, Mp) accumulator -- 8 float32 values a thread at Mp = 16 -- and is added as ``s acc`` in float32.
  XLA's path rounds ``(q - z) s`` into bf16 before its GEMM (``QArray.dequantize``); here no weight is rounded, so
  the result is the real-valued product's within float32 sums and one rounding. Scales and zero points are read in
  place from a stacked layer, as stored, and converted in registers.
- **Split-K partial sums in float32**, ``(splits, N, Mp)`` (:func:`splits_for`), summed and transposed by XLA where
  the product's consumer reads it (the decode step's following fusion: no launch of its own in the usual case).
- **x as it is** up to 8 rows: on a GPU the TMA copy of an ``(8, tile_k)`` box fills x's rows past M with zeros (no
  pad launch); 9-15 rows are padded to 16 by XLA (Mosaic GPU takes x's tiled box as whole tiles of 8 rows).

The weights are ``(N, K)``, K contiguous, made once at load time: int4 as the decode layout's :func:`transpose_codes`
(``decode_layout.Int4RowKernel``), int8 as the K-major layout the decode steps' int8 kernels read already
(``decode_layout.RowMajorKernel``; rtn-w8's). int8 codes load straight into wgmma's layout (two a 16-bit load) and
convert there: 547 instructions a 256-value step (4.3 a weight, half the weights a byte of int4's).

**W8A8** (:func:`w8a8_decode_hopper`, rtn-w8a8's and fp8-w8a8's decode products): x quantized per token to int8
or E4M3 by XLA (:func:`pallas_kernels.w8a8.quantize_rows`, fused into x's producer), and its codes multiplied with the
K-major weight codes as they arrive -- both wgmma operands straight from shared memory, nothing converted (sm_90a: a
256-value step is eight ``IGMMA`` / ``QGMMA.64x8x32`` and ~280 instructions a compute thread, ~1.1 a weight). Each
128-value chunk runs into a fresh accumulator added to the item's sum: int32 exact for int8, float32 for FP8 (whose
tensor-core accumulation is promoted so every 128 values, as in :mod:`pallas_kernels.w8a8_hopper`). The partial sums
leave as int32 / float32; XLA sums the splits and applies the weights' per-channel scales, x's scale and the bias in
:func:`pallas_kernels.w8a8.w8a8_reference`'s order (int8: its bits).

Contract (weight-only, :func:`decode_hopper`):
  x            (M, K)     bfloat16 / float16, M <= 16
  w_t          (N, K)     int4 (:func:`transpose_codes`) or int8, or a stack (L, N, K) with ``layer``
  scale        (G, N)     floats as stored (converted to float32 in registers), G = 1 (per channel) or K / group;
                          or (L, G, N)
  zero_point   (G, N)     integers as stored, or None (symmetric); or (L, G, N)
  bias         (N,)       or None
  -> y         (M, N)     x's dtype
Needs M <= 16, N % 128 == 0, K % tile_k == 0, and per-channel scales or a group of a multiple of 128 values that
divides K and divides or is a multiple of tile_k (:func:`can_use`); sm_90 only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax

from llmeq_jax.core import fp8grid
from pallas_kernels import config, hopper, w8a8
from pallas_kernels.common import cdiv

MAX_ROWS = 16  # wgmma's N dimension here: x's rows padded to 8 or 16
ROWS_PER_WG = 64  # output rows a compute warpgroup owns (wgmma's M)
CHUNK = 128  # K values of one wgmma chain: one TMA copy of the codes (a swizzled tile is sliced only at whole rows)
CODES = (jnp.dtype(jnp.int4), jnp.dtype(jnp.int8))


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Launch settings: K values a ring step carries (``tile_k``: one or more 128-value chunks, each its own TMA copy
    and wgmma chain -- a step's second chain is converted while its first runs), the ring's slots, and the K splits
    (None: :func:`splits_for`)."""

    tile_k: int = 256
    stages: int = 4
    splits: int | None = None

    def __post_init__(self):
        if self.tile_k % CHUNK or self.stages < 2 or (self.splits is not None and self.splits < 1):
            raise ValueError(f"DecodeBlocks: tile_k a multiple of {CHUNK} (the int4 tile's 64-byte rows and swizzle), "
                             f"stages >= 2, splits >= 1; got {self}")


def default_blocks(k: int) -> DecodeBlocks:
    """Two 128-value chunks a ring step where K takes them (Llama's 4096, 11008 and 14336 do), else one."""
    return DecodeBlocks() if k % DecodeBlocks().tile_k == 0 else DecodeBlocks(tile_k=CHUNK, stages=6)


def transpose_codes(codes):
    """The decode layout of int4 codes ``(..., K, N)`` (integers in [-8, 7]): ``(..., N, K)`` int4, each output
    channel's K values contiguous -- the rows wgmma's A operand takes."""
    return jnp.swapaxes(codes, -1, -2).astype(jnp.int4)


def padded_rows(m: int) -> int:
    """x's rows as the kernel's wgmma N dimension: 8 or 16."""
    return 8 if m <= 8 else MAX_ROWS


def splits_for(items: int, k_steps: int, sms: int, step_bytes: int, split_bytes: int) -> int:
    """K splits of each block of outputs (``items`` blocks, ``k_steps`` ring steps of ``step_bytes`` weight bytes
    each; a split takes ``k_steps / splits`` steps, rounded either way, :func:`split_steps`): the count, keeping at
    least two steps a split, that minimizes a bytes model of the call -- the SMs' busiest stream (``ceil(items *
    splits / sms)`` work items of the longest split's steps, at an SM's share of the bandwidth) plus each split's
    float32 partial sums written and read again (``split_bytes`` each). 4096 x 4096 at one row: 4 splits, 128 work
    items on 132 SMs."""
    def cost(splits):
        longest = cdiv(k_steps, splits)
        return math.ceil(items * splits / sms) * longest * step_bytes * sms + 2 * splits * split_bytes

    return min(range(1, max(1, k_steps // 2) + 1), key=cost)


def split_steps(si, k_steps: int, splits: int):
    """(first step, steps) of K split ``si`` of ``splits`` over ``k_steps`` steps: as even as whole steps allow."""
    first = si * k_steps // splits
    return first, (si + 1) * k_steps // splits - first


def _code_bytes(dtype, values: int) -> int:
    return values // 2 if jnp.dtype(dtype) == jnp.dtype(jnp.int4) else values


def _shared_bytes(tile_k: int, rows: int, stages: int, has_zp: bool, item: int, codes, scaled: bool) -> int:
    step = _code_bytes(codes, 2 * ROWS_PER_WG * tile_k) + rows * tile_k * item  # the codes' tiles, x's tile
    # the groups' scale and zero-point rows (at most 4 bytes each)
    step += 2 * ROWS_PER_WG * 4 * (int(scaled) + int(has_zp)) * max(1, tile_k // CHUNK)
    return stages * step + 2 * ROWS_PER_WG * rows * 4  # the two warpgroups' output tiles


def can_use(x_shape, x_dtype, w_dtype, k: int, n: int, group: int | None,
            blocks: DecodeBlocks | None = None) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    b = blocks or default_blocks(k)
    if len(x_shape) != 2 or x_shape[1] != k:
        return False, f"x of shape {tuple(x_shape)} for a ({k}, {n}) weight (expected (M, {k}))"
    if x_shape[0] > MAX_ROWS:
        return False, f"{x_shape[0]} rows of x (the decode kernel takes at most {MAX_ROWS})"
    if jnp.dtype(x_dtype) not in hopper.HALF_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not bfloat16/float16"
    if jnp.dtype(w_dtype) not in CODES:
        return False, f"codes of dtype {jnp.dtype(w_dtype).name} (expected int4 or int8, (N, K))"
    if k % b.tile_k or n % (2 * ROWS_PER_WG):
        return False, f"K {k} not a multiple of {b.tile_k} or N {n} not of {2 * ROWS_PER_WG}"
    if group is not None and (k % group or group % CHUNK or (group % b.tile_k and b.tile_k % group)):
        return False, (f"group {group} (the kernel takes groups that divide K, are multiples of {CHUNK} and divide "
                       f"or are multiples of tile_k {b.tile_k})")
    return hopper.wgmma_available()


def _check(x, w_t, scale, zero_point, group, bias, layer, blocks: DecodeBlocks):
    lead = () if layer is None else w_t.shape[:1]
    if w_t.ndim != 2 + len(lead) or x.ndim != 2 or w_t.shape[-1] != x.shape[1]:
        raise ValueError(f"decode_hopper expects x (M, K) and w_t {'(L, N, K)' if lead else '(N, K)'}; "
                         f"got {x.shape} and {w_t.shape}")
    k, n = x.shape[1], w_t.shape[-2]
    ok, why = can_use(x.shape, x.dtype, w_t.dtype, k, n, group, blocks)
    if not ok:
        raise ValueError(f"decode_hopper: {why}")
    hopper.check_scales("decode_hopper", scale, zero_point, bias, lead, 1 if group is None else k // group, n,
                        group)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"decode_hopper: scale of dtype {scale.dtype}, expected floats")


def _check_w8a8(x, wq_t, w_scale, bias, layer, blocks: DecodeBlocks):
    lead = () if layer is None else wq_t.shape[:1]
    if wq_t.ndim != 2 + len(lead) or x.ndim != 2 or wq_t.shape[-1] != x.shape[1]:
        raise ValueError(f"w8a8_decode_hopper expects x (M, K) and wq_t {'(L, N, K)' if lead else '(N, K)'} "
                         f"(K-major); got {x.shape} and {wq_t.shape}")
    k, n = x.shape[1], wq_t.shape[-2]
    if jnp.dtype(wq_t.dtype) != jnp.dtype(jnp.int8):
        raise ValueError(f"w8a8_decode_hopper: weight codes of dtype {wq_t.dtype} (expected int8: integer codes or "
                         "E4M3 bit patterns)")
    ok, why = can_use(x.shape, x.dtype, wq_t.dtype, k, n, None, blocks)
    if not ok:
        raise ValueError(f"w8a8_decode_hopper: {why}")
    hopper.check_scales("w8a8_decode_hopper", w_scale, None, bias, lead, 1, n, None)


def _load_codes(ref, dtype, interpret: bool):
    """A compute warpgroup's ``(64, 128)`` codes from shared memory as wgmma's A operand in ``dtype``. int4: loaded as
    eight codes a 32-bit register (``WGMMA_UPCAST_4X``: 128-bit shared-memory loads), moved into wgmma's layout as
    int4 (one ``shfl`` and ``prmt`` per eight codes), then converted there: 209 instructions a 128-value step in
    sm_90a SASS where loading straight into wgmma's layout took 222 (a byte load per two codes). int8: straight into
    wgmma's layout (Mosaic GPU's layout inference refuses the 8-bit loads' own layouts here). Interpret mode
    simulates no register layouts."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret or jnp.dtype(ref.dtype) == jnp.dtype(jnp.int8):
        return ref[...].astype(dtype)
    codes = hopper.load(ref, plgpu.Layout.WGMMA_UPCAST_4X)
    return plgpu.layout_cast(codes, plgpu.Layout.WGMMA).astype(dtype)


def _kernel(x_gmem, w_gmem, *rest, k: int, n: int, rows: int, group: int, tile_k: int, stages: int,
            splits: int, has_zp: bool, quantized_x: bool, stacked: bool, interpret: bool):
    """``quantized_x`` (W8A8): x's int8 / E4M3 codes against the weights' codes straight from shared memory, the
    scales left to XLA; else the weights dequantized in registers and scaled a chunk at a time (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rest = list(rest)
    s_gmem = None if quantized_x else rest.pop(0)
    z_gmem = rest.pop(0) if has_zp else None
    if stacked:  # the layer index, one int32 in global memory: the stack is read in place
        layer = rest.pop(0)[0]
        w_gmem = w_gmem.at[layer]
        s_gmem = None if s_gmem is None else s_gmem.at[layer]
        z_gmem = None if z_gmem is None else z_gmem.at[layer]
    (o_gmem,) = rest
    acc_dtype = o_gmem.dtype  # float32; int32 for int8 x int8 (exact)
    blocks, k_steps = n // (2 * ROWS_PER_WG), k // tile_k
    longest = cdiv(k_steps, splits)  # every split's pipeline runs this many steps; a shorter one's last ones are void

    chunks = tile_k // CHUNK
    group_rows = max(1, tile_k // group)  # scale rows a step reads: one per group it holds

    def pipeline(body, context, first, steps):
        # block indices of this split's steps: a step's K tile, its chunks' weight tiles (one TMA copy each: Mosaic
        # GPU slices a swizzled int4 tile only at whole swizzle rows), and its groups' rows of scales
        k_block = lambda kb: first + jnp.minimum(kb, steps - 1)  # noqa: E731 -- a void step reads the last again
        group_block = lambda kb: (k_block(kb) * tile_k // group // group_rows, 0)  # noqa: E731
        rows_of = lambda cols: plgpu.BlockSpec((group_rows, cols), group_block, memory_space=plgpu.SMEM)  # noqa: E731
        chunk_block = lambda c: lambda kb: (0, k_block(kb) * chunks + c)  # noqa: E731
        specs = [plgpu.BlockSpec((2 * ROWS_PER_WG, CHUNK), chunk_block(c), transforms=hopper.swizzled(
            CHUNK, w_gmem.dtype), memory_space=plgpu.SMEM) for c in range(chunks)]
        specs += [plgpu.BlockSpec((rows, tile_k), lambda kb: (0, k_block(kb)),
                                  transforms=hopper.swizzled(tile_k, x_gmem.dtype), memory_space=plgpu.SMEM)]
        specs += [] if quantized_x else [rows_of(2 * ROWS_PER_WG)]
        # the zero points' rows of the groups
        specs += [rows_of(2 * ROWS_PER_WG)] if has_zp else []
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(longest,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=context)

    def operands(bi):
        block = pl.ds(bi * 2 * ROWS_PER_WG, 2 * ROWS_PER_WG)
        ops = [w_gmem.at[block]] * chunks + [x_gmem] + ([] if quantized_x else [s_gmem.at[:, block]])
        return ops + ([z_gmem.at[:, block]] if has_zp else [])

    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies

    @functools.partial(pl.run_scoped, ring=pipeline(ignore, ignore, 0, 1).get_allocations(*operands(0)),
                       out_smem=plgpu.SMEM((2, ROWS_PER_WG, rows), acc_dtype), collective_axes="wg")
    def _scope(ring, out_smem):
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)  # this warpgroup's rows of the block

        @plgpu.nd_loop((blocks * splits,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            bi, si = item // splits, item % splits
            first, steps = split_steps(si, k_steps, splits)

            def context(run_k_loop):
                total = run_k_loop(jnp.zeros((ROWS_PER_WG, rows), acc_dtype))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store has read its tile
                out_smem[wg] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                        o_gmem.at[si, pl.ds(bi * 2 * ROWS_PER_WG + wg * ROWS_PER_WG, ROWS_PER_WG)])

            def step(index, *refs_and_total):
                w_chunks, total = refs_and_total[:chunks], refs_and_total[-1]
                x_smem, *scale_rows = refs_and_total[chunks:-1]
                s_rows, *z_rows = scale_rows or [None]  # z_rows: [the zero points' rows] or []
                group_row = lambda c: c * CHUNK // group if group < tile_k else 0  # noqa: E731

                def codes(c):  # chunk c's (q - z) in x's dtype, exact (|q - z| <= 15 for int4, 255 for int8)
                    if quantized_x:  # W8A8: the codes as stored, wgmma's A operand from shared memory
                        return w_chunks[c].at[mine]
                    q = _load_codes(w_chunks[c].at[mine], x_gmem.dtype, interpret)
                    if not has_zp:
                        return q
                    z = z_rows[0][group_row(c), mine].astype(x_gmem.dtype)
                    return q - hopper.broadcast(z, q.shape, False, interpret)

                def chains(*acc_refs):  # chunk c + 1 is converted while chunk c's wgmma runs
                    for c, acc_ref in enumerate(acc_refs):
                        x_t = plgpu.transpose_ref(x_smem.at[:, pl.ds(c * CHUNK, CHUNK)], (1, 0))
                        plgpu.wgmma(acc_ref, codes(c), x_t)
                    return [acc_ref[...] for acc_ref in acc_refs]

                shape = (ROWS_PER_WG, rows)
                parts = pl.run_scoped(chains, *[plgpu.ACC(shape, acc_dtype) for _ in range(chunks)])
                live = (index[0] < steps).astype(acc_dtype)  # 0: a shorter split's void last step
                if quantized_x:  # each chunk's sums added as they are (FP8: promoted every 128 values)
                    for part in parts:
                        total = total + part * live
                    return total
                for c, part in enumerate(parts):  # s (q - z) @ x^T, each chunk's product on its group's scale
                    scale = s_rows[group_row(c), mine].astype(jnp.float32) * live
                    total = total + hopper.broadcast(scale, shape, False, interpret) * part
                return total

            pipeline(step, context, first, steps)(*operands(bi), allocations=ring)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def decode_hopper(x, w_t, scale, *, zero_point=None, group: int | None = None, bias=None, layer=None,
                  blocks: DecodeBlocks | None = None, interpret: bool | None = None):
    """``x @ dequantize(w)`` at decode rows, ``w_t`` the (N, K) int4 or int8 codes (module docstring: the
    contract)."""
    interpret = config.resolve_interpret(interpret)
    b = blocks or default_blocks(x.shape[-1])
    with config.interpret(interpret):  # can_use's device check: interpret mode runs anywhere
        _check(x, w_t, scale, zero_point, group, bias, layer, b)
    # the scales and zero points as stored, a stack's too: the kernel reads its layer's rows in place and converts
    # them in registers (XLA's slice-and-convert was two launches a product and kept the layer's kernels out of one
    # command buffer: a dynamic-slice fusion)
    operands = [scale] + ([] if zero_point is None else [zero_point])
    partials = _partials(x, w_t, operands, b, group=group or x.shape[1], has_zp=zero_point is not None,
                         layer=layer, acc_dtype=jnp.float32, interpret=interpret)
    y = partials.sum(0)[:, :x.shape[0]].T  # the splits' sum and the transpose: fused by XLA into the product's consumer
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def w8a8_decode_hopper(x, wq_t, w_scale, *, bias=None, act_scale=None, layer=None, fp8: bool = False,
                       blocks: DecodeBlocks | None = None, interpret: bool | None = None):
    """W8A8 at decode rows (module docstring): x quantized per token (or by the static ``act_scale``) to int8
    (``fp8``: E4M3) by XLA as :func:`pallas_kernels.w8a8.quantize_rows` does, its codes against the ``(N, K)``
    weight codes ``wq_t`` (E4M3 bit patterns with ``fp8``) on the tensor cores, both straight from shared memory;
    the per-channel ``w_scale`` ``(1, N)`` (a stack's ``(L, 1, N)``), x's scale and the bias applied by XLA to the
    summed splits, in :func:`pallas_kernels.w8a8.w8a8_reference`'s order (int8: its bits, the sums exact in int32)."""
    interpret = config.resolve_interpret(interpret)
    b = blocks or default_blocks(x.shape[-1])
    with config.interpret(interpret):
        _check_w8a8(x, wq_t, w_scale, bias, layer, b)
    xq, sx = w8a8.quantize_rows(x, act_scale, fp8)
    if fp8:  # the stored bit patterns as E4M3 (a bit cast: XLA reads the same bytes)
        xq, wq_t = fp8grid.as_fp8(xq), fp8grid.as_fp8(wq_t)
    partials = _partials(xq, wq_t, [], b, group=x.shape[1], has_zp=False, layer=layer,
                         acc_dtype=jnp.float32 if fp8 else jnp.int32, interpret=interpret)
    acc = partials.sum(0)[:, :x.shape[0]].T.astype(jnp.float32)
    ws = w_scale if layer is None else lax.dynamic_index_in_dim(w_scale, layer, keepdims=False)
    y = (acc * ws.astype(jnp.float32)) * sx  # one XLA fusion with the splits' sum, the slice of a stack's scales
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _partials(x, w_t, operands: list, b: DecodeBlocks, *, group: int, has_zp: bool, layer, acc_dtype,
              interpret: bool):
    """The kernel's ``(splits, N, Mp)`` partial sums of ``x`` (M, K: floats, or W8A8's codes) against the ``(N, K)``
    codes ``w_t``; ``operands``: the scales and zero points a weight-only product reads, none for W8A8."""
    m, k = x.shape
    n = w_t.shape[-2]
    quantized_x = not operands
    rows = padded_rows(m)
    # x's rows up to wgmma's 8 or 16: on a GPU the TMA copy of an (8, tile_k) box from an (M < 8, K) array fills the
    # rows past M with zeros (no pad launch at batch 1); 9-15 rows are padded to 16 (x's (8, 64)-tiled box takes a
    # whole number of tiles: Mosaic GPU refuses a 12-row array), and so is any x in GPU interpret mode, which copies
    # by slicing. Either way a pad row only makes output columns that are cut off below.
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m and (interpret or m > 8) else x
    k_steps = k // b.tile_k
    splits = b.splits or splits_for(n // (2 * ROWS_PER_WG), k_steps, hopper.num_sms(interpret),
                                    step_bytes=_code_bytes(w_t.dtype, 2 * ROWS_PER_WG * b.tile_k),
                                    split_bytes=n * rows * 4)
    if splits > k_steps:
        raise ValueError(f"decode_hopper: {splits} K splits of {k_steps} steps of {b.tile_k} values")
    stages = hopper.stages_that_fit(b.stages, cdiv(k_steps, splits), lambda st: _shared_bytes(
        b.tile_k, rows, st, has_zp, x.dtype.itemsize, w_t.dtype, scaled=not quantized_x))
    args = [xp, w_t, *operands] + ([jnp.reshape(layer, (1,)).astype(jnp.int32)] if layer is not None else [])
    body = functools.partial(_kernel, k=k, n=n, rows=rows, group=group, tile_k=b.tile_k, stages=stages,
                             splits=splits, has_zp=has_zp, quantized_x=quantized_x, stacked=layer is not None,
                             interpret=interpret)
    return hopper.launch(body, (splits, n, rows), acc_dtype, interpret)(*args)
