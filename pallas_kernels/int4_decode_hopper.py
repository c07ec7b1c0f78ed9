"""int4 weight-only decode (M <= 16 rows) on Hopper, in Mosaic GPU: the weights streamed by TMA through a deep ring,
dequantized in registers as wgmma's A operand.

Why another int4 decode kernel: the Triton word kernel (:mod:`pallas_kernels.int4_words`) reached 1.05-1.65x bf16 on
an H200 per product and 1.84x end to end for Llama-2-7B, where issue #15 wants 2.5x. Its probe (docs/kernels.md,
2026-12-04) found the dequantization and the MMAs cost ~15 %: the rest was the launch's structure -- a program's
time before its first word arrived and after its last (the pipeline's fill, float32 partials, the split-K sum),
7.3 µs fixed against ~3 µs for streaming a 4096 x 4096 int4 weight at bf16's rate. Its conclusion: fewer,
longer-lived programs streaming more bytes each. This kernel is that structure, as Hopper's mixed-input GEMMs are
built (Machete; JAX's ``hopper_mixed_type_matmul_mgpu``):

- **One program per SM, walking work items** (a 128-row block of the outputs and a split of K), a producer
  warpgroup issuing TMA copies of the weights' ``(128, tile_k)`` int4 tile, x's ``(Mp, tile_k)`` tile and the
  step's group rows into a ring of ``stages`` slots -- it runs ahead into the next item while the last one's steps
  are computed, so the ring is filled once per call, not once per item.
- **The transposed product**, ``y^T = dequantize(W)^T @ x^T``: the weights are wgmma's A operand (64 output rows a
  compute warpgroup) and x's few rows its N dimension (8 or 16), so no MMA is spent on padding rows of x beyond 8.
  A warpgroup loads its half of the int4 tile from shared memory eight codes a register, moves them into wgmma's
  layout and converts them there with Mosaic GPU's int4 -> bf16 bit tricks (:func:`_load_codes`); zero points come
  off in bf16 (``q - z`` is exact). sm_90a SASS (deviceless): 238 instructions a compute thread a 128-value step with
  zero points, 197 without (3.7 / 3.1 a weight), eight ``HGMMA.64x8x16``, 168 registers, no spills.
- **Scales on the accumulator**: each step's product ``(q - z) @ x^T`` (``tile_k`` K values, within one group) runs
  into a fresh (64, Mp) accumulator -- 8 float32 values a thread at Mp = 16 -- and is added as ``s acc`` in float32.
  XLA's path rounds ``(q - z) s`` into bf16 before its GEMM (``QArray.dequantize``); here no weight is rounded, so
  the result is the real-valued product's within float32 sums and one rounding. Scales and zero points are read in
  place from a stacked layer, as stored, and converted in registers.
- **Split-K partial sums in float32**, ``(splits, N, Mp)`` (:func:`splits_for`), summed and transposed by XLA where
  the product's consumer reads it (the decode step's following fusion: no launch of its own in the usual case).
- **x as it is**: on a GPU the TMA copy of an ``(Mp, tile_k)`` box fills x's rows past M with zeros (no pad launch).

The weights are the decode layout's :func:`transpose_codes`: ``(N, K)`` int4, K contiguous, made once at load time.

Contract:
  x            (M, K)     bfloat16 / float16, M <= 16
  w_t          (N, K)     int4 (:func:`transpose_codes`), or a stack (L, N, K) with ``layer``
  scale        (G, N)     floats as stored (converted to float32 in registers), G = 1 (per channel) or K / group;
                          or (L, G, N)
  zero_point   (G, N)     integers as stored, or None (symmetric); or (L, G, N)
  bias         (N,)       or None
  -> y         (M, N)     x's dtype
Needs M <= 16, N % 128 == 0, K % tile_k == 0, and per-channel scales or a group that divides K and is a multiple of
tile_k (:func:`can_use`); sm_90 only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels import config, hopper

MAX_ROWS = 16  # wgmma's N dimension here: x's rows padded to 8 or 16
ROWS_PER_WG = 64  # output rows a compute warpgroup owns (wgmma's M)


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Launch settings: K values a ring step carries (``tile_k``), the ring's slots, and the K splits (None: enough
    work items for every SM, :func:`splits_for`)."""

    tile_k: int = 128
    stages: int = 6
    splits: int | None = None

    def __post_init__(self):
        if self.tile_k % 128 or self.stages < 2 or (self.splits is not None and self.splits < 1):
            raise ValueError(f"DecodeBlocks: tile_k a multiple of 128 (the int4 tile's 64-byte rows and swizzle), "
                             f"stages >= 2, splits >= 1; got {self}")


