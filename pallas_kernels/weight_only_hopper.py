"""Weight-only int8 and int4 for prompts on Hopper, in Mosaic GPU: each weight tile dequantized into shared memory,
then bf16 (or f16) wgmma.

Why: a prompt's weight-only product is compute-bound, so it can at best match the bf16 GEMM; XLA's path wrote the
dequantized weights in x's dtype before every GEMM (rtn-w8 prefill 0.90x bf16 on an H200, Llama-3-8B 0.78x;
rtn-w4-g128 0.75x / 0.47x; issue #15 wants 0.95x), and the Triton weight-only kernel reached 0.27-0.34x there. Issue
#15's direction for prefill: dequantize a tile in shared memory, then a bf16 MMA -- the weights cross the memory bus
as int8 / int4 and the tensor cores see bf16 operands from shared memory, as in a bf16 GEMM.

The kernel (the persistent layout of :mod:`pallas_kernels.hopper`):

- a producer warpgroup issues TMA copies of x's ``(tile_m, tile_k)`` tile and the weights' ``(tile_k, 2 tile_n)``
  int8 tile (the checkpoint's ``(K, N)`` layout, as stored) into a ring of ``stages`` slots; with group scales, their
  ``(1, 2 tile_n)`` float32 rows of the step's group too (and the zero points': a stack's layer sliced out and
  converted to float32 by XLA, a few KB a call, as the dequantization subtracts them in float32);
- each compute warpgroup loads its ``(tile_k, tile_n)`` half of the codes into registers, dequantizes it -- ``(q -
  z) * s`` in float32, rounded once into x's dtype, as ``QArray.dequantize`` does; with per-channel scales only
  ``q - z`` (exact in bf16 / f16), the scale waiting for the epilogue -- stores it into one of two bf16 buffers of
  its own, fences it for the tensor cores (``commit_smem``), and issues the step's wgmma (A: x's tile, B: the
  buffer), keeping one step's wgmma in flight (``wgmma_wait(1)``): while the tensor cores multiply step k, the
  warpgroup dequantizes step k + 1 into the other buffer;
- the epilogue multiplies by the per-channel scale (copied into shared memory by TMA while the K loop runs), adds
  the bias, rounds once into x's dtype and stores through shared memory by TMA.

int4 (``bits=4``) reads the QArray's bytes as stored -- two codes a byte, packed along K, the even K row in the low
nibble -- ``tile_k / 2`` rows of them a step; a warpgroup sign-extends both nibbles by shifts (in int32: Mosaic GPU
shifts no 8-bit vectors) and stores the even rows' codes in the top half of its buffer, the odd rows' in the bottom
half. x's columns are permuted to that order once per call by XLA (:func:`pair_columns`, one pass over x), so the
wgmma sums the same products.

sm_90a SASS (deviceless, jaxlib 0.11.2; 2048 x 4096 x 4096, per channel): the K loop loads its 64 codes a thread
(``LDS.U16``), converts them, writes them with ``STSM.16.M88.4`` x8, fences (``FENCE.VIEW.ASYNC.S``) and issues eight
``HGMMA.64x128x16.F32.BF16`` then ``WARPGROUP.DEPBAR.LE gsb0, 0x1``; 168 registers, local-memory spills (about a
dozen) only outside the K loop, none with group scales. int4 g128 (``gpu_aot.py --prefill 2048 --recipes rtn-w4-g128
--sass``, a table choosing it): sixteen ``HGMMA.64x64x16.F32.BF16`` a 128-value step, 168 registers, no spills. Not
yet timed on a GPU: dispatch takes it only where a measured table says it beat XLA's path
(``llmeq_jax.kernel_dispatch``, kernel ``weight_only_hopper``).

Contract:
  x            (M, K)     bfloat16 / float16 (any M: rows are padded to the tile)
  wq           (K, N)     int8 codes (weight-only int5..int8), or with ``bits=4`` (K / 2, N) uint8: int4 pairs;
                          or a stack (L, ...) with ``layer``
  scale        (G, N)     float32: G = 1 (per channel) or K / group; or (L, G, N)
  zero_point   (G, N)     integers (int8 as QArray stores them), or None (symmetric); or (L, G, N)
  bias         (N,)       or None
  -> y         (M, N)     x's dtype
Needs K % tile_k == 0, N % (2 tile_n) == 0 and a group that is a multiple of tile_k (:func:`can_use`; int4: tile_k a
multiple of 128, :func:`default_blocks`); sm_90 only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels import config, hopper
from pallas_kernels.common import cdiv


@dataclasses.dataclass(frozen=True)
class WeightOnlyBlocks:
    """Tile settings. A program's output tile is ``tile_m x 2 tile_n`` (two compute warpgroups side by side)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64  # 64 bf16 = the 128-byte swizzle row of x's tile; 64 rows = the codes' register layout
    stages: int = 4  # slots of the TMA ring (fewer where they do not fit: hopper.stages_that_fit)
    epi: int = 64  # the epilogue's square store pieces
    snake_minor_n: bool = True
    snake_width: int = 8

    def __post_init__(self):
        hopper.check_blocks(self, tile_k_multiple=64)


