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

Each warpgroup's work item leaves its normalized output rows and their log-sum-exp (the real query rows only); XLA
merges the ``2 x splits`` partial results of each head (a few small fusions, as the Triton kernel's jnp merge).

sm_90a (deviceless, jaxlib 0.11.2; 32K slots, 8 KV heads x 4 queries): ~1030 instructions a compute thread a 128-token
step at int8 (~460 converting the two tiles, the rest the softmax and two wgmma chains), 168 registers (setmaxnreg
gives the compute warpgroups 232), 202 KB of shared memory at 2 ring slots (int8) or 4 (int4). At an H100's bandwidth
a step's 32 KB of int8 codes take ~2400 cycles an SM and its two warpgroups issue ~2100 a scheduler: near the line,
so the GPU run decides (dispatch takes the kernel only where a table measured it faster).

Contract (:func:`kv_attention_hopper`, :func:`llmeq_jax.kv.store_attention.store_attention`'s, post-RoPE keys):
  q        [B, H_q, D]          bf16 / f16, H_q = G H_kv with G <= 64
  k_codes  [B, H_kv, T, D]      int8; int4: uint8 [B, H_kv, T, D / 2] (a stack [L, ...] with ``layer``)
  v_codes  [B, H_kv, T, D]      as k_codes
  k_scale, k_lo  [B or 1, H_kv, 1, D]   the keys' per-channel grid
  v_scale, v_lo  [B, H_kv, T, 1]        the values' per-token grid (a stack [L, ...] with ``layer``)
  length   [B] or scalar        slots written; ``allowed`` [B, T] bool: the slots a row reads
  -> (out [B, H_q, D] float32, lse [B, H_q] float32)
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
from llmeq_jax.kv.store_attention import codes as store_codes
from pallas_kernels import config, hopper
from pallas_kernels.common import cdiv

TOKENS = 128  # tokens a ring step carries: 64 for each compute warpgroup
ROWS = 64  # wgmma's M: a KV head's query rows, padded
HEAD_DIM = 128
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


def can_use(q_shape, q_dtype, codes_shape, bits: int, pre_rope: bool = False) -> tuple[bool, str]:
    """(True, "") where the kernel takes this step, else (False, why)."""
    if bits not in (4, 8):
        return False, f"int{bits} codes (the kernel reads int8 and int4)"
    if pre_rope:
        return False, "keys stored before RoPE (a dot over the codes cannot rotate them)"
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


def _shared_bytes(stages: int, bits: int) -> int:
    ring = stages * (2 * TOKENS * HEAD_DIM * bits // 8 + TOKENS * (2 + 2 + 1))  # codes, v_scale, v_lo, mask
    per_wg = 3 * ROWS * HEAD_DIM * 2 + ROWS * STAGED * 4 + ROWS * 4  # q', keys, values (bf16); out, lse staging
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


def _kernel(q_gmem, k_gmem, v_gmem, vs_gmem, vl_gmem, ok_gmem, *rest, batch: int, heads: int, steps: int,
            splits: int, rows: int, qmin: int, stages: int, stacked: bool, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rest = list(rest)
    if stacked:  # the layer index, one int32 in global memory: the stacked store is read in place
        layer = rest.pop(0)[0]
        k_gmem, v_gmem, vs_gmem, vl_gmem = (a.at[layer] for a in (k_gmem, v_gmem, vs_gmem, vl_gmem))
    o_gmem, lse_gmem = rest
    per_split = steps // splits
    bf16 = jnp.bfloat16

    def pipeline(body, context):
        codes = plgpu.BlockSpec((TOKENS, HEAD_DIM), lambda s: (s, 0), memory_space=plgpu.SMEM,
                                transforms=hopper.swizzled(HEAD_DIM, k_gmem.dtype))
        row = plgpu.BlockSpec((1, TOKENS), lambda s: (s, 0), memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(per_split,), memory_registers=40, in_specs=[codes, codes, row, row, row], wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=stages, compute_context=context)

    def operands(b, h, si):
        tokens, step_rows = pl.ds(si * per_split * TOKENS, per_split * TOKENS), pl.ds(si * per_split, per_split)
        return (k_gmem.at[b, h, tokens], v_gmem.at[b, h, tokens], vs_gmem.at[b, h, step_rows],
                vl_gmem.at[b, h, step_rows], ok_gmem.at[b, step_rows])

    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies
    tile = lambda dtype: plgpu.SMEM((2, ROWS, HEAD_DIM), dtype, transforms=hopper.swizzled(HEAD_DIM, dtype))  # noqa: E731

    @functools.partial(pl.run_scoped, ring=pipeline(ignore, ignore).get_allocations(*operands(0, 0, 0)),
                       q_smem=tile(bf16), k_smem=tile(bf16), v_smem=tile(bf16),
                       out_smem=plgpu.SMEM((2, ROWS, STAGED), jnp.float32,
                                           transforms=hopper.swizzled(STAGED, jnp.float32)),
                       lse_smem=plgpu.SMEM((2, ROWS), jnp.float32), q_loaded=plgpu.Barrier(num_arrivals=1,
                                                                                          num_barriers=2),
                       collective_axes="wg")
    def _scope(ring, q_smem, k_smem, v_smem, out_smem, lse_smem, q_loaded):
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * ROWS, ROWS)  # this warpgroup's 64 tokens of a step
        per_row = lambda v, shape: lax.broadcast_in_dim(v, shape, (0,))  # noqa: E731 -- a value per query row
        per_token = functools.partial(hopper.broadcast, shape=(ROWS, ROWS), along_rows=True, interpret=interpret)
        vector = lambda value: value if interpret else plgpu.layout_cast(value, plgpu.Layout.WGMMA.reduce(1))  # noqa: E731
        matrix = lambda value: value if interpret else plgpu.layout_cast(value, plgpu.Layout.WGMMA)  # noqa: E731

        @plgpu.nd_loop((batch * heads * splits,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            b, h, si = item // (heads * splits), item // splits % heads, item % splits

            def context(run_k_loop):
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

            def step(_, k_codes, v_codes, v_scale, v_lo, ok, carry):
                acc, m, total, lo = carry
                # the codes of this warpgroup's tokens, exact in bf16, as wgmma's operands
                k_smem[wg] = _bf16_codes(k_codes.at[mine], interpret)
                v_smem[wg] = _bf16_codes(v_codes.at[mine], interpret)
                plgpu.commit_smem()  # the generic-proxy stores, visible to the tensor cores

                def scores(s_ref):  # q' K^T, log2-scaled below
                    plgpu.wgmma(s_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[wg], (1, 0)))
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
                        sm_scale: float | None = None, layer=None, blocks: AttentionBlocks | None = None,
                        interpret: bool | None = None):
    """Single-query attention over one layer of the int8 / int4 store (module docstring: the contract) -> ``(out [B,
    H_q, D] float32, lse [B, H_q])``."""
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
    if bits == 4:  # the bytes as jnp.int4 codes [..., D], low nibble first (a bitcast: no copy of a stacked store)
        k_codes, v_codes = store_codes(k_codes, 4), store_codes(v_codes, 4)
    if v_scale.shape != (*k_codes.shape[:-1], 1) or v_lo.shape != v_scale.shape:
        raise ValueError(f"kv_attention_hopper: value grids {v_scale.shape} / {v_lo.shape}, expected "
                         f"{(*k_codes.shape[:-1], 1)}")
    g = hq // heads
    rows = 8 if g <= 8 else cdiv(g, 16) * 16  # the query rows each partial result keeps (TMA boxes of whole tiles)
    qmin, _ = int_range(bits)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    # keys per channel: q . k = (q s_k) . c + q . (lo_k - qmin s_k); the second term shifts a query's scores alike
    qg = q.astype(jnp.float32).reshape(bsz, heads, g, d) * sm
    k_scale, k_lo = k_scale.astype(jnp.float32), k_lo.astype(jnp.float32)
    row_shift = jnp.einsum("bhgd,bhzd->bhg", qg, k_lo - qmin * k_scale)
    q_codes = jnp.pad((qg * k_scale).astype(jnp.bfloat16), ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))
    # each slot's mask: written (below length) and allowed, one byte a slot, 128 a row
    ok = jnp.arange(t)[None, :] < jnp.broadcast_to(jnp.asarray(length, jnp.int32), (bsz,))[:, None]
    if allowed is not None:
        ok = ok & allowed.astype(bool)
    steps = t // TOKENS
    ok = ok.astype(jnp.int8).reshape(bsz, steps, TOKENS)
    # the per-token value grids as rows of 128 slots (a reshape: no copy of a stacked store)
    grid_rows = lambda a: a.reshape(*a.shape[:-2], steps, TOKENS)  # noqa: E731
    splits = b_.splits or splits_for(bsz * heads, steps, hopper.num_sms(interpret))
    if steps % splits:
        raise ValueError(f"kv_attention_hopper: {splits} splits of {steps} steps of {TOKENS} tokens")
    stages = hopper.stages_that_fit(b_.stages, steps // splits, lambda st: _shared_bytes(st, bits))
    args = [q_codes, k_codes, v_codes, grid_rows(v_scale), grid_rows(v_lo), ok]
    args += [jnp.reshape(layer, (1,)).astype(jnp.int32)] if layer is not None else []
    body = functools.partial(_kernel, batch=bsz, heads=heads, steps=steps, splits=splits, rows=rows, qmin=qmin,
                             stages=stages, stacked=layer is not None, interpret=interpret)
    out_type = (jax.ShapeDtypeStruct((bsz, heads, 2 * splits, rows, d), jnp.float32),
                jax.ShapeDtypeStruct((bsz, heads, 2 * splits, rows), jnp.float32))
    # approximate exp2 / log / reciprocal (ex2.approx: one MUFU a score): the softmax's terms carry bf16's rounding
    out, lse = hopper.launch(body, out_type, None, interpret, approx_math=True)(*args)
    out, lse = out[..., :g, :], lse[..., :g]
    # the partial results of each head merged by their log-sum-exp (a split with no allowed slot weighs ~0)
    top = jnp.max(lse, axis=2, keepdims=True)
    w = jnp.exp(lse - top)
    denom = jnp.sum(w, axis=2)
    merged = jnp.sum(w[..., None] * out, axis=2) / denom[..., None]
    lse = top[:, :, 0] + jnp.log(denom) + row_shift
    return merged.reshape(bsz, hq, d), lse.reshape(bsz, hq)

