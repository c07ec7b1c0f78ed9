"""Benchmark the Pallas kernels against XLA's bf16 dot, as ratios in one run.

On a GPU: warm device time per call of each kernel and of ``x @ w`` in bf16 for decode
(M = 1..16) and prefill (M = 512..4096) shapes on 4096x4096, 4096x11008 and
11008x4096 weights, printed as TFLOP/s, GB/s and speed-up over bf16; plus int8
decode attention vs bf16 at 32K context. Targets (H100): W8A8 >= 1.5x at
M >= 2048, FP8 W8A8 >= 1.6x, int4 weight-only >= 2.5x at M <= 16, KV int8 decode >= 1.6x at 32K.
Where torch with CUDA is importable, FP8 rows also print PyTorch's ``torch._scaled_mm`` (E4M3, row-wise
scales) on the same shapes, timed with CUDA events (M >= 16: its operands need multiples of 16).

On a CPU: says no GPU was found and prints the roofline estimate (bytes moved,
integer/float ops) for the same shapes.

Each timed call reads its own copy of the weights (enough copies to exceed
3x the 50 MB L2 cache), and many calls run in one executable, so neither the
cache nor host dispatch flatters the small decode shapes.

    PYTHONPATH=. python scripts/bench_kernels.py [--reps 20] [--sweep] [--write-table dispatch.json]
        [--kinds bf16,fp8,w8a8] [--weights 4096x11008] [--no-attention]

``--write-table PATH`` also times XLA's path of each quantized product and writes the
measured dispatch table (``llmeq_jax/dispatch_table.py``): with ``LLMEQ_DISPATCH_TABLE=PATH``
a product goes to the kernel only where it was measured faster than XLA on this device.
Every timed kernel's output is checked against a float32 reference of the same operands first (:func:`agrees`): a
kernel that disagrees prints WRONG, and its entry is marked ``"wrong"`` (dispatch then takes XLA's path there).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from llmeq_jax import subchannel

WEIGHTS = ((4096, 4096), (4096, 11008), (11008, 4096))
DECODE_M = (1, 4, 16)
PREFILL_M = (512, 2048, 4096)
GROUP = 128
KV_SHAPE = (1, 8, 4, 32768, 128)  # decode attention: batch, kv heads, q heads per kv head, tokens, head dim
KV_OTHER_CONTEXTS = (4096,)  # shorter caches timed with the defaults only (the dispatch table's other lengths)


def bytes_moved(m, k, n, kind):
    """Minimum HBM traffic: activations in (bf16), weight (+ scales), output (bf16)."""
    act, out = 2 * m * k, 2 * m * n
    weight = {"bf16": 2 * k * n, "bf16_stack": 2 * k * n, "w8a8": k * n + 4 * n, "fp8": k * n + 4 * n, "w8": k * n + 4 * n,
              "w4g128": k * n // 2 + 4 * n * -(-k // GROUP),
              "w4g128_zp": k * n // 2 + 5 * n * -(-k // GROUP)}[LAYOUT_OF.get(kind, kind).removesuffix("_nk")]
    return act + weight + out


def roofline_table():
    print(f"{'weight':>12} {'M':>5} {'kind':>7} {'MB moved':>9} {'GOP':>8} {'bytes/bf16':>10}")
    for k, n in WEIGHTS:
        for m in DECODE_M + PREFILL_M:
            base = bytes_moved(m, k, n, "bf16")
            for kind in ("bf16", "w8a8", "fp8", "w8", "w4g128"):
                b = bytes_moved(m, k, n, kind)
                print(f"{f'{k}x{n}':>12} {m:>5} {kind:>7} {b / 1e6:>9.1f} {2 * m * k * n / 1e9:>8.2f} {b / base:>10.2f}")
    t, h, d = 32768, 8, 128
    kv_bf16, kv_i8 = 2 * 2 * t * h * d, 2 * t * h * d + 4 * t * h
    print(f"decode attention, T={t}, {h} kv heads x {d}: bf16 {kv_bf16 / 1e6:.1f} MB, int8 {kv_i8 / 1e6:.1f} MB "
          f"(ratio {kv_bf16 / kv_i8:.2f}x)")


L2_BYTES = 50 * 2**20  # H100's L2 cache; inputs are rotated through more than 3x this


def copies_for(nbytes: int) -> int:
    """How many distinct copies of an input to rotate through so repeated calls miss the L2 cache."""
    return max(4, min(32, -(-3 * L2_BYTES // max(nbytes, 1))))


def timed(fn, inputs, *, reps, outputs: list | None = None, options: dict | None = None):
    """Device time of ``fn`` per call: ``fn`` applied once to each input set, in one jit.

    ``inputs`` is a list of argument tuples (distinct copies of the operands, so the
    weights stream from HBM as in a real model instead of sitting in L2). All
    calls of one rep are one executable; ``reps`` executables are dispatched
    back to back and waited for once, so host dispatch overlaps the GPU work.
    Returns seconds per call (best of 3 such measurements); ``outputs``: a list the first input set's result is
    appended to (from the warm-up call: no second compile), for :func:`agrees`. ``options``: XLA compiler options
    the jit compiles with.
    """
    first = {} if outputs is not None else None
    t = timed_round_robin({"": (fn, inputs, options)}, reps=reps, outputs=first)[""]
    if outputs is not None:
        outputs.append(first[""])
    return t


ROUNDS = 3  # the measurements of a variant whose best :func:`timed_round_robin` keeps


def timed_round_robin(variants: dict, *, reps, outputs: dict | None = None) -> dict:
    """:func:`timed` of several variants (``{name: (fn, inputs)}``) measured in turns -- each round times
    every variant once -- keeping each one's best round: a clock or cache state that drifts over a few
    seconds then touches all of them alike. (On an H200 one configuration timed 10-15 % apart when measured
    a few seconds apart in a sweep.) ``outputs``: a dict that gets each variant's result of its first input set.
    A variant may carry XLA compiler options third (``(fn, inputs, {"xla_...": value})``), compiled with them."""
    many = {name: (jax.jit(lambda sets, fn=fn: [fn(*a) for a in sets], compiler_options=options), inputs)
            for name, (fn, inputs, *rest) in variants.items() for options in [rest[0] if rest else None]}
    for name, (f, inputs) in many.items():
        warm = jax.block_until_ready(f(inputs))
        if outputs is not None:
            outputs[name] = warm[0]
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(ROUNDS):
        for name, (f, inputs) in many.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(inputs)  # one stream: the last result is ready only after all the others
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / (reps * len(inputs)))
    return best


def _copies(a, n):
    return [a + jnp.zeros((), a.dtype) if i else a for i in range(n)]


# How far a kernel's result may be from the float32 reference of the same operands (relative to the reference's
# norm) before it is called wrong: bf16 / float16 rounding of operands and outputs stays under ~1 %, int8
# activations add ~1 %, E4M3 activations and weights ~3-5 %; a kernel that reads the wrong bytes is off by ~100 %.
TOLERANCE = 0.03
TOLERANCE_INT8_ACTIVATIONS = 0.05
TOLERANCE_FP8 = 0.15


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float32 (NaN where ``out`` holds one)."""
    out, ref = (jnp.asarray(a, jnp.float32).reshape(-1) for a in (out, ref))
    return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def agrees(label: str, out, ref, tol: float = TOLERANCE) -> bool:
    """Whether a kernel's result ``out`` is within ``tol`` of ``ref`` (:func:`relative_error`); prints a WRONG
    line naming ``label`` where not (a NaN is wrong too), which marks its table entry."""
    err = relative_error(out, ref)
    if err <= tol:
        return True
    print(f"  {label}: WRONG: relative error {err:.3g} against the reference (tolerance {tol:g}); its table entry "
          f"chooses XLA's path", flush=True)
    return False


def marked(times: dict, right: bool) -> dict:
    """A table entry's ``times`` with the mark dispatch reads as XLA's path where the kernel's result was wrong."""
    return times if right else times | {"wrong": True}


def tolerance_of(kind: str) -> float:
    """The :func:`agrees` tolerance of a matmul kind, by the operands it rounds."""
    if kind.startswith("fp8"):
        return TOLERANCE_FP8
    return TOLERANCE_INT8_ACTIVATIONS if "a8" in kind else TOLERANCE


def operands_of(kind: str) -> str:
    """Which of a weight's versions a matmul kind multiplies: "bf16", "fp8", "int4" or "int8"."""
    if kind in ("bf16", "bf16_stack"):
        return "bf16"
    if kind.endswith("_zp"):
        return "int4_zp"
    return "fp8" if kind.startswith("fp8") else "int4" if "w4" in kind else "int8"


def table_key(kind: str, k: int, n: int, m: int):
    """The dispatch-table key of one timed product on this device (activations bf16)."""
    from llmeq_jax import dispatch_table

    kernel, bits, group = {"w8a8": ("w8a8", 8, None), "fp8": ("fp8_w8a8", 8, None), "w8": ("weight_only", 8, None),
                           "w4g128": ("weight_only", 4, GROUP), "w4_words": ("int4_words", 4, GROUP),
                           "w4_words_prefill": ("int4_words_prefill", 4, GROUP),
                           "w8a8_hopper": ("w8a8_hopper", 8, None), "fp8_hopper": ("fp8_w8a8_hopper", 8, None),
                           "w8_hopper": ("weight_only_hopper", 8, None),
                           "w4_hopper": ("weight_only_hopper", 4, GROUP),
                           "w4_decode_hopper": ("decode_hopper", 4, GROUP),
                           "w8_decode_hopper": ("decode_hopper", 8, None),
                           "w8a8_decode_hopper": ("w8a8_decode_hopper", 8, None),
                           "fp8_decode_hopper": ("fp8_w8a8_decode_hopper", 8, None),
                           "bf16_stack": ("float", 16, None), "w8_nk_f16": ("int8_f16", 8, None),
                           "w4_xla_subchannel_packed": ("xla_subchannel", 4, GROUP),
                           "w4_xla_subchannel_zp": ("xla_subchannel_zp", 4, GROUP)}[kind]
    return dispatch_table.Key(jax.devices()[0].device_kind, kernel, bits, group, k, n, dispatch_table.row_bucket(m),
                              "bfloat16")


