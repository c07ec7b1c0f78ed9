"""W8A8 int8 for prompts on Hopper, in Mosaic GPU (Pallas's Hopper backend): int8 wgmma kept in flight.

Why not Triton: Triton's wgmma pipeliner makes a dot asynchronous only with a float32 accumulator
(``WGMMAPipeline.cpp``, ``dotCanBeProperlyAsync``), and an int8 wgmma accumulates in int32, so the Triton W8A8
kernel (:mod:`pallas_kernels.w8a8`) issues a K step's ``IGMMA``s and waits for them (``WARPGROUP.DEPBAR.LE gsb0,
0x0``) every step; it overlaps tensor-core work only across the two programs an SM holds, and took 1.04-1.27x bf16
at 2048 rows on an H200 where int8 tensor cores peak at 2x. Mosaic GPU states the wait itself (``wgmma_wait(1)``).

The kernel (the layout of JAX's own Hopper matmul example, ``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``,
written here for int8 with a fused rescale):

- one program per SM, walking the output tiles (``plgpu.nd_loop``) in a snake order (``hopper.snake_tile``) so that
  neighbouring SMs share x's and the weights' tiles in L2;
- three warpgroups: one issues the TMA copies of x's ``(tile_m, tile_k)`` and the weights' ``(2 tile_n, tile_k)``
  tiles into a ring of ``stages`` shared-memory slots (``plgpu.emit_pipeline_warp_specialized``); two compute
  warpgroups each multiply x's tile by their half of the weight tile into an int32 accumulator of ``tile_m x
  tile_n`` (128 registers a thread at 128 x 128), releasing a slot one step late (``delay_release=1``) so that one
  step's wgmma stays in flight while the next is issued;
- the weights stored K-major, ``(N, K)`` (:func:`llmeq_jax.decode_layout` / ``pipeline.run_layout`` keep W8A8
  weights so on a GPU), read through a transposed view: int8 wgmma takes K-major operands only;
- the epilogue converts the accumulator to float32, multiplies by the weight's per-channel scale and by x's per-token
  scale (both copied into shared memory by TMA while the K loop runs), adds the bias, rounds into x's dtype and
  stores through shared memory by TMA in ``epi x epi`` pieces.

sm_90a SASS (deviceless, ``jaxlib 0.11.2``, ``MOSAIC_GPU_DUMP_PTX``; 2048 x 4096 x 11008): the K loop issues eight
``IGMMA.64x128x32.S8.S8`` then ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (one group in flight), 168 registers, no spills,
226 KB of shared memory at four stages. Not yet timed on a GPU: dispatch takes it only where a measured table says
it beat the Triton kernel (``llmeq_jax.kernel_dispatch``, kernel ``w8a8_hopper``).

Numerics are :func:`pallas_kernels.w8a8.w8a8_reference`'s, bit for bit: x quantized by
:func:`pallas_kernels.w8a8.quantize_rows` (XLA, one pass), exact int32 products, ``((acc * w_scale) * scale_x) +
bias`` in float32, rounded once.

**FP8 (E4M3, ``fp8=True``)**: the same kernel with ``float8_e4m3fn`` operands (x quantized to E4M3 per token, the
weights' stored bit patterns read as E4M3) and float32 accumulation. Hopper's FP8 wgmma adds its products into the
accumulator with ~14 mantissa bits (DeepSeek-V3 measured ~2 % relative error at K = 4096), so each 128-value K step
(:data:`pallas_kernels.fp8_dot.PROMOTE_EVERY`, the Triton FP8 kernel's promotion interval) runs into a fresh
accumulator that is added to a float32 sum in registers -- CUTLASS's "two accumulators" FP8 GEMM. Two register
tiles a warpgroup, so FP8's default tile is ``64 x 128`` a warpgroup (:func:`default_blocks`: 64 + 64 registers a
thread) where int8 keeps ``128 x 128``; the step waits for its own wgmma before the add, while the other compute
warpgroup's wgmma keeps the tensor cores busy. Against the reference (exact float32 sums of the E4M3 products) only
the order of the float32 sums differs.

Contract:
  x        (M, K)       bfloat16 / float16 (any M: rows are padded to the tile)
  wq       (N, K)       int8, K-major (``fp8``: E4M3 bit patterns, as a QArray stores them); or a stack (L, N, K)
                        with ``layer``
  w_scale  (1, N)       float32 per output channel; or (L, 1, N)
  bias     (N,)         or None
  act_scale             None: per-token absmax; else a static per-tensor scale
  -> y     (M, N)       x's dtype
Needs K % tile_k == 0 and N % (2 tile_n) == 0, and for FP8 tile_k = 128 (:func:`can_use`); sm_90 (Hopper) only:
wgmma.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from llmeq_jax.core import fp8grid
from pallas_kernels import config, fp8_dot, hopper, w8a8
from pallas_kernels.common import cdiv
from pallas_kernels.hopper import snake_tile


@dataclasses.dataclass(frozen=True)
class HopperBlocks:
    """Tile settings. A program's output tile is ``tile_m x 2 tile_n`` (two compute warpgroups side by side)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128  # 128 int8 = the 128-byte swizzle a wgmma operand row wants
    stages: int = 4  # shared-memory slots of the TMA ring (fewer where they do not fit: hopper.stages_that_fit)
    epi: int = 64  # the epilogue's square store pieces
    snake_minor_n: bool = True  # snake_tile's minor dimension: N (tiles of one row block visited together) or M
    snake_width: int = 8

    def __post_init__(self):
        hopper.check_blocks(self, tile_k_multiple=128)


