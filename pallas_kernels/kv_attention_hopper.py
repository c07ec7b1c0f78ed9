"""One query token's attention over an int8 or int4 quantized KV store on Hopper, in Mosaic GPU (flash decoding).

Why: issue #15 wants a decode step's attention over an int8 / int4 cache at 32K tokens 1.5x / 2x faster than bf16
attention (half / a quarter of the bytes). On an H200 the Triton decode kernel
(:func:`pallas_kernels.kv_cache.store_decode_attention`) took 1.02x / 1.10x and XLA's dots over the codes
(:mod:`llmeq_jax.kv.store_attention`) 1.12x / 1.38x: 1.5 TB/s of int8 codes where a bf16 cache streams at 2.6.
This kernel is the layout of the Mosaic GPU matmuls here (:mod:`pallas_kernels.hopper`): one program an SM walking
work items -- a (batch row, KV head, split of the tokens) each --, a producer warpgroup streaming the split's key and
value codes (and each token's value grid and mask) by TMA through a ring of 128-token steps, two compute warpgroups
each taking 64 tokens of a step with a softmax state of its own. Per step a compute warpgroup:

- converts its 64 tokens' key and value codes to bf16 in shared memory (codes up to 8 bits are exact in bf16;
  int4 codes are the store's bytes read as ``jnp.int4``, low nibble first, as XLA's path reads them);
- takes the scores as JAX's Hopper attention example does (``jax.experimental.pallas.ops.gpu.attention_mgpu``):
  ``S = q' K^T`` by wgmma with the query rows as M -- a KV head's query heads (GQA) padded to wgmma's 64 rows;
  the MMAs are not what bounds one token's attention, the bytes are;
- masks, and updates its running max, sum and output (online softmax, ``exp2`` as the example);
- adds ``P' V`` by wgmma (``P' = P`` times each token's value scale, rounded to bf16 as XLA's path rounds it).

The grids are folded out of the dots as in :mod:`llmeq_jax.kv.store_attention` (same algebra, same roundings):
keys per channel, ``q . k = (q s_k) . c + q . (lo_k - qmin s_k)``, the first term in the kernel (``q' = q s_k``,
bf16), the second one number per query that shifts its scores alike, added to the log-sum-exp by XLA; values per
token, ``sum_t p_t v_t = (p s_v) . c + sum_t p_t (lo_v - qmin s_v)_t``, both in the kernel.

Keys stored before RoPE (the cache's default spec) cannot have their scales folded into the query: the rotation mixes
channel i with i + 64, each with its own scale. The kernel takes them as two half tiles (channels 0-63, 64-127, each
its own TMA copy), dequantizes both in registers with the per-channel grid (``c s_k + lo_k - qmin s_k``), rotates the
pair by the slot's position (the angle reduced by whole turns, then the approximate ``cos`` / ``sin``: as the Triton
kernel does), stores them as bf16 and takes ``S = q_0 K_0^T + q_1 K_1^T`` in two wgmma chains. sm_90a (deviceless,
Llama-2-7B at 32K slots): the SASS's hottest loop 2554 instructions at int8 and 2977 at int4 where post-RoPE keys'
is 1908 by the same count (``scripts/kernel_sass.py``'s), 32 MUFU.SIN and 32 MUFU.COS a thread a step, 168
registers, no spills. (2471 / 2935 with the offset ``lo - qmin s`` made by XLA: the kernel now reads the cache's
``lo`` and scale rows as they are and makes it on the channels' vectors each step, ~3 % more instructions for a
launch of XLA's less a layer; the GPU run decides, the table measuring the whole call.)

Each warpgroup's work item leaves its normalized output rows and their log-sum-exp (the real query rows only); one
Triton kernel (:func:`pallas_kernels.split_merge.merge_splits`) merges the ``2 x splits`` partial results of each
head, with the cache's float sinks' share of the softmax where it has sinks, and writes the output in the dtype the
caller reads. What a cache's step passes is read where the cache keeps it: every layer's key grid (pre-RoPE keys),
the step's one-byte slot mask made once for every layer (``length=None``), the sinks' stacks. A Llama-2-7B decode
layer over an int8 pre-RoPE cache with 4 sinks (deviceless H100 compile, 32K slots): 27 -> 19 launches (XLA's merge,
the sinks' attention and its merge, the key grid's rows and the mask's conversion were 9 small launches around the
kernel); the Triton kernel's layer is 18.

sm_90a (deviceless, jaxlib 0.11.2; 32K slots, 8 KV heads x 4 queries): ~1030 instructions a compute thread a 128-token
step at int8 (~460 converting the two tiles, the rest the softmax and two wgmma chains), 168 registers (setmaxnreg
gives the compute warpgroups 232), 202 KB of shared memory at 2 ring slots (int8) or 4 (int4). At an H100's bandwidth
a step's 32 KB of int8 codes take ~2400 cycles an SM and its two warpgroups issue ~2100 a scheduler: near the line,
so the GPU run decides (dispatch takes the kernel only where a table measured it faster).

Contract (:func:`kv_attention_hopper`: :func:`llmeq_jax.kv.store_attention.store_attention`'s, and pre-RoPE keys as
:func:`pallas_kernels.kv_cache.store_decode_attention` takes them):
  q        [B, H_q, D]          bf16 / f16, H_q = G H_kv with G <= 64
  k_codes  [B, H_kv, T, D]      int8; int4: uint8 [B, H_kv, T, D / 2] (a stack [L, ...] with ``layer``)
  v_codes  [B, H_kv, T, D]      as k_codes
  k_scale, k_lo  [B or 1, H_kv, 1, D]   the keys' per-channel grid (or with ``layer`` every layer's, [L, ...])
  v_scale, v_lo  [B, H_kv, T, 1]        the values' per-token grid (a stack [L, ...] with ``layer``)
  length   [B] or scalar        slots written; ``allowed`` [B, T] bool: the slots a row reads
           (``length=None``: ``allowed`` int8, 1 = read, says it all)
  slot_pos [B, T], inv_freq [D / 2]   keys stored before RoPE: each slot's position, the RoPE frequencies
  sinks    (k, v, seen)         optional float keys (post-RoPE) and values [(L,) B, H_kv, N, D], seen [B, N]
  -> (out [B, H_q, D] ``out_dtype`` (float32), lse [B, H_q] float32)
Needs D = 128, T a multiple of 128 (:func:`can_use`); sm_90 only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from llmeq_jax.core.qarray import int_range
from llmeq_jax.core.rope import reduced_angle
from llmeq_jax.kv.store_attention import codes as store_codes
from llmeq_jax.kv.store_attention import fold_key_grid, slot_mask
from pallas_kernels import config, hopper
from pallas_kernels.common import cdiv
from pallas_kernels.kv_cache import check_key_grid, check_sinks
from pallas_kernels.split_merge import merge_splits

TOKENS = 128  # tokens a ring step carries: 64 for each compute warpgroup
ROWS = 64  # wgmma's M: a KV head's query rows, padded
HEAD_DIM = 128
HALF = HEAD_DIM // 2  # RoPE pairs channel i with i + 64: pre-RoPE keys are read, rotated and multiplied as halves
STAGED = 64  # output columns staged in shared memory at a time (float32: the whole row tile would not fit)
NEG_INF = -1e30  # finite, as the other paths: a row with no allowed slot gives lse ~ -1e30, not nan
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Launch settings: the ring's slots (128-token steps) and the splits of the tokens per (batch row, KV head)
    (None: :func:`splits_for`)."""

    stages: int = 4  # fewer where they do not fit: int8 takes 2, int4 4 (hopper.stages_that_fit)
    splits: int | None = None

    def __post_init__(self):
        if self.stages < 2 or (self.splits is not None and self.splits < 1):
            raise ValueError(f"AttentionBlocks: stages >= 2, splits >= 1; got {self}")