def write_table(path, measured):
    """Write the measured (key, times) pairs as a dispatch table (llmeq_jax/dispatch_table.py)."""
    from llmeq_jax import dispatch_table

    device = jax.devices()[0]
    data = dispatch_table.to_json(device.device_kind, measured, jax=jax.__version__,
                                  **dispatch_table.architecture_meta(device))
    Path(path).write_text(json.dumps(data, indent=1))
    slower = [e for e in data["entries"] if min(e["pallas_s"], e["xla_s"]) > e["bf16_s"]]
    print(f"dispatch table: {len(data['entries'])} products -> {path}; both quantized paths slower than bf16 in "
          f"{len(slower)}: " + ", ".join(f"{e['kernel']}/{e['bits']} {e['k']}x{e['n']} M={e['rows']}" for e in slower))


KINDS = ("bf16", "w8a8", "fp8", "w8", "w4g128", "w8a8_nk", "fp8_nk", "w8_nk", "w4_words", "bf16_stack", "w4_xla_rows",
         "w8_nk_f16", "w4_gemv", "w4_xla_words", "w4_xla_groups", "w4_words_prefill", "w8a8_hopper", "w8_hopper",
         "w4_hopper", "w4_decode_hopper", "w8_decode_hopper", "fp8_hopper", "w8a8_decode_hopper", "fp8_decode_hopper",
         "w4_xla_subchannel", "w4_xla_subchannel_packed", "w4_xla_subchannel_zp")
# The int8 kinds with their weights stored K-major, (N, K): the layout decode steps of up to
# decode_layout.GPU_KMAJOR_MAX_ROWS rows read (for_decode); not in the table. W8A8 is timed at prefill rows
# too: there the kinds w8a8/fp8 transpose the weight per call (int8 wgmma takes K-major operands only), and
# the K-major rows say what storing it so would buy (issue #15's W8A8 target is at M >= 1024).
KMAJOR_KINDS = ("w8a8_nk", "fp8_nk", "w8_nk")
# int4 g128 as words (pallas_kernels.int4_words), the layout for_decode gives int4 kernels on a GPU: decode
# rows only; in the table as kernel "int4_words" against XLA's path of the packed QArray it replaces.
# bf16_stack: the bf16 weights as one stack [copies, K, N], each call a layer of it (traced index) -- what a
# decode step of the scan over stacked blocks multiplies: pallas_kernels.float_matmul reading the layer in
# place against XLA's dynamic slice and dot (in the table as kernel "float"); decode rows only.
# w4_xla_rows: int4 g128 weights K-major as XLA's own int4 type (jnp.int4, two per byte), (N, K), multiplied and
# summed over K in one expression (:func:`xla_int4_rows`) -- a candidate for XLA's path at decode rows, compiled
# (deviceless, for an H200) to one row-reduction kernel that reads the int4 rows, no dequantized copy; where
# XLA's path today (ops.weight_only_xla) took 0.05-0.25x bf16 on the H200. Not in the table.
# w8_nk_f16: the K-major int8 weights with float16 tensor-core operands (weight_only_matmul(dequant="f16"),
# pallas_kernels/int8_f16.py: 2.2 instructions per weight in sm_90 SASS against w8_nk's 4.5), x scaled into
# float16 by an XLA op per call (fused into x's producer in a model; a launch of its own here). In the table
# as kernel "int8_f16" against w8_nk, the kernel it replaces in a decode step (timed in the same row).
# w4_gemv: the int4 GEMV (weight_only_matmul(gemv=True), pallas_kernels/gemv.py: no tensor cores, no shared
# memory, many small programs; 4.5 instructions per weight in SASS against the word kernel's 2.1-2.5) at M <= 4:
# whether the word kernel is bound by its instructions or by the latency its few warps a scheduler leave unhidden.
# w4_xla_words: the word kernel's own words (the layout a decode step holds) through XLA ops, unpacked by shifts
# and masks inside one multiply-and-sum (int4_words.int4_words_xla); deviceless for an H200 at M = 1: one column
# reduction over the words (172 blocks of 1024 threads) beside two tiny conversions, no dequantized copy -- but at
# 4096 x 4096 XLA writes the dequantized product (67 MB) before a two-stage sum, and inside the scan it copied
# gate/up's words out of the stack: a measurement of what XLA's reduction can stream, not a dispatch path yet.
# Not in the table.
# w4_xla_groups: int4 g128 weights (K, N) as jnp.int4, a batched dot per scale group then the scales
# (:func:`xla_int4_groups`): at M = 16 one XLA GEMM fusion over the int4 weights (deviceless, H200). Not in the table.
# w4_xla_subchannel: the same jnp.int4 weights through XLA's GEMM with the dequantization fused in
# (:func:`xla_int4_subchannel`, compiled with :data:`SUBCHANNEL_FUSION`): a candidate for a symmetric int4 prompt's
# XLA path, where today XLA writes the dequantized weight before its GEMM (0.88-0.96x bf16 at 2048-4096 rows,
# H200, 2026-12-04; #15 wants 0.95x); and at decode rows, codes stored as jnp.int4, a candidate beside the word
# kernel (deviceless H100, 4096 x 11008: M = 1 one Triton GEMM fusion over the int4 codes, 688 programs; M = 16 a
# 4-way split-K GEMM fusion and its sum). Not in the table (XLA's path of w4g128 is the one beside it).
# w4_xla_subchannel_packed: the same from w4g128's packed bytes, unpacked to jnp.int4 per call first: the prompt path a
# model takes (llmeq_jax.subchannel.matmul of the QArray), in the table as kernel "xla_subchannel" against XLA's path
# of w4g128.
# w4_xla_subchannel_zp: that path over asymmetric int4 g128 weights (rtn-w4-g128's: integer zero points, two more
# rows a group in the GEMM, x's group sums beside x), in the table as kernel "xla_subchannel_zp" against XLA's path of
# that QArray (kind w4g128_zp's weights; not a kind of its own).
# w4_words_prefill: the same words at prompt rows (pallas_kernels.int4_words_prefill: the transposed product, the
# dequantized weights as wgmma's A operand from registers, one dot a word block); prompt rows only, in the table as
# kernel "int4_words_prefill" against XLA's path of the packed QArray (the path prompts take today).
# w8a8_hopper: the K-major int8 weights of w8a8_nk through the Mosaic GPU kernel (pallas_kernels/w8a8_hopper.py:
# int8 wgmma kept in flight, which Triton never does with int32 accumulators); prompt rows only, in the table as
# kernel "w8a8_hopper" against w8a8_nk (the Triton kernel a prompt's W8A8 product takes today), timed in the same row.
# w8a8_decode_hopper / fp8_decode_hopper: the K-major int8 / E4M3 weights of w8a8_nk / fp8_nk through the Mosaic GPU
# decode kernel in its W8A8 mode (x's codes against the weights' straight from shared memory, no dequantization);
# decode rows only, in the table as kernels "w8a8_decode_hopper" / "fp8_w8a8_decode_hopper" against the faster of
# the K-major Triton W8A8 kernel (timed in the same row) and XLA's path.
# fp8_hopper: the K-major E4M3 weights of fp8_nk through the same Mosaic GPU kernel with FP8 wgmma (fp8=True: each
# 128-value K step's sums promoted into float32, 64 x 128 tiles a warpgroup); prompt rows only, in the table as kernel
# "fp8_w8a8_hopper" against fp8_nk (the Triton kernel it replaces), timed in the same row; torch's _scaled_mm beside.
# w8_hopper: the int8 weight-only codes of w8, as stored (K, N), through the Mosaic GPU kernel
# (pallas_kernels/weight_only_hopper.py: each tile dequantized into shared memory, then bf16 wgmma); prompt rows only,
# in the table as kernel "weight_only_hopper" against XLA's path (what a prompt's rtn-w8 product takes today).
# w4_hopper: the same kernel over w4g128's packed int4 pairs, against XLA's path of that QArray.
# w4_decode_hopper: w4g128's codes as (N, K) int4 rows (decode_layout.Int4RowKernel) through the Mosaic GPU decode
# kernel (pallas_kernels/decode_hopper.py: one program per SM streaming the weights by TMA, dequantized in
# registers as wgmma's A operand); decode rows only, in the table as kernel "decode_hopper" against the path it
# replaces in a decode step, the faster of the word kernel (w4_words, timed in the same row) and XLA's path.
# w8_decode_hopper: the same kernel over w8_nk's K-major int8 codes (rtn-w8's decode layout), against the faster of
# the K-major Triton kernels timed in the same row (w8_nk, w8_nk_f16) and XLA's path.
PREFILL_ONLY_KINDS = ("w4_words_prefill", "w8a8_hopper", "fp8_hopper", "w8_hopper", "w4_hopper",
                      "w4_xla_subchannel_packed", "w4_xla_subchannel_zp")
DECODE_ONLY_KINDS = ("w8_nk", "w4_words", "bf16_stack", "w4_xla_rows", "w8_nk_f16", "w4_gemv", "w4_xla_words",
                     "w4_xla_groups", "w4_decode_hopper", "w8_decode_hopper", "w8a8_decode_hopper", "fp8_decode_hopper")
GEMV_ONLY_ROWS = ("w4_gemv",)  # kinds timed only at rows the GEMV takes (gemv.GEMV_MAX_ROWS)
NOT_IN_TABLE = ("w4_xla_rows", "w4_gemv", "w4_xla_words", "w4_xla_groups", "w4_xla_subchannel",
                "w4_decode_hopper", "w8_decode_hopper", "w8a8_decode_hopper",
                "fp8_decode_hopper")  # their own entries, against what they replace (REPLACES)