def default_blocks(fp8: bool = False) -> HopperBlocks:
    """int8: ``128 x 128`` a compute warpgroup (one int32 accumulator, 128 registers a thread); FP8: ``64 x 128``,
    whose float32 sum and per-step accumulator take as many (module docstring)."""
    return HopperBlocks(tile_m=64) if fp8 else HopperBlocks()


def _shared_bytes(b: HopperBlocks, stages: int, has_bias: bool, out_dtype) -> int:
    ring = stages * (b.tile_m + 2 * b.tile_n) * b.tile_k  # int8 tiles of x and of the weights
    vectors = 2 * 4 * (b.tile_m + b.tile_n * (2 if has_bias else 1))  # scale_x, w_scale, bias (float32) per group
    return ring + hopper.output_bytes(b.epi, out_dtype) + vectors


def can_use(x_shape, x_dtype, wq_dtype, k: int, n: int, group, has_zero_point: bool,
            blocks: HopperBlocks | None = None, fp8: bool = False) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    b = blocks or default_blocks(fp8)
    ok, why = w8a8.can_use(x_shape, x_dtype, wq_dtype, k, group)  # what the Triton kernel takes, then more
    if not ok:
        return ok, why
    if jnp.dtype(x_dtype) not in hopper.HALF_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not bfloat16/float16"
    if group is not None or has_zero_point:
        return False, "per-group scales or zero points (the kernel takes symmetric per-channel weights)"
    if k % b.tile_k or n % (2 * b.tile_n):
        return False, f"K {k} not a multiple of {b.tile_k} or N {n} not of {2 * b.tile_n}"
    if not fp8 and k < 2 * b.tile_k:  # int8's slots are released a step late (wgmma left in flight): 2 steps
        return False, f"K {k} is one step of {b.tile_k} (the int8 pipeline takes at least two)"
    if fp8 and b.tile_k != fp8_dot.PROMOTE_EVERY:
        return False, f"FP8 K steps of {b.tile_k} values (its sums are promoted every {fp8_dot.PROMOTE_EVERY})"
    return hopper.wgmma_available()


def _check(x, wq, w_scale, bias, layer, blocks: HopperBlocks, fp8: bool):
    lead = () if layer is None else wq.shape[:1]
    if wq.ndim != 2 + len(lead) or x.ndim != 2 or wq.shape[-1] != x.shape[1]:
        raise ValueError(f"w8a8_hopper expects x (M, K) and wq {'(L, N, K)' if lead else '(N, K)'} "
                         f"(K-major); got {x.shape} and {wq.shape}")
    n = wq.shape[-2]
    if w_scale.shape != (*lead, 1, n):
        raise ValueError(f"w8a8_hopper: w_scale has shape {w_scale.shape}, expected {(*lead, 1, n)} (per channel)")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"w8a8_hopper: bias has shape {bias.shape}, expected {(n,)}")
    ok, why = can_use(x.shape, x.dtype, wq.dtype, x.shape[1], n, None, False, blocks, fp8)
    if not ok:
        raise ValueError(f"w8a8_hopper: {why}")