def splits_for(heads: int, steps: int, sms: int) -> int:
    """Splits of each head's ``steps`` 128-token steps: enough work items for two an SM, each split at least two
    steps, dividing the steps evenly."""
    want = max(1, min(steps // 2, cdiv(2 * sms, heads)))
    return max(s for s in range(1, want + 1) if steps % s == 0)


def can_use(q_shape, q_dtype, codes_shape, bits: int) -> tuple[bool, str]:
    """(True, "") where the kernel takes this step (keys stored before or after RoPE), else (False, why)."""
    if bits not in (4, 8):
        return False, f"int{bits} codes (the kernel reads int8 and int4)"
    if len(q_shape) != 3 or len(codes_shape) < 4:
        return False, f"q {tuple(q_shape)} and codes {tuple(codes_shape)} are not [B, H_q, D] and [B, H_kv, T, D]"
    heads, t, d = codes_shape[-3], codes_shape[-2], codes_shape[-1] * (8 // bits)
    if d != HEAD_DIM or q_shape[-1] != d:
        return False, f"head_dim {d} (the kernel takes {HEAD_DIM})"
    if q_shape[1] % heads or q_shape[1] // heads > ROWS:
        return False, f"{q_shape[1]} query heads over {heads} KV heads (at most {ROWS} each)"
    if t % TOKENS:
        return False, f"{t} slots, not a multiple of {TOKENS}"
    if jnp.dtype(q_dtype) not in hopper.HALF_DTYPES:  # float32 queries: XLA's path keeps float32 operands
        return False, f"query dtype {jnp.dtype(q_dtype).name} (the kernel's operands are bf16: half queries only)"
    return hopper.wgmma_available()


def _shared_bytes(stages: int, bits: int, rope: bool = False) -> int:
    # codes, v_scale, v_lo, mask (and each slot's position: pre-RoPE keys)
    ring = stages * (2 * TOKENS * HEAD_DIM * bits // 8 + TOKENS * (2 + 2 + 1 + 4 * rope))
    per_wg = 3 * ROWS * HEAD_DIM * 2 + ROWS * STAGED * 4 + ROWS * 4  # q', keys, values (bf16); out, lse staging
    per_wg += (2 * HEAD_DIM + HALF) * 4 * rope  # pre-RoPE keys: the key grid's scale and lo rows, the frequencies
    return ring + 2 * per_wg


def _bf16_codes(ref, interpret: bool):
    """A (64, 128) tile of int8 or int4 codes from shared memory as bf16 (exact), for the store into the warpgroup's
    bf16 tile. int8: loaded in wgmma's 8-bit layout (``ldmatrix``, 16 bytes a thread; the layout inference's own
    choice gathered two codes a 16-bit load: 550 -> 460 instructions a step for the two tiles, sm_90a); int4: eight
    codes a 32-bit register (``WGMMA_UPCAST_4X``), moved into wgmma's 16-bit layout, then converted (as
    :mod:`pallas_kernels.decode_hopper` loads its int4 weights). Interpret mode simulates no register layouts."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        return ref[...].astype(jnp.bfloat16)
    int4 = jnp.dtype(ref.dtype) == jnp.dtype(jnp.int4)
    codes = hopper.load(ref, plgpu.Layout.WGMMA_UPCAST_4X if int4 else plgpu.Layout.WGMMA_8BIT)
    return (plgpu.layout_cast(codes, plgpu.Layout.WGMMA) if int4 else codes).astype(jnp.bfloat16)


def _f32_codes(ref, interpret: bool):
    """A (64, 64) tile of int8 or int4 codes from shared memory as float32 in wgmma's accumulator layout (the
    register layout of the per-channel and per-token vectors they are scaled and rotated with)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        return ref[...].astype(jnp.float32)
    if jnp.dtype(ref.dtype) == jnp.dtype(jnp.int4):
        codes = plgpu.layout_cast(hopper.load(ref, plgpu.Layout.WGMMA_UPCAST_4X), plgpu.Layout.WGMMA)
    else:
        codes = hopper.load(ref, plgpu.Layout.WGMMA)
    return codes.astype(jnp.float32)


def _rotated_keys(k_lo, k_hi, grid, freq, pos, qmin: int, per_channel, per_slot, interpret: bool):
    """Pre-RoPE keys: the two halves' codes (64 tokens x channels 0-63 and 64-127) dequantized with the per-channel
    grid (``grid`` [2, 1, D]: the cache's scale and lo rows, ``c s + lo - qmin s``), rotated by each slot's position
    ``pos`` (64,) and the frequencies ``freq`` [1, D / 2] (rotate-half RoPE, as :func:`llmeq_jax.core.rope.apply_rope`),
    as two bf16 tiles for ``S = q K^T``."""
    import jax.experimental.pallas as pl

    def dequantized(codes, j):  # the offset on the channels' vector (a few registers), not on the tile
        scale, lo = grid[0, 0, pl.ds(j * HALF, HALF)], grid[1, 0, pl.ds(j * HALF, HALF)]
        return _f32_codes(codes, interpret) * per_channel(scale) + per_channel(lo - qmin * scale)

    k0, k1 = dequantized(k_lo, 0), dequantized(k_hi, 1)
    angle = per_slot(pos.astype(jnp.float32)) * per_channel(freq[0])
    # whole turns off first: the GPU's approximate cos / sin (approx_math) are accurate near zero only
    r = reduced_angle(angle, jnp.round(angle * (1 / (2 * math.pi))))
    cos, sin = jnp.cos(r), jnp.sin(r)
    return (k0 * cos - k1 * sin).astype(jnp.bfloat16), (k1 * cos + k0 * sin).astype(jnp.bfloat16)


def _kernel(q_gmem, k_gmem, v_gmem, vs_gmem, vl_gmem, ok_gmem, *rest, batch: int, heads: int, steps: int,
            splits: int, rows: int, qmin: int, stages: int, stacked: bool, rope: bool, grid_stacked: bool,
            grid_rows: bool, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rest = list(rest)
    # pre-RoPE keys: each slot's position (rows of 128, int32), the key grid's scale and lo ([1 or B, H_kv, 1, D],
    # as the cache keeps them: every layer's with grid_stacked) and the frequencies [1, D / 2]
    pos_gmem, ks_gmem, kl_gmem, freq_gmem = (rest.pop(0) for _ in range(4)) if rope else (None,) * 4
    if stacked:  # the layer index, one int32 in global memory: the stacked store is read in place
        layer = rest.pop(0)[0]
        k_gmem, v_gmem, vs_gmem, vl_gmem = (a.at[layer] for a in (k_gmem, v_gmem, vs_gmem, vl_gmem))
        if rope and grid_stacked:
            ks_gmem, kl_gmem = ks_gmem.at[layer], kl_gmem.at[layer]
    o_gmem, lse_gmem = rest
    per_split = steps // splits
    bf16 = jnp.bfloat16
    # Post-RoPE keys come whole (the queries carry their scales: one bf16 tile a step); pre-RoPE keys in halves,
    # channels 0-63 and 64-127, each with the other half of its rotation, so the queries and keys are halves too.
    halves = 2 if rope else 1
    width = HEAD_DIM // halves

    def pipeline(body, context):
        row = plgpu.BlockSpec((1, TOKENS), lambda s: (s, 0), memory_space=plgpu.SMEM)
        codes = lambda w, j: plgpu.BlockSpec((TOKENS, w), lambda s: (s, j), memory_space=plgpu.SMEM,  # noqa: E731
                                             transforms=hopper.swizzled(w, k_gmem.dtype))  # column block j of width w
        keys = [codes(width, j) for j in range(halves)]
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(per_split,), memory_registers=40,
            in_specs=[*keys, codes(HEAD_DIM, 0), row, row, row] + [row] * rope,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=context)

    def operands(b, h, si):
        tokens, step_rows = pl.ds(si * per_split * TOKENS, per_split * TOKENS), pl.ds(si * per_split, per_split)
        return (*[k_gmem.at[b, h, tokens]] * halves, v_gmem.at[b, h, tokens], vs_gmem.at[b, h, step_rows],
                vl_gmem.at[b, h, step_rows], ok_gmem.at[b, step_rows],
                *([pos_gmem.at[b, step_rows]] if rope else []))

    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies
    tile = lambda dtype, w=HEAD_DIM: plgpu.SMEM((2, halves, ROWS, w), dtype,  # noqa: E731
                                                transforms=hopper.swizzled(w, dtype))
    scoped = dict(ring=pipeline(ignore, ignore).get_allocations(*operands(0, 0, 0)), q_smem=tile(bf16, width),
                  k_smem=tile(bf16, width), v_smem=plgpu.SMEM((2, ROWS, HEAD_DIM), bf16,
                                                              transforms=hopper.swizzled(HEAD_DIM, bf16)),
                  out_smem=plgpu.SMEM((2, ROWS, STAGED), jnp.float32, transforms=hopper.swizzled(STAGED, jnp.float32)),
                  lse_smem=plgpu.SMEM((2, ROWS), jnp.float32),
                  q_loaded=plgpu.Barrier(num_arrivals=1 + 3 * rope, num_barriers=2))  # a copy arrives once
    if rope:
        scoped.update(grid_smem=plgpu.SMEM((2, 2, 1, HEAD_DIM), jnp.float32),
                      freq_smem=plgpu.SMEM((2, 1, HALF), jnp.float32))

    @functools.partial(pl.run_scoped, **scoped, collective_axes="wg")
    def _scope(ring, q_smem, k_smem, v_smem, out_smem, lse_smem, q_loaded, grid_smem=None, freq_smem=None):
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * ROWS, ROWS)  # this warpgroup's 64 tokens of a step
        per_row = lambda v, shape: lax.broadcast_in_dim(v, shape, (0,))  # noqa: E731 -- a value per query row
        per_token = functools.partial(hopper.broadcast, shape=(ROWS, ROWS), along_rows=True, interpret=interpret)
        vector = lambda value: value if interpret else plgpu.layout_cast(value, plgpu.Layout.WGMMA.reduce(1))  # noqa: E731
        matrix = lambda value: value if interpret else plgpu.layout_cast(value, plgpu.Layout.WGMMA)  # noqa: E731
        # a pre-RoPE key tile's per-channel (column) and per-slot (row) vectors
        per_channel = functools.partial(hopper.broadcast, shape=(ROWS, HALF), along_rows=True, interpret=interpret)
        per_slot = functools.partial(hopper.broadcast, shape=(ROWS, HALF), along_rows=False, interpret=interpret)

        @plgpu.nd_loop((batch * heads * splits,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            b, h, si = item // (heads * splits), item // splits % heads, item % splits

            def context(run_k_loop):
                if rope:  # the key grid and the frequencies, read where the cache keeps them, on the queries' barrier
                    gb = b if grid_rows else 0
                    plgpu.copy_gmem_to_smem(ks_gmem.at[gb, h], grid_smem.at[wg, 0], q_loaded.at[wg])
                    plgpu.copy_gmem_to_smem(kl_gmem.at[gb, h], grid_smem.at[wg, 1], q_loaded.at[wg])
                    plgpu.copy_gmem_to_smem(freq_gmem, freq_smem.at[wg], q_loaded.at[wg])
                plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem.at[wg], q_loaded.at[wg])
                plgpu.barrier_wait(q_loaded.at[wg])
                start = (matrix(jnp.zeros((ROWS, HEAD_DIM), jnp.float32)), vector(jnp.full((ROWS,), NEG_INF)),
                         vector(jnp.zeros((ROWS,), jnp.float32)), vector(jnp.zeros((ROWS,), jnp.float32)))
                acc, m, total, lo = run_k_loop(start)
                out = (acc + per_row(lo, acc.shape)) / per_row(total, acc.shape)  # total >= 1: its max's term
                lse = m / LOG2E + jnp.log(total)
                part = si * 2 + wg
                for j in range(HEAD_DIM // STAGED):  # the real query rows only leave
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last store has read it
                    out_smem[wg] = out[:, j * STAGED:(j + 1) * STAGED]
                    if j == 0:
                        lse_smem[wg] = lse
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, pl.ds(0, rows)],
                                            o_gmem.at[b, h, part, :, pl.ds(j * STAGED, STAGED)])
                    if j == 0:
                        plgpu.copy_smem_to_gmem(lse_smem.at[wg, pl.ds(0, rows)], lse_gmem.at[b, h, part])

            def step(_, *refs):
                carry, pos = refs[-1], refs[-2] if rope else None
                *k_codes, v_codes, v_scale, v_lo, ok = refs[:-2] if rope else refs[:-1]
                acc, m, total, lo = carry
                # the codes of this warpgroup's tokens as wgmma's bf16 operands: exact (post-RoPE keys, values), or
                # dequantized and rotated (pre-RoPE keys)
                if rope:
                    k_smem[wg, 0], k_smem[wg, 1] = _rotated_keys(
                        k_codes[0].at[mine], k_codes[1].at[mine], grid_smem.at[wg], freq_smem.at[wg], pos[0, mine],
                        qmin, per_channel, per_slot, interpret)
                else:
                    k_smem[wg, 0] = _bf16_codes(k_codes[0].at[mine], interpret)
                v_smem[wg] = _bf16_codes(v_codes.at[mine], interpret)
                plgpu.commit_smem()  # the generic-proxy stores, visible to the tensor cores

                def scores(s_ref):  # q' K^T (a half's dot at a time: pre-RoPE keys), log2-scaled below
                    for j in range(halves):
                        plgpu.wgmma(s_ref, q_smem.at[wg, j], plgpu.transpose_ref(k_smem.at[wg, j], (1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, ROWS), jnp.float32))
                # masked slots' scores to NEG_INF by arithmetic on the 0 / 1 mask (no boolean register layouts)
                allowed = per_token(ok[0, mine].astype(jnp.float32))
                s = s * (LOG2E * allowed) + (allowed - 1.0) * -NEG_INF
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - per_row(m_new, s.shape))
                scale = v_scale[0, mine].astype(jnp.float32)
                offset = v_lo[0, mine].astype(jnp.float32) - qmin * scale
                total = total * alpha + p.sum(axis=1)
                lo = lo * alpha + (p * per_token(offset)).sum(axis=1)
                weights = (p * per_token(scale)).astype(bf16)  # P' = P s_v, rounded as XLA's path rounds it

                def values(o_ref):
                    plgpu.wgmma(o_ref, weights, v_smem.at[wg])

                acc = acc * per_row(alpha, acc.shape)
                if interpret:  # GPU interpret mode runs no run_state: P' V in a fresh accumulator, then added
                    acc = acc + pl.run_scoped(lambda o_ref: values(o_ref) or o_ref[...],
                                              plgpu.ACC((ROWS, HEAD_DIM), jnp.float32))
                else:  # acc alpha + P' V accumulated by wgmma in place: one float32 tile of registers, no adds
                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                return acc, m_new, total, lo

            pipeline(step, context)(*operands(b, h, si), allocations=ring)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kv_attention_hopper(q, k_codes, v_codes, k_scale, k_lo, v_scale, v_lo, length, *, bits: int = 8, allowed=None,
                        sm_scale: float | None = None, layer=None, slot_pos=None, inv_freq=None, sinks=None,
                        out_dtype=jnp.float32, blocks: AttentionBlocks | None = None, interpret: bool | None = None):
    """Single-query attention over one layer of the int8 / int4 store (module docstring: the contract) -> ``(out [B,
    H_q, D] out_dtype, lse [B, H_q] float32)``. Keys stored before RoPE: ``slot_pos`` [B, T] each slot's position
    and ``inv_freq`` [D / 2] the RoPE frequencies (rotate-half); ``sinks`` ``(k, v, seen)``: the cache's float sinks,
    attended to in the merge of the kernel's splits -- as :func:`pallas_kernels.kv_cache.store_decode_attention`
    takes them."""
    interpret = config.resolve_interpret(interpret)
    b_ = blocks or AttentionBlocks()
    with config.interpret(interpret):
        ok, why = can_use(q.shape, q.dtype, k_codes.shape, bits)
    if not ok:
        raise ValueError(f"kv_attention_hopper: {why}")
    bsz, heads, t = k_codes.shape[-4:-1]
    d = q.shape[-1]
    hq = q.shape[1]
    if q.shape[0] != bsz or k_codes.ndim != 4 + int(layer is not None) or v_codes.shape != k_codes.shape:
        raise ValueError(f"kv_attention_hopper: q {q.shape}, codes {k_codes.shape} / {v_codes.shape} "
                         f"(expected [B, H_q, D] and [{'L, ' if layer is not None else ''}B, H_kv, T, D])")
    layers = k_codes.shape[0] if layer is not None else None
    check_key_grid(k_scale, k_lo, bsz, heads, d, layers, "kv_attention_hopper")
    rope = slot_pos is not None
    if rope != (inv_freq is not None) or (rope and (slot_pos.shape != (bsz, t) or inv_freq.shape != (d // 2,))):
        raise ValueError(f"kv_attention_hopper: pre-RoPE keys need slot_pos [{bsz}, {t}] and inv_freq [{d // 2}] "
                         f"together; got {None if slot_pos is None else slot_pos.shape} and "
                         f"{None if inv_freq is None else inv_freq.shape}")
    if length is None and (allowed is None or jnp.dtype(allowed.dtype) != jnp.dtype(jnp.int8)):
        raise ValueError("kv_attention_hopper: without a length, allowed must be the int8 [B, T] mask of the slots "
                         f"to read; got {None if allowed is None else allowed.dtype}")
    sink_keys = None if sinks is None else check_sinks(sinks, (*k_codes.shape[:-2], d), bsz, "kv_attention_hopper")
    if bits == 4:  # the bytes as jnp.int4 codes [..., D], low nibble first (a bitcast: no copy of a stacked store)
        k_codes, v_codes = store_codes(k_codes, 4), store_codes(v_codes, 4)
    if v_scale.shape != (*k_codes.shape[:-1], 1) or v_lo.shape != v_scale.shape:
        raise ValueError(f"kv_attention_hopper: value grids {v_scale.shape} / {v_lo.shape}, expected "
                         f"{(*k_codes.shape[:-1], 1)}")
    g = hq // heads
    rows = 8 if g <= 8 else cdiv(g, 16) * 16  # the query rows each partial result keeps (TMA boxes of whole tiles)
    qmin, _ = int_range(bits)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    steps = t // TOKENS
    splits = b_.splits or splits_for(bsz * heads, steps, hopper.num_sms(interpret))
    if steps % splits:
        raise ValueError(f"kv_attention_hopper: {splits} splits of {steps} steps of {TOKENS} tokens")
    # the per-token rows (value grids, mask, positions) as rows of 128 slots (a reshape: no copy of a stacked store)
    step_rows = lambda a: a.reshape(*a.shape[:-2], steps, TOKENS)  # noqa: E731
    # one byte a slot: as the caller made it (a cache's step, once for every layer), or from length and allowed
    ok = allowed if length is None else slot_mask(length, allowed, bsz, t).astype(jnp.int8)
    ok = step_rows(ok[..., None])
    grid_stacked = k_scale.ndim == 5
    if rope:  # the keys dequantized and rotated in the kernel: plain queries, halves [.., 2, 64, 64] as k's tiles
        queries = q.astype(jnp.float32).reshape(bsz, heads, g, d) * sm
        queries = jnp.moveaxis(queries.reshape(bsz, heads, g, 2, HALF), 3, 2)
        # the positions and the key grid as the cache keeps them (int32, float32), read in place: converting or
        # slicing them here was a launch of XLA's a layer
        extra = [step_rows(slot_pos.astype(jnp.int32)[..., None]), k_scale.astype(jnp.float32),
                 k_lo.astype(jnp.float32), inv_freq.astype(jnp.float32).reshape(1, HALF)]
        row_shift = 0.0
    else:  # keys per channel: q . k = (q s_k) . c + q . (lo_k - qmin s_k); the second shifts a query's scores alike
        one = (lambda a: a[layer]) if grid_stacked else (lambda a: a)  # noqa: E731 -- fused into the fold
        queries, row_shift = fold_key_grid(q, one(k_scale), one(k_lo), heads, bits, sm)
        queries = queries[:, :, None]
        extra = []
    q_codes = jnp.pad(queries.astype(jnp.bfloat16), ((0, 0), (0, 0), (0, 0), (0, ROWS - g), (0, 0)))
    stages = hopper.stages_that_fit(b_.stages, steps // splits, lambda st: _shared_bytes(st, bits, rope))
    args = [q_codes, k_codes, v_codes, step_rows(v_scale), step_rows(v_lo), ok, *extra]
    args += [jnp.reshape(layer, (1,)).astype(jnp.int32)] if layer is not None else []
    body = functools.partial(_kernel, batch=bsz, heads=heads, steps=steps, splits=splits, rows=rows, qmin=qmin,
                             stages=stages, stacked=layer is not None, rope=rope, grid_stacked=grid_stacked,
                             grid_rows=k_scale.shape[-4] > 1, interpret=interpret)
    out_type = (jax.ShapeDtypeStruct((bsz, heads, 2 * splits, rows, d), jnp.float32),
                jax.ShapeDtypeStruct((bsz, heads, 2 * splits, rows), jnp.float32))
    # approximate exp2 / log / reciprocal / cos / sin (ex2.approx: one MUFU a score): the softmax's terms and the
    # rotated keys carry bf16's rounding
    out, lse = hopper.launch(body, out_type, None, interpret, approx_math=True)(*args)
    # the partial results of each head (normalized: each weighs as a sum of 1; a split with no allowed slot weighs
    # ~0), merged by their log-sum-exps in one kernel, with the sinks' share of the softmax where there are sinks
    sink_args = None if sink_keys is None else (q.reshape(bsz, heads, g, d), *sink_keys)
    merged, lse = merge_splits(out, lse, g, shift=None if rope else row_shift, sinks=sink_args, layer=layer,
                               sm_scale=sm, out_dtype=out_dtype, interpret=interpret)
    return merged.reshape(bsz, hq, d), lse.reshape(bsz, hq)