def _shared_bytes(b: WeightOnlyBlocks, stages: int, dtype, grouped: bool, has_zp: bool, has_bias: bool,
                  bits: int) -> int:
    item = jnp.dtype(dtype).itemsize
    step = b.tile_m * b.tile_k * item + b.tile_k // _per_byte(bits) * 2 * b.tile_n  # x's tile and the codes
    step += 2 * b.tile_n * 4 * (1 + int(has_zp)) if grouped else 0  # the step's group scale and zero point rows
    dequantized = 2 * 2 * b.tile_k * b.tile_n * item  # two buffers per compute warpgroup
    per_channel = 0 if grouped else 1 + (1 if has_zp else 0)  # scale, zero point (and x's row sums) in the epilogue
    vectors = 2 * 4 * (b.tile_n * (per_channel + int(has_bias)) + (b.tile_m if has_zp and not grouped else 0))
    return stages * step + dequantized + hopper.output_bytes(b.epi, dtype) + vectors


def _per_byte(bits: int) -> int:
    return {8: 1, 4: 2}[bits]


def default_blocks(bits: int = 8) -> WeightOnlyBlocks:
    """int8: 128 x 256 output tiles, 64 K values a step. int4: 128 x 128 tiles, 128 K values a step (the 64 rows of
    packed bytes the codes' register layout takes), so that three slots of the ring and the two warpgroups' bf16
    buffers fit the 227 KB."""
    return WeightOnlyBlocks() if bits == 8 else WeightOnlyBlocks(tile_n=64, tile_k=128, stages=3)


def can_use(x_shape, x_dtype, wq_dtype, k: int, n: int, group: int | None,
            blocks: WeightOnlyBlocks | None = None, bits: int = 8) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    if bits not in (4, 8):
        return False, f"int{bits} codes (the kernel reads int8 codes or int4 ones packed in pairs along K)"
    b = blocks or default_blocks(bits)
    if len(x_shape) != 2 or x_shape[1] != k:
        return False, f"x of shape {tuple(x_shape)} for a ({k}, {n}) weight (expected (M, {k}))"
    if jnp.dtype(x_dtype) not in hopper.HALF_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not bfloat16/float16"
    stored = jnp.int8 if bits == 8 else jnp.uint8
    if jnp.dtype(wq_dtype) != stored:
        return False, (f"int{bits} codes stored as {jnp.dtype(wq_dtype).name} (expected {jnp.dtype(stored).name}: "
                       + ("int8 codes, not packed ones)" if bits == 8 else "two codes a byte, packed along K)"))
    if bits == 4 and b.tile_k % 128:
        return False, f"tile_k {b.tile_k}: int4 steps take multiples of 128 K values (64 rows of packed bytes)"
    if k % b.tile_k or n % (2 * b.tile_n):
        return False, f"K {k} not a multiple of {b.tile_k} or N {n} not of {2 * b.tile_n}"
    if k < 2 * b.tile_k:  # a slot released a step late (wgmma left in flight) needs a step after it
        return False, f"K {k} is one step of {b.tile_k} (the pipeline takes at least two)"
    if group is not None and (group % b.tile_k or k % group):
        return False, f"group {group} (the kernel takes groups that are multiples of {b.tile_k} and divide K)"
    return hopper.wgmma_available()


def _check(x, wq, scale, zero_point, group, bias, layer, blocks: WeightOnlyBlocks, bits: int):
    lead = () if layer is None else wq.shape[:1]
    rows = "K" if bits == 8 else "K / 2"
    if wq.ndim != 2 + len(lead) or x.ndim != 2 or wq.shape[-2] * _per_byte(bits) != x.shape[1]:
        raise ValueError(f"weight_only_hopper expects x (M, K) and int{bits} wq "
                         f"{f'(L, {rows}, N)' if lead else f'({rows}, N)'}; got {x.shape} and {wq.shape}")
    k, n = x.shape[1], wq.shape[-1]
    hopper.check_scales("weight_only_hopper", scale, zero_point, bias, lead, 1 if group is None else k // group, n,
                        group)
    ok, why = can_use(x.shape, x.dtype, wq.dtype, k, n, group, blocks, bits)
    if not ok:
        raise ValueError(f"weight_only_hopper: {why}")