# the kind whose weights (bytes moved, XLA's path) a layout kind has
LAYOUT_OF = {"w4_words": "w4g128", "w4_words_prefill": "w4g128", "w4_xla_rows": "w4g128", "w8_nk_f16": "w8_nk",
             "w4_gemv": "w4g128", "w4_xla_words": "w4g128", "w4_xla_groups": "w4g128", "w4_xla_subchannel": "w4g128",
             "w4_xla_subchannel_packed": "w4g128", "w4_xla_subchannel_zp": "w4g128_zp", "w8a8_hopper": "w8a8_nk",
             "fp8_hopper": "fp8_nk", "w8a8_decode_hopper": "w8a8", "fp8_decode_hopper": "fp8",
             "w8_hopper": "w8", "w4_hopper": "w4g128", "w4_decode_hopper": "w4g128", "w8_decode_hopper": "w8"}
# the Mosaic decode kinds: the kinds (timed in the same row) whose kernels they would replace in a decode step
REPLACES = {"w4_decode_hopper": ("w4_words",), "w8_decode_hopper": ("w8_nk", "w8_nk_f16"),
            "w8a8_decode_hopper": ("w8a8_nk",), "fp8_decode_hopper": ("fp8_nk",)}
# the Mosaic prompt kinds: the K-major Triton kind (timed in the same row) each replaces, their table entries' "xla_s"
HOPPER_REPLACES = {"w8a8_hopper": "w8a8_nk", "fp8_hopper": "fp8_nk"}