def transpose_codes(codes):
    """The decode layout of int4 codes ``(..., K, N)`` (integers in [-8, 7]): ``(..., N, K)`` int4, each output
    channel's K values contiguous -- the rows wgmma's A operand takes."""
    return jnp.swapaxes(codes, -1, -2).astype(jnp.int4)


def padded_rows(m: int) -> int:
    """x's rows as the kernel's wgmma N dimension: 8 or 16."""
    return 8 if m <= 8 else MAX_ROWS


def splits_for(items: int, k_steps: int, sms: int, step_bytes: int, split_bytes: int) -> int:
    """K splits of each block of outputs (``items`` blocks, ``k_steps`` ring steps of ``step_bytes`` weight bytes
    each): the divisor of the steps, keeping at least two steps a split, that minimizes a bytes model of the call --
    the SMs' busiest stream (``ceil(items * splits / sms)`` work items of ``k_steps / splits`` steps, at an SM's share
    of the bandwidth) plus each split's float32 partial sums written and read again (``split_bytes`` each).
    4096 x 4096 at one row: 4 splits, 128 work items on 132 SMs."""
    divisors = [s for s in range(1, k_steps + 1) if k_steps % s == 0 and k_steps // s >= 2] or [1]

    def cost(splits):
        return math.ceil(items * splits / sms) * (k_steps // splits) * step_bytes * sms + 2 * splits * split_bytes

    return min(divisors, key=cost)


def _shared_bytes(tile_k: int, rows: int, stages: int, has_zp: bool, item: int) -> int:
    step = 2 * ROWS_PER_WG * tile_k // 2 + rows * tile_k * item  # the int4 tile, x's tile
    step += 2 * ROWS_PER_WG * 4 * (1 + int(has_zp))  # the group's scale and zero-point rows (at most 4 bytes each)
    return stages * step + 2 * ROWS_PER_WG * rows * 4  # the two warpgroups' output tiles


def can_use(x_shape, x_dtype, w_dtype, k: int, n: int, group: int | None,
            blocks: DecodeBlocks | None = None) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    b = blocks or DecodeBlocks()
    if len(x_shape) != 2 or x_shape[1] != k:
        return False, f"x of shape {tuple(x_shape)} for a ({k}, {n}) weight (expected (M, {k}))"
    if x_shape[0] > MAX_ROWS:
        return False, f"{x_shape[0]} rows of x (the decode kernel takes at most {MAX_ROWS})"
    if jnp.dtype(x_dtype) not in hopper.HALF_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not bfloat16/float16"
    if jnp.dtype(w_dtype) != jnp.dtype(jnp.int4):
        return False, f"codes of dtype {jnp.dtype(w_dtype).name} (expected int4 in the (N, K) decode layout)"
    if k % b.tile_k or n % (2 * ROWS_PER_WG):
        return False, f"K {k} not a multiple of {b.tile_k} or N {n} not of {2 * ROWS_PER_WG}"
    if group is not None and (k % group or group % b.tile_k):
        return False, f"group {group} (the kernel takes groups that divide K and are multiples of tile_k {b.tile_k})"
    return hopper.wgmma_available()


def _check(x, w_t, scale, zero_point, group, bias, layer, blocks: DecodeBlocks):
    lead = () if layer is None else w_t.shape[:1]
    if w_t.ndim != 2 + len(lead) or x.ndim != 2 or w_t.shape[-1] != x.shape[1]:
        raise ValueError(f"int4_decode_hopper expects x (M, K) and int4 w_t {'(L, N, K)' if lead else '(N, K)'}; "
                         f"got {x.shape} and {w_t.shape}")
    k, n = x.shape[1], w_t.shape[-2]
    ok, why = can_use(x.shape, x.dtype, w_t.dtype, k, n, group, blocks)
    if not ok:
        raise ValueError(f"int4_decode_hopper: {why}")
    groups = 1 if group is None else k // group
    if scale.shape != (*lead, groups, n):
        raise ValueError(f"int4_decode_hopper: scale has shape {scale.shape}, expected {(*lead, groups, n)} "
                         f"({'per channel' if group is None else f'groups of {group}'})")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"int4_decode_hopper: scale of dtype {scale.dtype}, expected floats")
    if zero_point is not None and (zero_point.shape != scale.shape or not jnp.issubdtype(zero_point.dtype,
                                                                                          jnp.integer)):
        raise ValueError(f"int4_decode_hopper: zero_point {zero_point.shape} {zero_point.dtype}, expected integers "
                         f"of the scale's shape {scale.shape}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"int4_decode_hopper: bias has shape {bias.shape}, expected {(n,)}")


def _load_codes(ref, dtype, interpret: bool):
    """A compute warpgroup's ``(64, tile_k)`` int4 codes from shared memory as wgmma's A operand in ``dtype``. Loaded
    as eight codes a 32-bit register (``WGMMA_UPCAST_4X``: 128-bit shared-memory loads), moved into wgmma's layout as
    int4 (one ``shfl`` and ``prmt`` per eight codes), then converted there: 209 instructions a 128-value step in
    sm_90a SASS where loading straight into wgmma's layout took 222 (a byte load per two codes). Interpret mode
    simulates no register layouts."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        return ref[...].astype(dtype)
    import inspect

    # jax 0.10 takes the index as an argument; 0.11 indexes the ref itself (and deprecates the argument)
    index = () if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty else None
    codes = (plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_4X) if index is None
             else plgpu.load(ref, index, layout=plgpu.Layout.WGMMA_UPCAST_4X))
    return plgpu.layout_cast(codes, plgpu.Layout.WGMMA).astype(dtype)


def _kernel(x_gmem, w_gmem, s_gmem, *rest, k: int, n: int, rows: int, group: int, tile_k: int, stages: int,
            splits: int, has_zp: bool, stacked: bool, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rest = list(rest)
    z_gmem = rest.pop(0) if has_zp else None
    if stacked:  # the layer index, one int32 in global memory: the stack is read in place
        layer = rest.pop(0)[0]
        w_gmem, s_gmem = w_gmem.at[layer], s_gmem.at[layer]
        z_gmem = None if z_gmem is None else z_gmem.at[layer]
    (o_gmem,) = rest
    blocks, k_split = n // (2 * ROWS_PER_WG), k // splits

    def pipeline(body, context, si):
        # block indices of this split's steps: a step's K tile, and the group's row of scales (a group spans one
        # or more whole steps)
        k_block = lambda kb: si * (k_split // tile_k) + kb  # noqa: E731
        group_block = lambda kb: (k_block(kb) * tile_k // group, 0)  # noqa: E731
        rows_of = lambda cols: plgpu.BlockSpec((1, cols), group_block, memory_space=plgpu.SMEM)  # noqa: E731
        specs = [plgpu.BlockSpec((2 * ROWS_PER_WG, tile_k), lambda kb: (0, k_block(kb)),
                                 transforms=hopper.swizzled(tile_k, jnp.int4), memory_space=plgpu.SMEM),
                 plgpu.BlockSpec((rows, tile_k), lambda kb: (0, k_block(kb)),
                                 transforms=hopper.swizzled(tile_k, x_gmem.dtype), memory_space=plgpu.SMEM),
                 rows_of(2 * ROWS_PER_WG)]
        # the zero points' row of the group
        specs += [rows_of(2 * ROWS_PER_WG)] if has_zp else []
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_split // tile_k,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=context)

    def operands(bi):
        block = pl.ds(bi * 2 * ROWS_PER_WG, 2 * ROWS_PER_WG)
        ops = [w_gmem.at[block], x_gmem, s_gmem.at[:, block]]
        return ops + ([z_gmem.at[:, block]] if has_zp else [])

    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies

    @functools.partial(pl.run_scoped, ring=pipeline(ignore, ignore, 0).get_allocations(*operands(0)),
                       out_smem=plgpu.SMEM((2, ROWS_PER_WG, rows), jnp.float32), collective_axes="wg")
    def _scope(ring, out_smem):
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)  # this warpgroup's rows of the block

        @plgpu.nd_loop((blocks * splits,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            bi, si = item // splits, item % splits

            def context(run_k_loop):
                total = run_k_loop(jnp.zeros((ROWS_PER_WG, rows), jnp.float32))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store has read its tile
                out_smem[wg] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                        o_gmem.at[si, pl.ds(bi * 2 * ROWS_PER_WG + wg * ROWS_PER_WG, ROWS_PER_WG)])

            def step(index, w_smem, x_smem, s_row, *zp_rows_and_total):
                *zp_rows, total = zp_rows_and_total
                codes = _load_codes(w_smem.at[mine], x_gmem.dtype, interpret)
                if has_zp:  # q - z, exact in bf16 / f16 (|q - z| <= 15)
                    (z_row,) = zp_rows
                    z = z_row[0, mine].astype(x_gmem.dtype)
                    codes = codes - hopper.broadcast(z, codes.shape, False, interpret)

                def chain(acc_ref):
                    plgpu.wgmma(acc_ref, codes, plgpu.transpose_ref(x_smem, (1, 0)))
                    return acc_ref[...]

                part = pl.run_scoped(chain, plgpu.ACC((ROWS_PER_WG, rows), jnp.float32))  # q @ x^T of this step
                per_row = functools.partial(hopper.broadcast, shape=(ROWS_PER_WG, rows), along_rows=False,
                                            interpret=interpret)
                return total + per_row(s_row[0, mine].astype(jnp.float32)) * part

            pipeline(step, context, si)(*operands(bi), allocations=ring)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def int4_decode_hopper(x, w_t, scale, *, zero_point=None, group: int | None = None, bias=None, layer=None,
                       blocks: DecodeBlocks | None = None, interpret: bool | None = None):
    """``x @ dequantize(w)`` at decode rows, ``w_t`` the (N, K) int4 decode layout (module docstring: the
    contract)."""
    interpret = config.resolve_interpret(interpret)
    b = blocks or DecodeBlocks()
    with config.interpret(interpret):  # can_use's device check: interpret mode runs anywhere
        _check(x, w_t, scale, zero_point, group, bias, layer, b)
    m, k = x.shape
    n = w_t.shape[-2]
    group = group or k  # per channel: one group spanning K
    rows = padded_rows(m)
    # x's rows up to wgmma's 8 or 16: on a GPU the TMA copy of an (Mp, tile_k) box from the (M, K) array fills the
    # rows past M with zeros (no pad launch); GPU interpret mode copies by slicing, so x is padded there. Either way
    # a pad row only makes output columns that are cut off below.
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if interpret and rows != m else x
    k_steps = k // b.tile_k
    splits = b.splits or splits_for(n // (2 * ROWS_PER_WG), k_steps, hopper.num_sms(interpret),
                                    step_bytes=2 * ROWS_PER_WG * b.tile_k // 2, split_bytes=n * rows * 4)
    if k_steps % splits:
        raise ValueError(f"int4_decode_hopper: {splits} K splits do not divide the {k_steps} steps of {b.tile_k}")
    has_zp = zero_point is not None
    stages = hopper.stages_that_fit(b.stages, k_steps // splits,
                                    lambda st: _shared_bytes(b.tile_k, rows, st, has_zp, x.dtype.itemsize))
    # the scales and zero points as stored, a stack's too: the kernel reads its layer's rows in place and converts
    # them in registers (XLA's slice-and-convert was two launches a product and kept the layer's kernels out of one
    # command buffer: a dynamic-slice fusion)
    args = [xp, w_t, scale]
    args += [zero_point] if has_zp else []
    args += [jnp.reshape(layer, (1,)).astype(jnp.int32)] if layer is not None else []
    body = functools.partial(_kernel, k=k, n=n, rows=rows, group=group, tile_k=b.tile_k, stages=stages,
                             splits=splits, has_zp=has_zp, stacked=layer is not None, interpret=interpret)
    partials = hopper.launch(body, (splits, n, rows), jnp.float32, interpret)(*args)
    y = partials.sum(0)[:, :m].T  # the splits' sum and the transpose: fused by XLA into the product's consumer
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