def _kernel(x_gmem, sx_gmem, w_gmem, ws_gmem, *rest, b: HopperBlocks, m: int, n: int, k: int, stages: int,
            has_bias: bool, stacked: bool, fp8: bool, out_dtype, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rest = list(rest)
    bias_gmem = rest.pop(0) if has_bias else None
    if stacked:  # the layer index, one int32 in global memory: the stack is read in place
        layer = rest.pop(0)[0]
        w_gmem, ws_gmem = w_gmem.at[layer], ws_gmem.at[layer]
    (o_gmem,) = rest
    tm, tn, tk = b.tile_m, b.tile_n, b.tile_k
    m_tiles, n_tiles = m // tm, n // (2 * tn)
    operand = hopper.swizzled(tk, x_gmem.dtype)
    # int8: a slot is released one step late, the step's wgmma left in flight; FP8 waits for its step's own
    release = 0 if fp8 else 1

    def pipeline(body, context):
        spec = lambda rows: plgpu.BlockSpec((rows, tk), lambda kb: (0, kb), transforms=operand,  # noqa: E731
                                            memory_space=plgpu.SMEM, delay_release=release)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tk,), memory_registers=40, in_specs=[spec(tm), spec(2 * tn)], wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=stages, compute_context=context)

    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies
    vectors = dict(sx_smem=plgpu.SMEM((2, tm), jnp.float32), ws_smem=plgpu.SMEM((2, tn), jnp.float32),
                   bias_smem=plgpu.SMEM((2, tn), jnp.float32) if has_bias else None)

    @functools.partial(pl.run_scoped, ring=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
                       out_smem=hopper.output_slots(b.epi, out_dtype),
                       loaded=plgpu.Barrier(num_arrivals=3 if has_bias else 2, num_barriers=2),
                       collective_axes="wg", **vectors)
    def _scope(ring, out_smem, loaded, sx_smem, ws_smem, bias_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            (tile,) = info.index
            mi, ni = snake_tile(tile, m_tiles, n_tiles, b.snake_width, b.snake_minor_n)
            rows, cols = pl.ds(mi * tm, tm), pl.ds((2 * ni + wg) * tn, tn)

            def context(run_k_loop):
                def epilogue(acc):  # the float32 sums, rescaled and stored
                    plgpu.barrier_wait(loaded.at[wg])
                    row_vec = lambda ref: hopper.broadcast(ref[wg], (tm, tn), False, interpret)  # noqa: E731
                    col_vec = lambda ref: hopper.broadcast(ref[wg], (tm, tn), True, interpret)  # noqa: E731
                    y = (acc * col_vec(ws_smem)) * row_vec(sx_smem)
                    if has_bias:
                        y = y + col_vec(bias_smem)
                    hopper.store_output(y.astype(out_dtype), out_smem, o_gmem.at[rows, cols], wg, b.epi)

                # the epilogue's vectors arrive while the K loop runs
                plgpu.copy_gmem_to_smem(sx_gmem.at[rows], sx_smem.at[wg], loaded.at[wg])
                plgpu.copy_gmem_to_smem(ws_gmem.at[0, cols], ws_smem.at[wg], loaded.at[wg])
                if has_bias:
                    plgpu.copy_gmem_to_smem(bias_gmem.at[cols], bias_smem.at[wg], loaded.at[wg])
                if fp8:  # the promoted float32 sum is a register value carried through the K loop
                    epilogue(run_k_loop(jnp.zeros((tm, tn), jnp.float32)))
                    return

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.int32))
                def _acc(acc_ref):
                    run_k_loop(acc_ref)
                    epilogue(acc_ref[...].astype(jnp.float32))

            def step(index, x_smem, w_smem, carry):
                w_kmajor = plgpu.transpose_ref(w_smem.at[pl.ds(wg * tn, tn)], (1, 0))
                if fp8:  # this step's products in a fresh accumulator, then added to the float32 sum
                    def chain(acc_ref):
                        plgpu.wgmma(acc_ref, x_smem, w_kmajor)
                        return acc_ref[...]  # waits for this step's wgmma

                    return carry + pl.run_scoped(chain, plgpu.ACC((tm, tn), jnp.float32))
                plgpu.wgmma(carry, x_smem, w_kmajor)
                hopper.wait_released(index[0], k // tk)  # the previous step's group done: its slot is released
                return carry

            pipeline(step, context)(x_gmem.at[rows], w_gmem.at[pl.ds(2 * ni * tn, 2 * tn)], allocations=ring)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def w8a8_hopper(x, wq, w_scale, *, bias=None, act_scale=None, layer=None, blocks: HopperBlocks | None = None,
                fp8: bool = False, interpret: bool | None = None):
    """Quantize x per token, then the int8 (``fp8``: E4M3) GEMM with its rescale on Hopper (module docstring: the
    contract)."""
    interpret = config.resolve_interpret(interpret)
    b = blocks or default_blocks(fp8)
    with config.interpret(interpret):  # can_use's device check: interpret mode runs anywhere
        _check(x, wq, w_scale, bias, layer, b, fp8)
    m, k = x.shape
    n = wq.shape[-2]
    xq, sx = w8a8.quantize_rows(x, act_scale, fp8)
    padded = cdiv(m, b.tile_m) * b.tile_m
    if padded != m:  # whole row tiles: the pad rows' codes are 0 and their outputs are cut off below
        xq, sx = jnp.pad(xq, ((0, padded - m), (0, 0))), jnp.pad(sx, ((0, padded - m), (0, 0)), constant_values=1.0)
    if fp8:  # the stored bit patterns as E4M3 (a bit cast: XLA reads the same bytes)
        xq, wq = fp8grid.as_fp8(xq), fp8grid.as_fp8(wq)
    stages = hopper.stages_that_fit(b.stages, k // b.tile_k, lambda st: _shared_bytes(b, st, bias is not None, x.dtype))
    args = [xq, sx.reshape(padded), wq, w_scale.astype(jnp.float32)]
    if bias is not None:
        args.append(bias.astype(jnp.float32))
    if layer is not None:
        args.append(jnp.reshape(layer, (1,)).astype(jnp.int32))
    body = functools.partial(_kernel, b=b, m=padded, n=n, k=k, stages=stages, has_bias=bias is not None,
                             stacked=layer is not None, fp8=fp8, out_dtype=x.dtype, interpret=interpret)
    call = hopper.launch(body, (padded, n), x.dtype, interpret)
    y = call(*args)
    return y if padded == m else y[:m]