def xla_int4_rows(x, q, scale):
    """``x @ dequantize(w)`` for int4 weights stored K-major as ``jnp.int4`` ``(N, K)`` with group scales
    ``(N, K / GROUP)``: one multiply and sum over K, which XLA fuses into a single row reduction (the int4
    rows read once per output row, the scale multiplied per element)."""
    n, k = q.shape
    w = q.astype(jnp.float32).reshape(n, k // GROUP, GROUP) * scale.astype(jnp.float32)[:, :, None]
    return jnp.sum(x.astype(jnp.float32)[:, None, :] * w.reshape(n, k)[None], axis=-1).astype(x.dtype)


def xla_int4_groups(x, q, scale):
    """``x @ dequantize(w)`` for int4 weights ``(K, N)`` as ``jnp.int4`` with group scales ``(K / GROUP, N)``: one
    dot per scale group (a batched dot with the int4 operand converted in it), then the scales and the sum over the
    groups -- at M = 16 XLA compiles it (deviceless, H200) to one GEMM fusion reading the int4 weights and one
    small reduction; at M = 1 it writes a transposed copy first (timed there only for the record)."""
    (m, k), n = x.shape, q.shape[1]
    groups = k // GROUP
    part = jnp.einsum("mgk,gkn->gmn", x.reshape(m, groups, GROUP), q.reshape(groups, GROUP, n).astype(x.dtype),
                      preferred_element_type=jnp.float32)
    return jnp.sum(part * scale.astype(jnp.float32)[:, None, :], axis=0).astype(x.dtype)


# XLA's GPU compiler fuses a group-wise int4 dequantization into its Triton GEMM only when asked (the flag is
# experimental in jax 0.11), and only in one form: jnp.int4 codes (K, N) converted to x's dtype and times the
# group scales broadcast (also converted to x's dtype). Deviceless H100 compiles (2026-12-07): one GEMM fusion
# reading the int4 codes and scales, a stacked layer's dynamic slice fused in too; a zero point (subtracted, or
# added as an offset), float32 arithmetic, or codes unpacked from our nibble pairs along K inside the GEMM's operand
# each leave a dequantized copy in front of the GEMM; codes bitcast from nibble pairs along N abort the compile (a
# failed check in XLA's triton_tiling_propagation.cc, jax 0.11.2). llmeq_jax.subchannel writes a model's product in the
# form that fuses (the codes unpacked behind a barrier, zero points as rows of the GEMM).
SUBCHANNEL_FUSION = {subchannel.FLAG: True}


def xla_int4_subchannel(x, q, scale):
    """``x @ dequantize(w)`` for symmetric int4 weights ``(K, N)`` as ``jnp.int4`` with group scales
    ``(K / GROUP, N)``, in the one form XLA fuses into its GEMM under :data:`SUBCHANNEL_FUSION` (the scales rounded
    to x's dtype first, the dequantized weight to x's dtype as XLA's path does)."""
    (k, n), groups = q.shape, q.shape[0] // GROUP
    w = q.astype(x.dtype).reshape(groups, GROUP, n) * scale.astype(x.dtype)[:, None, :]
    return x @ w.reshape(k, n)


def usual_xla(fn):
    """``fn`` traced with the kernels off (``pallas_kernels.config.disabled``), which turns off the sub-channel path
    too (``llmeq_jax.subchannel.allowed``): XLA's usual path of a product, what the paths in the table replace."""
    from pallas_kernels import config

    def run(*args):
        with config.disabled():
            return fn(*args)

    return run


def torch_scaled_mm():
    """``f(x_bf16, w_bf16) -> timer`` for PyTorch's FP8 GEMM (``torch._scaled_mm``, E4M3, per-row and
    per-column scales), or None without torch on CUDA. The timer returns seconds per call (CUDA events)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return None

    def prepare(m, k, n):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        sx = x.abs().amax(dim=1, keepdim=True).float() / 448.0
        sw = w.abs().amax(dim=1, keepdim=True).float() / 448.0
        xq = (x / sx).to(torch.float8_e4m3fn)
        wq = (w / sw).to(torch.float8_e4m3fn)

        def run():  # (M, K) row-major x (K, N) column-major, as _scaled_mm wants
            return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)

        def bf16():
            return x @ w.t()

        return run, bf16

    def timer(fn, reps):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    return prepare, timer


def gpu_bench(reps, sweep=False, table=None, table_path=None, kinds_wanted=KINDS, weights=WEIGHTS, attention=True,
              rows=DECODE_M + PREFILL_M):
    """Print the kernel timings; with a list ``table``, also time XLA's path and append (key, times) to it
    (and write the table to ``table_path`` after each weight shape)."""
    from llmeq_jax import ops
    from llmeq_jax.core.quantize import Spec, quantize
    from llmeq_jax.layer_slice import take_layer
    from pallas_kernels.float_matmul import float_matmul
    from pallas_kernels.gemv import GEMV_MAX_ROWS
    from pallas_kernels.decode_hopper import decode_hopper, transpose_codes, w8a8_decode_hopper
    from pallas_kernels.int4_words import int4_words_matmul, int4_words_xla, pack_words
    from pallas_kernels.int4_words_prefill import int4_words_prefill
    from pallas_kernels.w8a8 import w8a8_matmul
    from pallas_kernels.w8a8_hopper import w8a8_hopper
    from pallas_kernels.weight_only import weight_only_matmul
    from pallas_kernels.weight_only_hopper import weight_only_hopper

    SWEEP = _sweep()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'weight':>12} {'M':>5} {'kind':>7} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'vs bf16':>8}")
    torch_fp8 = torch_scaled_mm() if {"fp8", "fp8_hopper"} & set(kinds_wanted) else None
    for k, n in weights:
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
        q8 = quantize(w, Spec(bits=8, granularity="channel"))
        qf = quantize(w, Spec(bits=8, granularity="channel", grid="fp8"))
        q4 = quantize(w, Spec(bits=4, granularity="group", group_size=GROUP))
        q4z = (quantize(w, Spec(bits=4, granularity="group", group_size=GROUP, symmetric=False))
               if "w4_xla_subchannel_zp" in kinds_wanted else None)
        r = copies_for(q4.qvalue.nbytes)
        wb, w8, s8, wf, sf, w4, s4 = (_copies(a, r) for a in (w.astype(jnp.bfloat16), q8.qvalue, q8.scale, qf.qvalue,
                                                              qf.scale, q4.qvalue, q4.scale))
        nk_kinds = {"w8a8_nk", "w8_nk", "w8_nk_f16", "w8a8_hopper", "w8_decode_hopper", "w8a8_decode_hopper"}
        w8t = _copies(q8.qvalue.T, r) if nk_kinds & set(kinds_wanted) else []
        wft = _copies(qf.qvalue.T, r) if {"fp8_nk", "fp8_hopper", "fp8_decode_hopper"} & set(kinds_wanted) else []
        word_kinds = {"w4_words", "w4_xla_words", "w4_words_prefill"}
        w4w = _copies(pack_words(q4.values(), GROUP), r) if word_kinds & set(kinds_wanted) else []
        w4r = [c.T.astype(jnp.int4) for c in _copies(q4.values(), r)] if "w4_xla_rows" in kinds_wanted else []
        w4t = [transpose_codes(c) for c in _copies(q4.values(), r)] if "w4_decode_hopper" in kinds_wanted else []
        s4t = [s.T for s in s4] if w4r else []
        w4k = ([c.astype(jnp.int4) for c in _copies(q4.values(), r)]
               if {"w4_xla_groups", "w4_xla_subchannel"} & set(kinds_wanted) else [])
        w4z = (list(zip(*(_copies(a, r) for a in (q4z.qvalue, q4z.scale, q4z.zero_point))))
               if q4z is not None else [])
        wbs = jnp.stack(wb) if "bf16_stack" in kinds_wanted else None  # r layers of bf16 weights
        layers = [jnp.int32(i) for i in range(r)] if wbs is not None else []
        del w
        # each version of the weight in float32, for the reference products the kernels are checked against
        versions = {"bf16": wb[0], "int8": q8, "fp8": qf, "int4": q4, "int4_zp": q4z}
        kinds = {
            "bf16": (lambda x, w: x @ w, list(zip(wb))),
            "w8a8": (lambda x, w, s: w8a8_matmul(x, w, s), list(zip(w8, s8))),
            "fp8": (lambda x, w, s: w8a8_matmul(x, w, s, fp8=True), list(zip(wf, sf))),
            "w8": (lambda x, w, s: weight_only_matmul(x, w, s, bits=8), list(zip(w8, s8))),
            "w4g128": (lambda x, w, s: weight_only_matmul(x, w, s, bits=4, group=GROUP), list(zip(w4, s4))),
            "w8a8_nk": (lambda x, w, s: w8a8_matmul(x, w, s, w_layout="nk"), list(zip(w8t, s8))),
            "fp8_nk": (lambda x, w, s: w8a8_matmul(x, w, s, fp8=True, w_layout="nk"), list(zip(wft, sf))),
            "w8_nk": (lambda x, w, s: weight_only_matmul(x, w, s, bits=8, w_layout="nk"), list(zip(w8t, s8))),
            "w4_words": (lambda x, w, s: int4_words_matmul(x, w, s, group=GROUP), list(zip(w4w, s4))),
            "bf16_stack": (lambda x, w, i: float_matmul(x, w, layer=i), [(wbs, i) for i in layers]),
            "w4_xla_rows": (xla_int4_rows, list(zip(w4r, s4t))),
            "w4_xla_groups": (xla_int4_groups, list(zip(w4k, s4))),
            "w4_xla_subchannel": (xla_int4_subchannel, list(zip(w4k, s4)), SUBCHANNEL_FUSION),
            "w4_xla_subchannel_packed": (lambda x, w, s: subchannel.matmul(x, dataclasses.replace(q4, qvalue=w, scale=s)),
                                         list(zip(w4, s4)), SUBCHANNEL_FUSION),
            "w4_xla_subchannel_zp": (lambda x, w, s, z: subchannel.matmul(x, dataclasses.replace(q4z, qvalue=w, scale=s,
                                                                                                  zero_point=z)),
                                     w4z, SUBCHANNEL_FUSION),
            "w4g128_zp": (None, w4z),  # not timed: XLA's path of the zero-point weights (xla_of) takes them
            "w8_nk_f16": (lambda x, w, s: weight_only_matmul(x, w, s, bits=8, w_layout="nk", dequant="f16"),
                          list(zip(w8t, s8))),
            "w4_gemv": (lambda x, w, s: weight_only_matmul(x, w, s, bits=4, group=GROUP, gemv=True), list(zip(w4, s4))),
            "w4_xla_words": (lambda x, w, s: int4_words_xla(x, w, s, group=GROUP), list(zip(w4w, s4))),
            "w4_words_prefill": (lambda x, w, s: int4_words_prefill(x, w, s, group=GROUP), list(zip(w4w, s4))),
            "w8a8_hopper": (lambda x, w, s: w8a8_hopper(x, w, s), list(zip(w8t, s8))),
            "fp8_hopper": (lambda x, w, s: w8a8_hopper(x, w, s, fp8=True), list(zip(wft, sf))),
            "w8_hopper": (lambda x, w, s: weight_only_hopper(x, w, s), list(zip(w8, s8))),
            "w4_hopper": (lambda x, w, s: weight_only_hopper(x, w, s, group=GROUP, bits=4), list(zip(w4, s4))),
            "w4_decode_hopper": (lambda x, w, s: decode_hopper(x, w, s, group=GROUP), list(zip(w4t, s4))),
            "w8_decode_hopper": (lambda x, w, s: decode_hopper(x, w, s), list(zip(w8t, s8))),
            "w8a8_decode_hopper": (lambda x, w, s: w8a8_decode_hopper(x, w, s), list(zip(w8t, s8))),
            "fp8_decode_hopper": (lambda x, w, s: w8a8_decode_hopper(x, w, s, fp8=True), list(zip(wft, sf))),
        }
        kinds_all = kinds
        kinds = {kind: v for kind, v in kinds.items() if kind in kinds_wanted or kind == "bf16"}
        # XLA's path for the same QArrays (what ops.linear runs without a kernel -- nor the sub-channel fusion, one of
        # the paths measured against it: usual_xla), for the dispatch table
        qa8 = dataclasses.replace(q8, act_spec=Spec(bits=8, granularity="token"))
        qaf = dataclasses.replace(qf, act_spec=Spec(bits=8, granularity="token", grid="fp8"))
        xla_of = {
            "w8a8": lambda x, w, s: ops.linear(x, dataclasses.replace(qa8, qvalue=w, scale=s), backend="xla"),
            "fp8": lambda x, w, s: ops.linear(x, dataclasses.replace(qaf, qvalue=w, scale=s), backend="xla"),
            "w8": lambda x, w, s: ops.linear(x, dataclasses.replace(q8, qvalue=w, scale=s), backend="xla"),
            "w4g128": lambda x, w, s: ops.linear(x, dataclasses.replace(q4, qvalue=w, scale=s), backend="xla"),
            "w4g128_zp": lambda x, w, s, z: ops.linear(x, dataclasses.replace(q4z, qvalue=w, scale=s, zero_point=z),
                                                       backend="xla"),
            "bf16_stack": lambda x, w, i: x @ take_layer(w, i),
        }
        xla_of = {kind: usual_xla(fn) for kind, fn in xla_of.items()}
        for m in rows:
            xs = _copies(jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16), r)
            base = None
            row_times = {}  # the kinds timed in this row whose results were right
            refs = {}  # x @ each float32 weight version, made as a kind first needs it
            for kind, (fn, ws, *options) in kinds.items():
                if (kind in DECODE_ONLY_KINDS and m > DECODE_M[-1] or kind in GEMV_ONLY_ROWS and m > GEMV_MAX_ROWS
                        or kind in PREFILL_ONLY_KINDS and m <= DECODE_M[-1]):
                    continue
                got = []
                try:
                    t = timed(fn, [(x, *wargs) for x, wargs in zip(xs, ws)], reps=reps, outputs=got,
                              options=options[0] if options else None)
                except Exception as e:  # one kind failing to compile or run costs its row, not the step's others
                    if kind == "bf16":
                        raise
                    print(f"{f'{k}x{n}':>12} {m:>5} {kind:>7} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                op = operands_of(kind)
                if op not in refs:
                    weight = versions[op]
                    weight = weight.astype(jnp.float32) if op == "bf16" else weight.dequantize(jnp.float32)
                    refs[op] = jnp.dot(xs[0].astype(jnp.float32), weight, precision=jax.lax.Precision.HIGHEST)
                right = agrees(f"{k}x{n} M={m} {kind}", got.pop(), refs[op], tolerance_of(kind))
                base = base or t
                if right:
                    row_times[kind] = t
                line = (f"{f'{k}x{n}':>12} {m:>5} {kind:>7} {t * 1e3:>8.4f} {2 * m * k * n / t / 1e12:>8.1f} "
                        f"{bytes_moved(m, k, n, kind) / t / 1e9:>7.0f} {base / t:>7.2f}x")
                origin = LAYOUT_OF.get(kind, kind)
                if table is not None and origin in xla_of and kind not in NOT_IN_TABLE:
                    xla_inputs = [(x, *wargs) for x, wargs in zip(xs, kinds_all[origin][1])]
                    t_xla = timed(xla_of[origin], xla_inputs, reps=reps)
                    times = marked({"pallas_s": t, "xla_s": t_xla, "bf16_s": base}, right)
                    table.append((table_key(kind, k, n, m), times))
                    line += f"  (XLA {t_xla * 1e3:.4f} ms, {base / t_xla:.2f}x)"
                if table is not None and kind == "w8_nk_f16" and "w8_nk" in row_times:  # against the kernel it replaces
                    table.append((table_key(kind, k, n, m),
                                  marked({"pallas_s": t, "xla_s": row_times["w8_nk"], "bf16_s": base}, right)))
                    line += f"  ({row_times['w8_nk'] / t:.2f}x w8_nk)"
                replaced = HOPPER_REPLACES.get(kind)
                if table is not None and replaced in row_times:  # against the Triton kernel it replaces
                    times = marked({"pallas_s": t, "xla_s": row_times[replaced], "bf16_s": base}, right)
                    table.append((table_key(kind, k, n, m), times))
                    line += f"  ({row_times[replaced] / t:.2f}x {replaced})"
                if table is not None and kind in REPLACES:  # against the path it replaces
                    origin = LAYOUT_OF[kind]
                    t_xla = timed(xla_of[origin], [(x, *wargs) for x, wargs in zip(xs, kinds_all[origin][1])],
                                  reps=reps)
                    others = [o for o in REPLACES[kind] if o in row_times]
                    replaced = min([t_xla] + [row_times[o] for o in others])
                    times = marked({"pallas_s": t, "xla_s": replaced, "bf16_s": base}, right)
                    table.append((table_key(kind, k, n, m), times))
                    line += f"  (XLA {t_xla * 1e3:.4f} ms" + "".join(f", {row_times[o] / t:.2f}x {o}"
                                                                     for o in others) + ")"
                if kind == "w4_xla_words" and "w4_words" in row_times:
                    line += f"  ({row_times['w4_words'] / t:.2f}x w4_words)"
                if kind in ("fp8", "fp8_hopper") and torch_fp8 is not None and m >= 16:
                    prepare, timer = torch_fp8
                    t_mm, t_bf = (timer(f, reps * 10) for f in prepare(m, k, n))
                    line += f"  (torch _scaled_mm {t_mm * 1e3:.4f} ms = {t_bf / t_mm:.2f}x torch bf16)"
                print(line, flush=True)
            if sweep and m == 1:  # batch-1 decode, issue #15's row: each kernel's settings in turns with bf16
                if "w4_words" in kinds:
                    sweep_in_turns("w4_words", kinds, xs, _words_sweep(k, n), reps,
                                   lambda cfg: lambda x, w, s: int4_words_matmul(x, w, s, group=GROUP, **cfg))
                for kind, group in (("w4_decode_hopper", GROUP), ("w8_decode_hopper", None)):
                    if kind in kinds:
                        sweep_in_turns(kind, kinds, xs, _decode_hopper_sweep(k), reps,
                                       lambda cfg, group=group: lambda x, w, s: decode_hopper(x, w, s, group=group,
                                                                                              **cfg))
                for kind, fp8 in (("w8a8_decode_hopper", False), ("fp8_decode_hopper", True)):
                    if kind in kinds:
                        sweep_in_turns(kind, kinds, xs, _decode_hopper_sweep(k), reps,
                                       lambda cfg, fp8=fp8: lambda x, w, s: w8a8_decode_hopper(x, w, s, fp8=fp8,
                                                                                               **cfg))
                if "w8_nk_f16" in kinds:
                    sweep_in_turns("w8_nk_f16", kinds, xs, _int8_f16_sweep(), reps,
                                   lambda cfg: lambda x, w, s: weight_only_matmul(x, w, s, bits=8, w_layout="nk",
                                                                                  dequant="f16", **cfg))
            if sweep and (k, n) == SWEEP_WEIGHT and m in PREFILL_WORDS_SWEEP_ROWS and "w4_words_prefill" in kinds:
                sweep_in_turns("w4_words_prefill", kinds, xs, _prefill_words_sweep(), reps,
                               lambda cfg: lambda x, w, s: int4_words_prefill(x, w, s, group=GROUP, **cfg))
            for kind, fp8 in (("w8a8_hopper", False), ("fp8_hopper", True)):
                if sweep and (k, n) == SWEEP_WEIGHT and m in PREFILL_WORDS_SWEEP_ROWS and kind in kinds:
                    sweep_in_turns(kind, kinds, xs, _hopper_sweep(fp8), reps,
                                   lambda cfg, fp8=fp8: lambda x, w, s: w8a8_hopper(x, w, s, fp8=fp8, **cfg))
            for kind, extra in (("w8_hopper", {}), ("w4_hopper", dict(group=GROUP, bits=4))):
                if sweep and (k, n) == SWEEP_WEIGHT and m in PREFILL_WORDS_SWEEP_ROWS and kind in kinds:
                    sweep_in_turns(kind, kinds, xs, _weight_only_hopper_sweep(extra.get("bits", 8)), reps,
                                   lambda cfg, extra=extra: lambda x, w, s: weight_only_hopper(x, w, s, **extra, **cfg))
            # prefill W8A8: the K-major kernel where it is timed (1.04-1.10x bf16 at M = 512-2048 on an H200 with the
            # (K, N) layout's H100-tuned blocks; issue #15 wants 1.5x), else the per-call transposing one
            kind = ("w8a8_nk" if "w8a8_nk" in kinds else "w8a8") if m >= 1024 else "w4g128"
            if sweep and (k, n) == SWEEP_WEIGHT and m in SWEEP and kind in kinds:
                for cfg in SWEEP[m]:
                    if kind == "w8a8_nk" and "transpose_w" in cfg:
                        continue  # stored K-major: nothing to transpose
                    if kind == "w4g128":
                        fn = lambda x, w, s, cfg=cfg: weight_only_matmul(x, w, s, bits=4, group=GROUP, **cfg)  # noqa: E731
                    else:
                        layout = "nk" if kind == "w8a8_nk" else "kn"
                        fn = lambda x, w, s, cfg=cfg, lay=layout: w8a8_matmul(x, w, s, w_layout=lay, **cfg)  # noqa: E731
                    try:
                        got = []
                        t = timed(fn, [(x, *wargs) for x, wargs in zip(xs, kinds[kind][1])], reps=reps, outputs=got)
                        print(f"   sweep {kind} M={m} {cfg}: {t * 1e3:.4f} ms, {base / t:.2f}x bf16", flush=True)
                        if operands_of(kind) in refs:  # the kind's own row made it
                            agrees(f"sweep {kind} M={m} {cfg}", got[0], refs[operands_of(kind)], tolerance_of(kind))
                    except Exception as e:  # a config Triton rejects (e.g. too much shared memory)
                        print(f"   sweep {kind} M={m} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
            del xs, refs
        del wb, versions, w8, s8, wf, sf, w4, s4, w8t, wft, w4w, w4r, w4t, s4t, wbs, layers, kinds, kinds_all
        if table is not None and table_path:  # after every weight shape: a run cut short keeps what it measured
            write_table(table_path, table)
    if attention:
        attention_bench(reps, sweep, table, table_path)


def sweep_in_turns(kind: str, kinds: dict, xs: list, configs: list, reps: int, fn_of) -> None:
    """Time ``kind``'s kernel under each of ``configs`` (``fn_of(cfg)``: the call with those settings) in turns with
    the bf16 dot and the kernel's defaults (:func:`timed_round_robin`) on ``kind``'s weights, and print each (WRONG
    where a setting's result strays from the defaults', which the row checked)."""
    def inputs(of):
        return [(x, *wargs) for x, wargs in zip(xs, kinds[of][1])]

    m = xs[0].shape[0]
    variants = {"bf16": (kinds["bf16"][0], inputs("bf16")), "defaults": (kinds[kind][0], inputs(kind))}
    for cfg in configs:
        try:  # a setting Triton or the launch rejects (e.g. too much shared memory) costs its own line only
            jax.block_until_ready(jax.jit(fn_of(cfg))(*inputs(kind)[0]))
        except Exception as e:
            print(f"   sweep {kind} M={m} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        variants[str(cfg)] = (fn_of(cfg), inputs(kind))
    firsts = {}
    times = timed_round_robin(variants, reps=reps, outputs=firsts)
    for name, t in times.items():
        err = relative_error(firsts[name], firsts["defaults"]) if name != "bf16" else 0.0
        wrong = f"  WRONG: relative error {err:.3g} against the defaults" if not err <= tolerance_of(kind) else ""
        print(f"   sweep {kind} M={m} {name}: {t * 1e3:.4f} ms, {times['bf16'] / t:.2f}x bf16, "
              f"{times['defaults'] / t:.2f}x the defaults{wrong}", flush=True)


def attention_bench(reps, sweep=False, table=None, table_path=None):
    """int8 / int4 decode attention (the Pallas kernel, XLA's dots over the codes and the Mosaic GPU kernel; both
    kernels over pre-RoPE keys too) against bf16 XLA attention at KV_SHAPE, and at the shorter KV_OTHER_CONTEXTS; with
    a list ``table``, append their times as ``kv_attention`` / ``kv_attention_hopper`` / ``kv_attention_hopper_rope``
    entries (written to ``table_path``). ``sweep``: then the kernel's other settings at KV_SHAPE
    (after every length's defaults, so that a run cut short by its limit keeps them)."""
    longest = KV_SHAPE[3]
    for t in (longest, *(c for c in KV_OTHER_CONTEXTS if c < longest)):
        attention_rows(t, [dict()], reps, table, xla=True, pre_rope=True)
        if table is not None and table_path:
            write_table(table_path, table)
    # --sweep: other split counts, a deeper cp.async pipeline for the codes (at 2 stages the compiled loop waits
    # for every outstanding copy at its top: scripts/kernel_sass.py kv_int8_32k_3stages), and 8 warps with
    # 128-256-token blocks: the loop's barriers (cross-warp softmax reductions, the weights' layout for the
    # second dot) come 22 times per 256 tokens instead of 32, no spills (kv_int8_32k_8warps_256; 4 warps at 256
    # tokens spill; 64-token blocks measured 0.8x on the H200 and are left out)
    if sweep:
        from pallas_kernels.kv_attention_hopper import AttentionBlocks

        attention_rows(longest, [dict(num_splits=64), dict(num_splits=16), dict(num_stages=3), dict(num_stages=4),
                                 dict(block_t=128, num_warps=8), dict(block_t=256, num_warps=8),
                                 dict(block_t=256, num_warps=8, num_stages=3)], reps, xla=True,
                       hopper_configs=[dict(blocks=AttentionBlocks(splits=s)) for s in (8, 16, 64)])


FLOAT_KV_HEADS = ((32, 1), (8, 4))  # (kv heads, query heads per kv head): Llama-2-7B's, Llama-3-8B's
FLOAT_KV_CONTEXTS = (256, 4096, 32768)
FLOAT_KV_STEPS = 32  # decode steps a timed program runs, each over the next layer of a stacked cache


def float_attention_steps(attend, layers: int):
    """A program of FLOAT_KV_STEPS one-token attention steps over a stacked float cache carried in place (donated,
    as a decode loop carries it), step i on layer i % ``layers``, each step's output the next one's query (nothing
    is dead code). ``attend(q, k_new, v_new, k, v, layer) -> (out, k, v)``."""
    def run(q, k_new, v_new, k, v):
        def body(i, carry):
            return attend(*carry[:1], k_new, v_new, *carry[1:], i % layers)
        return jax.lax.fori_loop(0, FLOAT_KV_STEPS, body, (q, k, v))
    return jax.jit(run, donate_argnums=(3, 4))


def float_attention_bench(reps, table=None, table_path=None):
    """A decode step's attention over a bf16 cache: the kernel that writes the token and attends
    (pallas_kernels.decode_attention, one launch) against XLA's path as a decode step traces it with kernels off
    (a dynamic-update-slice per cache, then llmeq_jax.kv.attention's sums or dots), at FLOAT_KV_HEADS and
    FLOAT_KV_CONTEXTS (the query at the last slot), the cache stacked over enough layers to miss the L2 cache
    (as the weights between two layers make a decode step miss it). With a list ``table``: ``kv_attention``
    entries of 16 bits, which a decode step's float_path follows (XLA's path where it was faster)."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.kv import cache as kvcache
    from pallas_kernels import config as kernel_config
    from pallas_kernels.decode_attention import append_decode_attention

    b, d = 1, 128
    for h, g in FLOAT_KV_HEADS:
        for t in FLOAT_KV_CONTEXTS:
            layers = copies_for(2 * 2 * b * h * t * d)
            empty = kvcache.init(layers, b, h, t, d, jnp.bfloat16)
            mask = jnp.ones((b, 1, t), bool)
            shell = dataclasses.replace(empty, valid=mask[:, 0], length=jnp.int32(t - 1))

            def kernel(q, kn, vn, k, v, layer):
                return append_decode_attention(q, kn, vn, k, v, jnp.int32(t - 1), mask[:, 0], layer=layer)

            def xla(q, kn, vn, k, v, layer, shell=shell, mask=mask):
                out, c = kvcache.attend(dataclasses.replace(shell, k=k, v=v), layer, q[:, None], kn[:, :, None],
                                        vn[:, :, None], mask)
                return out[:, 0], c.k, c.v

            q = jax.random.normal(jax.random.key(1), (b, h * g, d), jnp.bfloat16)
            kn, vn = (jax.random.normal(jax.random.key(i), (b, h, d), jnp.bfloat16) for i in (2, 3))
            state = {}
            for name, attend in (("kernel", kernel), ("xla", xla)):
                cache = [jax.random.normal(jax.random.key(4 + i), empty.k.shape, jnp.bfloat16) for i in (0, 1)]
                with kernel_config.disabled() if name == "xla" else contextlib.nullcontext():
                    program = float_attention_steps(attend, layers).lower(q, kn, vn, *cache).compile()
                first = program(q, kn, vn, *cache)  # from the same inputs for both: compared below
                state[name] = [program, (*first[:1], kn, vn, *first[1:])]
            err = jnp.max(jnp.abs(state["kernel"][1][0].astype(jnp.float32) - state["xla"][1][0].astype(jnp.float32)))
            # bf16 outputs fed back as the next step's query, 32 times: more rounding than one call
            right = agrees(f"float decode attention H_kv={h} G={g} T={t}", state["kernel"][1][0], state["xla"][1][0],
                           2 * TOLERANCE)
            best = dict.fromkeys(state, float("inf"))
            for _ in range(3):  # in turns, each variant's best round
                for name, (program, args) in state.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        out_q, k, v = program(*args)
                        args = (out_q, args[1], args[2], k, v)
                    jax.block_until_ready(args)
                    state[name][1] = args
                    best[name] = min(best[name], (time.perf_counter() - t0) / (reps * FLOAT_KV_STEPS))
            gbs = 2 * 2 * b * h * t * d / 1e9
            print(f"float decode attention B={b} H_kv={h} G={g} T={t} D={d} bf16: kernel {best['kernel'] * 1e6:.1f} us "
                  f"({gbs / best['kernel']:.0f} GB/s), XLA {best['xla'] * 1e6:.1f} us ({gbs / best['xla']:.0f} GB/s): "
                  f"{best['xla'] / best['kernel']:.2f}x; after {FLOAT_KV_STEPS} steps max |kernel - XLA| "
                  f"{float(err):.2g}", flush=True)
            if table is not None:
                key = dispatch_table.Key(jax.devices()[0].device_kind, "kv_attention", 16, None, d, t,
                                         dispatch_table.row_bucket(b * g), "bfloat16")
                times = {"pallas_s": best["kernel"], "xla_s": best["xla"], "bf16_s": best["xla"]}
                table.append((key, marked(times, right)))
            del state
    if table is not None and table_path:
        write_table(table_path, table)


# A prompt's attention: (query heads, KV heads) of Llama-2-7B and Llama-3-8B, head dim 128, and prompt lengths.
PROMPT_HEADS = ((32, 32), (32, 8))
PROMPT_LENGTHS = (128, 512, 2048, 4096)


def prompt_attention_bench(reps, lengths=PROMPT_LENGTHS, table=None, table_path=None):
    """A prompt's causal attention (batch 1, bf16, head dim 128) at PROMPT_HEADS and ``lengths``: cuDNN's flash
    attention (llmeq_jax.kv.attention.attention_flash) against XLA's dots and softmax (attention_xla, which
    writes the float32 scores); with a list ``table``, ``prompt_attention`` entries, which a GPU's prompts
    follow (kv.attention.flash_ok)."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.kv import attention

    def flash(q, k, v, mask):
        out = attention.attention_flash(q, k, v, mask)
        if out is None:
            raise SystemExit("cuDNN's flash attention refused the call (no cuDNN in this jaxlib?)")
        return out

    d = 128
    for h, kv in PROMPT_HEADS:
        for t in lengths:
            keys = jax.random.split(jax.random.key(t), 3)
            q = jax.random.normal(keys[0], (1, t, h, d), jnp.bfloat16)
            k, v = (jax.random.normal(key, (1, kv, t, d), jnp.bfloat16) for key in keys[1:])
            mask = jnp.tril(jnp.ones((t, t), bool))[None]
            inputs = [(q, k, v, mask)]
            firsts = {}
            best = timed_round_robin({"flash": (flash, inputs), "xla": (attention.attention_xla, inputs)}, reps=reps,
                                     outputs=firsts)
            err = jnp.max(jnp.abs(firsts["flash"].astype(jnp.float32) - firsts["xla"].astype(jnp.float32)))
            right = agrees(f"prompt attention T={t} H={h} H_kv={kv}", firsts["flash"], firsts["xla"])
            print(f"prompt attention T={t} H={h} H_kv={kv} D={d} bf16 causal: cuDNN flash "
                  f"{best['flash'] * 1e6:.1f} us, XLA {best['xla'] * 1e6:.1f} us: {best['xla'] / best['flash']:.2f}x; "
                  f"max |flash - XLA| {float(err):.2g}", flush=True)
            if table is not None:
                key = dispatch_table.Key(jax.devices()[0].device_kind, "prompt_attention", 16, None, d,
                                         dispatch_table.row_bucket(t), dispatch_table.row_bucket(t), "bfloat16")
                times = {"pallas_s": best["flash"], "xla_s": best["xla"], "bf16_s": best["xla"]}
                table.append((key, marked(times, right)))
    if table is not None and table_path:
        write_table(table_path, table)


NORM_LAYERS = 8  # norms chained in one timed program, each reading a layer of one stack of scales


def norm_bench(reps, features, rows, table=None, table_path=None):
    """A decode step's RMSNorm: the kernel (pallas_kernels.rms_norm, one launch, the scale read in place from a
    stack) against XLA's (the layer's scale sliced, two launches at one row) at each of ``features`` and decode
    ``rows``. Each program chains NORM_LAYERS norms, each on the previous one's output (independent ones XLA
    would fuse side by side, which no decode step does); with a list ``table``, ``rms_norm`` entries."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.layer_slice import take_layer
    from pallas_kernels.rms_norm import rms_norm, rms_norm_reference

    def chain(norm):
        def run(x, stack):
            for i in range(NORM_LAYERS):
                x = norm(x, stack, jnp.int32(i))
            return x
        return run  # jitted by timed_round_robin

    variants = {"kernel": chain(lambda x, s, i: rms_norm(x, s, 1e-5, layer=i)),
                "xla": chain(lambda x, s, i: rms_norm_reference(x, take_layer(s, i), 1e-5))}
    for k in features:
        stack = jax.random.uniform(jax.random.key(k), (NORM_LAYERS, k), minval=0.5, maxval=1.5)
        for m in (r for r in rows if r <= 16):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            firsts = {}
            chains = timed_round_robin({name: (f, [(x, stack)]) for name, f in variants.items()}, reps=reps,
                                       outputs=firsts)
            right = agrees(f"rms_norm K={k} M={m}", firsts["kernel"], firsts["xla"])
            best = {name: t / NORM_LAYERS for name, t in chains.items()}
            print(f"rms_norm K={k} M={m}: kernel {best['kernel'] * 1e6:.2f} us, XLA {best['xla'] * 1e6:.2f} us "
                  f"({best['xla'] / best['kernel']:.2f}x)", flush=True)
            if table is not None:
                key = dispatch_table.Key(jax.devices()[0].device_kind, "rms_norm", 32, None, k, k,
                                         dispatch_table.row_bucket(m), "bfloat16")
                times = {"pallas_s": best["kernel"], "xla_s": best["xla"], "bf16_s": best["xla"]}
                table.append((key, marked(times, right)))
        if table is not None and table_path:
            write_table(table_path, table)


def attention_row(label: str, fn, inputs, reps, kv_bytes: int, t_bf: float, ref, versus=None) -> tuple:
    """(``fn``'s seconds a call over ``inputs``, whether its result on the first input set agrees with ``ref``),
    printed as a row (ms, GB/s of ``kv_bytes``, the ratio to bf16's ``t_bf``, and ``versus(seconds)``'s text);
    (None, False) where it fails, which costs its own line only."""
    got = []
    try:
        t = timed(fn, inputs, reps=reps, outputs=got)
    except Exception as e:  # noqa: BLE001 -- a failing kind or setting costs its own line
        print(f"  {label}: failed: {type(e).__name__}: {str(e)[:200]}")
        return None, False
    print(f"  {label}: {t * 1e3:.4f} ms ({kv_bytes / t / 1e9:.0f} GB/s), {t_bf / t:.2f}x bf16"
          + (versus(t) if versus else ""), flush=True)
    return t, agrees(label, got[0], ref)


def hopper_row(t, bits, inputs, grids, t_bf, t_replaced, kv_bytes, reps, table, ref, configs=({},), rope=None):
    """The Mosaic GPU decode attention's rows (``kv_attention_hopper``, int``bits`` codes) under each of ``configs``
    ({} = its defaults), and with a list ``table`` its defaults' entry against ``t_replaced``, timed in the same run:
    post-RoPE keys, kernel ``kv_attention_hopper`` against the faster of the Triton kernel and XLA's dots; pre-RoPE
    keys (``rope``: slot_pos and inv_freq), kernel ``kv_attention_hopper_rope`` against the Triton kernel. The kernel
    reads the slots' byte mask as a cache's step passes it, made once for all its layers (``length=None``), not
    converted from ``length`` in every call (a launch the Triton kernel, which clips the length itself, does not pay)."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.kv.store_attention import slot_mask
    from pallas_kernels.kv_attention_hopper import kv_attention_hopper

    q = inputs[0][0]
    b, hq, d = q.shape
    h = inputs[0][1].shape[1]
    label, kernel, rope = (f"int{bits} Mosaic GPU", "kv_attention_hopper", {}) if rope is None else \
        (f"int{bits} pre-RoPE Mosaic GPU", "kv_attention_hopper_rope", rope)
    *grids, length = grids
    step_mask = slot_mask(length, None, b, t).astype(jnp.int8)
    for cfg in configs:
        fn = lambda q, k, v, cfg=cfg: kv_attention_hopper(  # noqa: E731
            q, k, v, *grids, None, bits=bits, allowed=step_mask, **rope, **cfg)[0]
        t_h, right = attention_row(f"{label} {cfg or 'default'}", fn, inputs, reps, kv_bytes, t_bf, ref,
                                   lambda t: f", {t_replaced / t:.2f}x the path it replaces")
        if t_h is not None and table is not None and not cfg:
            key = dispatch_table.Key(jax.devices()[0].device_kind, kernel, bits, None, d, t,
                                     dispatch_table.row_bucket(b * hq // h), jnp.dtype(q.dtype).name)
            times = {"pallas_s": t_h, "xla_s": t_replaced, "bf16_s": t_bf}
            table.append((key, marked(times, right)))


def pre_rope_rows(t, bits, inputs, grids, t_bf, kv_bytes, reps, table):
    """Keys stored before RoPE (the cache's default spec; a bf16 cache holds rotated keys, so bf16 attention is the
    same baseline): the Triton kernel, which rotates each key by its slot's position, then the Mosaic GPU kernel,
    which does too, against it (XLA's dots cannot rotate the codes' keys)."""
    from llmeq_jax.core.rope import rope_inv_freq
    from pallas_kernels.kv_cache import store_decode_attention

    b, d = inputs[0][0].shape[0], inputs[0][0].shape[2]
    rope = dict(slot_pos=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                inv_freq=jnp.asarray(rope_inv_freq(d, 10000.0, None)))
    ref = attention_reference(inputs[0], grids, bits, rope)
    fn = lambda q, k, v: store_decode_attention(q, k, v, *grids, bits=bits, **rope)[0]  # noqa: E731
    t_p, _ = attention_row(f"int{bits} pre-RoPE Pallas default", fn, inputs, reps, kv_bytes, t_bf, ref)
    if t_p is not None:
        hopper_row(t, bits, inputs, grids, t_bf, t_p, kv_bytes, reps, table, ref, rope=rope)


def attention_reference(first_inputs, grids, bits: int, rope=None):
    """The float32 reference of a decode attention over the store (``pallas_kernels.kv_cache``'s jnp one) on one
    input set (q, key codes, value codes) with the store's ``grids`` (key scale and min, value scale and min,
    length) and, for pre-RoPE keys, ``rope`` (slot_pos, inv_freq)."""
    from pallas_kernels.kv_cache import store_decode_attention_reference

    call = jax.jit(lambda q, k, v: store_decode_attention_reference(q, k, v, *grids, bits=bits, **(rope or {}))[0])
    return call(*first_inputs)


def attention_rows(t, configs, reps, table=None, xla=False, hopper_configs=({},), pre_rope=False):
    """The attention bench's rows at ``t`` cached tokens (KV_SHAPE's other dims), int8 then int4: bf16 XLA
    attention, the Pallas kernel under each of ``configs`` ({} = its defaults) and, with ``xla``, XLA's dots over
    the codes and the Mosaic GPU kernel under each of ``hopper_configs``; a table entry of each width where the
    defaults and XLA's dots both ran. ``pre_rope``: then both kernels over pre-RoPE keys (:func:`pre_rope_rows`)."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.kv.store_attention import store_attention
    from pallas_kernels.kv_cache import store_decode_attention

    b, h, g, _, d = KV_SHAPE
    # The quantized cache's store: per-channel key grid, float16 per-token value scale and min. Random, as a cache's
    # are: XLA turns a constant of one value into a broadcast, which a kernel's custom call then needs written out
    # (two launches writing the value grids before every kernel call, deviceless H100 compile; XLA's dots fuse it).
    grid = jax.random.split(jax.random.key(5), 4)
    ks = jax.random.uniform(grid[0], (1, h, 1, d), minval=0.005, maxval=0.015)
    kl = jax.random.normal(grid[1], (1, h, 1, d)) * 0.01
    vs = jax.random.uniform(grid[2], (b, h, t, 1), minval=0.005, maxval=0.015).astype(jnp.float16)
    vl = (jax.random.normal(grid[3], (b, h, t, 1)) * 0.01).astype(jnp.float16)
    length = jnp.array([t], jnp.int32)
    q = jax.random.normal(jax.random.key(3), (b, h * g, d), jnp.bfloat16)
    kq = jax.random.randint(jax.random.key(2), (b, h, t, d), -127, 128).astype(jnp.int8)
    k4 = jax.random.randint(jax.random.key(4), (b, h, t, d // 2), 0, 256).astype(jnp.uint8)
    kb = kq.astype(jnp.bfloat16) * 0.01
    r = copies_for(kq.nbytes * 2)

    def bf16_attn(q, k, v):
        s = jnp.einsum("bhgd,bhtd->bhgt", q.reshape(b, h, g, d), k).astype(jnp.float32) / d**0.5
        return jnp.einsum("bhgt,bhtd->bhgd", jax.nn.softmax(s, -1).astype(k.dtype), v).reshape(b, h * g, d)

    # distinct K and V buffers everywhere (V must not be served from L2 after reading K)
    kbs, kqs, k4s = _copies(kb, 2 * r), _copies(kq, 2 * r), _copies(k4, 2 * r)
    t_bf = timed(bf16_attn, [(q, kbs[i], kbs[r + i]) for i in range(r)], reps=reps)
    kv_bytes = {"bf16": 2 * 2 * t * h * d, 8: 2 * t * h * d + 4 * t * h, 4: t * h * d + 4 * t * h}
    print(f"decode attention B={b} T={t} H_kv={h} G={g} D={d}: bf16 XLA {t_bf * 1e3:.4f} ms "
          f"({kv_bytes['bf16'] / t_bf / 1e9:.0f} GB/s)")
    for bits, caches in ((8, kqs), (4, k4s)):
        inputs = [(q, caches[i], caches[r + i]) for i in range(r)]
        ref = attention_reference(inputs[0], (ks, kl, vs, vl, length), bits)
        t_default, default_right = None, False
        for cfg in configs:
            fn = lambda q, k, v, cfg=cfg, bits=bits: store_decode_attention(q, k, v, ks, kl, vs, vl, length, bits=bits,
                                                                          **cfg)[0]
            # (a setting may fail, e.g. a block size that needs more shared memory than there is)
            t_q, right = attention_row(f"int{bits} Pallas {cfg or 'default'}", fn, inputs, reps, kv_bytes[bits], t_bf,
                                       ref)
            if not cfg:
                t_default, default_right = t_q, right
        if not xla:
            continue
        # XLA's own GEMM fusions over the codes, the grids folded out of the dots (llmeq_jax/kv/store_attention.py):
        # the int8 / int4 (bitcast to jnp.int4) codes converted in the GEMMs' operand loads, as XLA streams the bf16
        # cache above (deviceless compile for an H200: two GEMM fusions reading s8 / s4, no dequantized copy)
        fn = lambda q, k, v, bits=bits: store_attention(q, k, v, ks, kl, vs, vl, length, bits=bits)[0]
        t_x = timed(fn, inputs, reps=reps)
        print(f"  int{bits} XLA dots over the codes: {t_x * 1e3:.4f} ms ({kv_bytes[bits] / t_x / 1e9:.0f} GB/s), "
              f"{t_bf / t_x:.2f}x bf16" + (f", {t_default / t_x:.2f}x the Pallas kernel" if t_default else ""), flush=True)
        if table is not None and t_default:
            key = dispatch_table.Key(jax.devices()[0].device_kind, "kv_attention", bits, None, d, t,
                                     dispatch_table.row_bucket(b * g), jnp.dtype(q.dtype).name)
            table.append((key, marked({"pallas_s": t_default, "xla_s": t_x, "bf16_s": t_bf}, default_right)))
        # the Mosaic GPU kernel (pallas_kernels/kv_attention_hopper.py), against the faster of the two
        hopper_row(t, bits, inputs, (ks, kl, vs, vl, length), t_bf, min(t_x, t_default or t_x), kv_bytes[bits], reps,
                   table, ref, hopper_configs)
        if pre_rope:
            pre_rope_rows(t, bits, inputs, (ks, kl, vs, vl, length), t_bf, kv_bytes[bits], reps, table)


SWEEP_WEIGHT = (4096, 11008)  # the weight --sweep tries _sweep()'s settings on


def _sweep():
    from pallas_kernels.blocks import Blocks

    return {  # other settings tried by --sweep on SWEEP_WEIGHT (the defaults come from pallas_kernels/blocks.py)
        1: [dict(k_splits=1), dict(blocks=Blocks(16, 64, 128, 4, 3)), dict(blocks=Blocks(16, 256, 128, 4, 3))],
        16: [dict(k_splits=1), dict(blocks=Blocks(16, 64, 128, 4, 3))],
        # W8A8 at 2048 rows: Triton waits for every int8 wgmma (int32 accumulators are never pipelined), so the
        # tensor cores overlap only across programs sharing an SM; the last three fit four (128 x 64, 64 x 128:
        # 96-118 registers, 48 KB) or two with one warpgroup each (sm_90 SASS), where the default fits two of 8 warps
        2048: [dict(transpose_w=False), dict(blocks=Blocks(256, 128, 128, 8, 3)), dict(blocks=Blocks(128, 256, 128, 8, 3)),
               dict(blocks=Blocks(256, 128, 128, 8, 4)), dict(blocks=Blocks(128, 256, 128, 8, 4)),
               dict(blocks=Blocks(256, 128, 256, 8, 3)), dict(blocks=Blocks(128, 64, 128, 4, 2)),
               dict(blocks=Blocks(64, 128, 128, 4, 2)), dict(blocks=Blocks(128, 128, 128, 4, 2))],
    }


PREFILL_WORDS_SWEEP_ROWS = (512, 2048)


def _prefill_words_sweep():
    """Settings of the prompt kernel over the words (``int4_words_prefill``) tried at PREFILL_WORDS_SWEEP_ROWS:
    token rows a program (wgmma's N: 64-256), weight columns, warps and stages. Each gives every warpgroup 64
    weight columns (wgmma's M; with 128 Triton moved the A operand through shared memory in sm_90 SASS, 700+
    instructions a word block against ~300) and fits the H100's 227 KB of shared memory (stages x (bm x 256 + bn x
    64) bytes, and the conversions)."""
    from pallas_kernels.blocks import Blocks

    return [dict(blocks=Blocks(bm, bn, 128, warps, stages)) for bm, bn, warps, stages in
            ((128, 128, 8, 3), (128, 128, 8, 4), (256, 64, 4, 2), (128, 64, 4, 3), (64, 128, 8, 4), (128, 256, 16, 3))]


def _hopper_sweep(fp8: bool = False):
    """Settings of the Mosaic GPU W8A8 kernel (``w8a8_hopper.HopperBlocks``) tried at PREFILL_WORDS_SWEEP_ROWS:
    output tiles of 128 x 256 (the default), 64 x 256, 128 x 128 and 64 x 128 a program, the TMA ring's depth, and
    the order the programs walk the tiles in (L2 reuse of x's rows or of the weights' columns). FP8 (default 64 x
    256, two float32 tiles a warpgroup): 128 x 128 (as many registers), 64 x 128, the ring's depth, the order."""
    from pallas_kernels.w8a8_hopper import HopperBlocks

    if fp8:
        return [dict(blocks=HopperBlocks(**kw)) for kw in (
            dict(tile_m=128, tile_n=64), dict(tile_m=64, tile_n=64), dict(tile_m=64, stages=6),
            dict(tile_m=64, stages=3), dict(tile_m=64, snake_minor_n=False), dict(tile_m=64, snake_width=16))]
    return [dict(blocks=HopperBlocks(**kw)) for kw in (
        dict(stages=3), dict(tile_m=64), dict(tile_n=64), dict(tile_m=64, tile_n=64), dict(snake_minor_n=False),
        dict(snake_width=16), dict(snake_width=4), dict(tile_n=64, stages=6))]


def _weight_only_hopper_sweep(bits: int = 8):
    """Settings of the Mosaic GPU weight-only kernel (``weight_only_hopper.WeightOnlyBlocks``) tried at
    PREFILL_WORDS_SWEEP_ROWS. int8: output tiles of 128 x 256 (the default), 128 x 128 and 64 x 128 a program, the
    TMA ring's depth (4 at the default tiles fills the 227 KB with the dequantized buffers) and the tile order.
    int4 (128 K values a step): 128 x 128 tiles (the default) with 2 slots, 64 x 256 and 64 x 128 tiles, the order."""
    from pallas_kernels.weight_only_hopper import WeightOnlyBlocks

    if bits == 4:
        return [dict(blocks=WeightOnlyBlocks(tile_k=128, **kw)) for kw in (
            dict(tile_n=64, stages=2), dict(tile_m=64, stages=2), dict(tile_m=64, tile_n=64, stages=4),
            dict(tile_n=64, snake_minor_n=False), dict(tile_n=64, snake_width=16))]
    return [dict(blocks=WeightOnlyBlocks(**kw)) for kw in (
        dict(stages=3), dict(stages=2), dict(tile_n=64), dict(tile_m=64, tile_n=64), dict(snake_minor_n=False),
        dict(snake_width=16), dict(tile_n=64, stages=6))]


def _words_sweep(k: int, n: int):
    """Settings of the word kernel tried at M = 1 on a (K, N) weight (group 128)."""
    from pallas_kernels import int4_words
    from pallas_kernels.blocks import Blocks
    from pallas_kernels.common import cdiv, fit_splits, splits_for

    # the word kernel's K block is its K step (128 for group 128); its default tile is 16 x 128 (16 x 256 from
    # 8192 columns), 4 warps, 3 stages (int4_words.default_blocks), K split to ~264 programs (common.splits_for)
    # 8 warps, 64 columns and 1-2 splits lost clearly on the H200 (0.4-0.8x the defaults) and are left out.
    tiles = [(16, 128, 128, 4, 3), (16, 256, 128, 4, 3), (16, 128, 128, 2, 3), (16, 128, 128, 4, 2),
             (16, 128, 128, 4, 4)]
    if n < 4096:  # a small model's product (SmolLM2-135M: 8 programs of 128 columns at N = 960): narrower tiles
        tiles.append((16, 64, 128, 4, 3))
    configs = [dict(blocks=Blocks(*t)) for t in tiles] + [dict(k_splits=s) for s in (4, 16)]
    # K blocks of 256 and 512 take two and four word blocks an iteration: more bytes a pipeline stage (the
    # bf16 float kernel, which streams at a plain dot's speed, stages 32 KB; the words 8-16 KB) and fewer
    # iterations (2.48 -> 2.35 / 2.26 instructions per weight at 128 columns, sm_90 SASS). Split K as the
    # defaults are, so that the program count does not change with the step (splits_for would halve it).
    for bn in (128, 256):
        grid_n = cdiv(n, bn)
        splits, _ = fit_splits(cdiv(k, GROUP), splits_for(grid_n, cdiv(k, GROUP)))
        for bk, stages in ((256, 3), (512, 3), (256, 4)):
            configs.append(dict(blocks=Blocks(16, bn, bk, 4, stages), k_splits=splits))
    # epilogue="mma": each group's scale / zero-point rows through dots instead of layout conversions (no
    # barriers but the pipeline's; bf16 scales), at the defaults and with the wider tiles
    other_bn = 256 if int4_words.default_blocks(1, n, GROUP).bn == 128 else 128  # the width the defaults lack
    configs += [dict(epilogue="mma"), dict(blocks=Blocks(16, other_bn, 128, 4, 3), epilogue="mma")]
    return configs


def _decode_hopper_sweep(k: int):
    """Settings of the Mosaic GPU int4 decode kernel (``decode_hopper.DecodeBlocks``) tried at M = 1 on a weight
    of ``k`` inputs: K values a ring step (256 by default: two 128-value chunks, the second converted while the first
    one's wgmma runs; 128: one; 512: four), the TMA ring's depth (4 by default) and the K splits (the default from a
    bytes model, ``splits_for``; fewer splits write fewer float32 partial sums, more keep more SMs streaming)."""
    from pallas_kernels.decode_hopper import DecodeBlocks, default_blocks

    steps = k // default_blocks(k).tile_k
    splits = [s for s in (1, 2, 3, 4, 8, 16) if steps // s >= 2]
    shapes = [dict(stages=3), dict(stages=6), dict(tile_k=128, stages=6), dict(tile_k=128, stages=10),
              dict(tile_k=512, stages=2), dict(tile_k=512, stages=3)]
    return [dict(blocks=DecodeBlocks(**kw)) for kw in shapes] + [dict(blocks=DecodeBlocks(splits=s)) for s in splits]


def _int8_f16_sweep():
    from pallas_kernels.blocks import Blocks

    # its defaults: 16 x 256 tiles, K steps of 128, 4 warps, 3 stages (pallas_kernels/int8_f16.py); 512 columns
    # and 256-row steps issue fewer instructions per weight (SASS), 128 columns give more programs
    tiles = [(16, 512, 128, 4, 3), (16, 256, 256, 4, 3), (16, 128, 128, 4, 3), (16, 256, 128, 4, 4)]
    return [dict(blocks=Blocks(*t)) for t in tiles] + [dict(k_splits=s) for s in (4, 16)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time a few other block sizes")
    parser.add_argument("--write-table", metavar="PATH",
                        help="also time XLA's path of each quantized product and write the dispatch table "
                             "(use it with LLMEQ_DISPATCH_TABLE=PATH; llmeq_jax/dispatch_table.py)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"kernels to time, of {','.join(KINDS)} "
                                                                 "(bf16 is always timed: the baseline)")
    parser.add_argument("--weights", default=",".join(f"{k}x{n}" for k, n in WEIGHTS),
                        help="weight shapes KxN, comma-separated")
    parser.add_argument("--rows", default=",".join(map(str, DECODE_M + PREFILL_M)),
                        help="activation rows M to time, comma-separated")
    parser.add_argument("--no-attention", action="store_true", help="skip the decode-attention rows")
    parser.add_argument("--float-attention", action="store_true",
                        help="time only a decode step's attention over a bf16 cache: the write-and-attend kernel "
                             "against XLA's update and attention")
    parser.add_argument("--prompt-attention", action="store_true",
                        help="time only a prompt's attention (cuDNN's flash attention against XLA's) at --rows "
                             "positions of at least 128, e.g. 128,512,2048,4096")
    parser.add_argument("--norms", metavar="K,K", help="time only the decode RMSNorm kernel against XLA's at these "
                                                       "feature counts (and --rows <= 16), e.g. 576,2048,4096")
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if set(kinds) - set(KINDS):
        parser.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; expected some of {list(KINDS)}")
    try:
        weights = tuple(tuple(int(v) for v in s.split("x")) for s in args.weights.split(","))
        assert all(len(w) == 2 for w in weights)
    except (ValueError, AssertionError):
        parser.error(f"--weights {args.weights!r}: expected shapes KxN, e.g. 4096x11008,11008x4096")
    try:
        rows = tuple(int(m) for m in args.rows.split(","))
        assert all(m > 0 for m in rows)
    except (ValueError, AssertionError):
        parser.error(f"--rows {args.rows!r}: expected positive row counts, e.g. 1,16,2048")
    if jax.default_backend() != "gpu":
        print(f"no GPU found (JAX backend: {jax.default_backend()}); printing the roofline estimate instead")
        roofline_table()
        return
    table = [] if args.write_table else None
    if args.float_attention:
        float_attention_bench(args.reps, table, args.write_table)
        return
    if args.prompt_attention:
        prompt_attention_bench(args.reps, [m for m in rows if m >= 128] or PROMPT_LENGTHS, table, args.write_table)
        return
    if args.norms:
        norm_bench(args.reps, [int(k) for k in args.norms.split(",")], rows, table, args.write_table)
        return
    gpu_bench(args.reps, args.sweep, table, args.write_table, kinds, weights, not args.no_attention, rows)


if __name__ == "__main__":
    main()