def _codes(stored, bits: int) -> tuple:
    """The signed codes of a tile of stored bytes: int8 as they are; int4 pairs (QArray's packing along K: the even
    K row in the low nibble) as (even rows, odd rows), each sign-extended by an arithmetic shift (in int32: Mosaic
    GPU shifts no 8-bit vectors)."""
    if bits == 8:
        return (stored,)
    word = stored.astype(jnp.int32)
    return (lax.shift_right_arithmetic(lax.shift_left(word, jnp.int32(28)), jnp.int32(28)),
            lax.shift_right_arithmetic(word, jnp.int32(4)))


def pair_columns(x, tile_k: int):
    """x's columns in the order :func:`_codes` lays an int4 step's K rows out: in each block of ``tile_k``, the even
    ones, then the odd ones."""
    m, k = x.shape
    return x.reshape(m, k // tile_k, tile_k // 2, 2).swapaxes(-1, -2).reshape(m, k)


def _dequantize(codes, scale, zero, dtype, interpret: bool):
    """``(q - z) * s`` of a ``(tile_k, tile_n)`` tile in float32, rounded once into ``dtype`` (scale / zero: per-
    column vectors or None); codes alone convert exactly."""
    if scale is None and zero is None:
        return codes.astype(dtype)
    along = functools.partial(hopper.broadcast, shape=codes.shape, along_rows=True, interpret=interpret)
    v = codes.astype(jnp.float32)
    if zero is not None:
        v = v - along(zero)
    if scale is not None:
        v = v * along(scale)
    return v.astype(dtype)


def _kernel(x_gmem, w_gmem, s_gmem, *rest, b: WeightOnlyBlocks, m: int, n: int, k: int, stages: int, group, has_zp,
            has_bias: bool, stacked: bool, out_dtype, bits: int, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    grouped = group is not None
    rest = list(rest)
    z_gmem = rest.pop(0) if has_zp else None
    xsum_gmem = rest.pop(0) if has_zp and not grouped else None  # x's row sums, for a per-channel zero point
    bias_gmem = rest.pop(0) if has_bias else None
    if stacked:  # the layer index, one int32 in global memory: the stack is read in place
        layer = rest.pop(0)[0]
        w_gmem, s_gmem = w_gmem.at[layer], s_gmem.at[layer]
    (o_gmem,) = rest
    tm, tn, tk = b.tile_m, b.tile_n, b.tile_k
    per = _per_byte(bits)  # codes a byte: a step reads tk / per rows of them
    m_tiles, n_tiles = m // tm, n // (2 * tn)
    # per channel, the scale and zero point wait for the epilogue: y = (x @ q - sum(x) z) s
    epilogue = dict(s=not grouped, z=has_zp and not grouped, bias=has_bias)

    def pipeline(body, context):
        # the codes' tiles as wide as one warpgroup's columns: each reads its half
        operand = lambda shape, index, dtype, minor: plgpu.BlockSpec(  # noqa: E731
            shape, index, transforms=hopper.swizzled(minor, dtype), memory_space=plgpu.SMEM, delay_release=1)
        group_row = plgpu.BlockSpec((1, 2 * tn), lambda kb: (kb * tk // group, 0), memory_space=plgpu.SMEM,
                                    delay_release=1)
        specs = [operand((tm, tk), lambda kb: (0, kb), out_dtype, tk),
                 operand((tk // per, 2 * tn), lambda kb: (kb, 0), jnp.int8, tn)]
        specs += [group_row] * ((1 + int(has_zp)) if grouped else 0)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tk,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=context)

    def operands(rows, ni):
        cols = pl.ds(2 * ni * tn, 2 * tn)
        ops = [x_gmem.at[rows], w_gmem.at[:, cols]]
        return ops + ([s_gmem.at[:, cols]] + ([z_gmem.at[:, cols]] if has_zp else []) if grouped else [])

    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies
    vectors = {name: plgpu.SMEM((2, tm if name == "xsum" else tn), jnp.float32) if wanted else None
               for name, wanted in dict(epilogue, xsum=epilogue["z"]).items()}
    arrivals = sum(int(v is not None) for v in vectors.values())

    @functools.partial(pl.run_scoped, ring=pipeline(ignore, ignore).get_allocations(*operands(pl.ds(0, tm), 0)),
                       out_smem=hopper.output_slots(b.epi, out_dtype),
                       dequantized=plgpu.SMEM((2, 2, tk, tn), out_dtype, transforms=hopper.swizzled(tn, out_dtype)),
                       loaded=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2) if arrivals else None,
                       collective_axes="wg", **vectors)
    def _scope(ring, out_smem, dequantized, loaded, s, z, bias, xsum):
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * tn, tn)  # this warpgroup's columns of the program's tile

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            (tile,) = info.index
            mi, ni = hopper.snake_tile(tile, m_tiles, n_tiles, b.snake_width, b.snake_minor_n)
            rows, cols = pl.ds(mi * tm, tm), pl.ds((2 * ni + wg) * tn, tn)

            def context(run_k_loop):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc_ref):
                    # the epilogue's vectors arrive while the K loop runs
                    sources = dict(s=lambda: s_gmem.at[0, cols], z=lambda: z_gmem.at[0, cols],
                                   bias=lambda: bias_gmem.at[cols], xsum=lambda: xsum_gmem.at[rows])
                    for name, ref in dict(s=s, z=z, bias=bias, xsum=xsum).items():
                        if ref is not None:
                            plgpu.copy_gmem_to_smem(sources[name](), ref.at[wg], loaded.at[wg])
                    run_k_loop(acc_ref)
                    y = acc_ref[...]
                    if arrivals:
                        plgpu.barrier_wait(loaded.at[wg])
                    col = lambda ref: hopper.broadcast(ref[wg], (tm, tn), True, interpret)  # noqa: E731
                    if xsum is not None:
                        y = y - hopper.broadcast(xsum[wg], (tm, tn), False, interpret) * col(z)
                    if s is not None:
                        y = y * col(s)
                    if bias is not None:
                        y = y + col(bias)
                    hopper.store_output(y.astype(out_dtype), out_smem, o_gmem.at[rows, cols], wg, b.epi)

            def step(index, x_smem, w_smem, *group_rows_and_acc):
                *group_rows, acc_ref = group_rows_and_acc
                scale, zero = (group_rows + [None, None])[:2]  # the step's group rows, where grouped
                buffer = dequantized.at[wg, lax.rem(index[0], 2)]  # read by wgmma two steps ago: done (below)
                dequantize = functools.partial(_dequantize, scale=None if scale is None else scale[0, mine],
                                               zero=None if zero is None else zero[0, mine], dtype=out_dtype,
                                               interpret=interpret)
                for half, codes in enumerate(_codes(w_smem[:, mine], bits)):  # int4: x's columns permuted to match
                    buffer.at[pl.ds(half * (tk // per), tk // per)][...] = dequantize(codes)
                plgpu.commit_smem()  # the generic-proxy stores, visible to the tensor cores
                plgpu.wgmma(acc_ref, x_smem, buffer)
                hopper.wait_released(index[0], k // tk)  # the previous step's group done: its slots and buffer free
                return acc_ref

            pipeline(step, context)(*operands(rows, ni), allocations=ring)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def weight_only_hopper(x, wq, scale, *, zero_point=None, group: int | None = None, bias=None, layer=None,
                       bits: int = 8, blocks: WeightOnlyBlocks | None = None, interpret: bool | None = None):
    """``x @ dequantize(w)`` for int8 or packed int4 codes on Hopper (module docstring: the contract)."""
    interpret = config.resolve_interpret(interpret)
    if bits not in (4, 8):
        raise ValueError(f"weight_only_hopper: bits={bits!r}, expected 8 (int8 codes) or 4 (packed pairs)")
    b = blocks or default_blocks(bits)
    with config.interpret(interpret):  # can_use's device check: interpret mode runs anywhere
        _check(x, wq, scale, zero_point, group, bias, layer, b, bits)
    m, k = x.shape
    n = wq.shape[-1]
    if bits == 4:  # the kernel reads the pairs' bytes as int8 and x's columns in their order
        wq = lax.bitcast_convert_type(wq, jnp.int8)
    padded = cdiv(m, b.tile_m) * b.tile_m
    if padded != m:  # whole row tiles: the pad rows are zeros and their outputs are cut off below
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    has_zp, has_bias = zero_point is not None, bias is not None
    stages = hopper.stages_that_fit(
        b.stages, k // b.tile_k, lambda st: _shared_bytes(b, st, x.dtype, group is not None, has_zp, has_bias, bits))
    args = [x if bits == 8 else pair_columns(x, b.tile_k), wq, scale.astype(jnp.float32)]
    if has_zp and layer is not None:  # the layer's rows only: converting the whole stack cost a pass over it a call
        zero_point = lax.dynamic_index_in_dim(zero_point, layer, axis=0, keepdims=False)
    if has_zp and group is None:  # per channel: (x @ q - sum(x) z) s in the epilogue
        args += [zero_point.astype(jnp.float32), jnp.sum(x.astype(jnp.float32), axis=1)]
    elif has_zp:  # float32 rows, as the scales (module docstring)
        args += [zero_point.astype(jnp.float32)]
    args += [bias.astype(jnp.float32)] if has_bias else []
    args += [jnp.reshape(layer, (1,)).astype(jnp.int32)] if layer is not None else []
    body = functools.partial(_kernel, b=b, m=padded, n=n, k=k, stages=stages, group=group, has_zp=has_zp,
                             has_bias=has_bias, stacked=layer is not None, out_dtype=x.dtype, bits=bits,
                             interpret=interpret)
    y = hopper.launch(body, (padded, n), x.dtype, interpret)(*args)
    return y if padded == m else y[:m]
