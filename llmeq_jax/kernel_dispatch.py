"""Which Pallas kernel (if any) ``llmeq_jax.ops.linear`` hands a QArray product to.

The ops side of the kernels: ``pallas_kernels`` holds the kernels and their ``can_use``
predicates; this module decides, from the QArray's layout, which one takes a product.

``linear(x, w, act, require)`` returns the kernel's result when a kernel can take
the product on this backend (a CUDA GPU, or anywhere inside
``pallas_kernels.config.interpret(True)``); otherwise None, so ops falls back to
XLA -- or, with ``require=True`` (``backend="pallas"``), raises one clear error
saying why no kernel applies.

Which kernel:
  act spec given  -> W8A8 (int8-stored weights; dynamic per-token or static per-tensor activations),
                     FP8 W8A8 for fp8 (E4M3) weights and activations on sm_89+ ("fp8_w8a8");
                     a prompt's int8 or FP8 W8A8 over K-major weights on Hopper: the Mosaic GPU kernel where
                     a table measured it faster than the Triton one (``hopper_w8a8_takes``)
  no act spec     -> weight-only: int8-stored values (5..8 bits) or nibble-packed (3..4 bits);
                     fp8 weights without fp8 activations have no kernel (XLA dequantizes them);
                     a prompt's int8-stored or int4-pair product on Hopper: the Mosaic GPU kernel where a
                     table measured it faster than XLA's path (``hopper_weight_only_takes``); a decode step's
                     K-major int8 or int4-row product on Hopper (weight-only, or W8A8 int8 / FP8): the Mosaic
                     GPU decode kernel where a table measured it faster than the Triton kernel and XLA's path
                     (``hopper_decode_takes``)

A measured table (:mod:`llmeq_jax.dispatch_table`, written by ``scripts/bench_kernels.py
--write-table``) overrules that where it measured XLA faster for the product on this device;
``require=True`` always takes the kernel.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from llmeq_jax import dispatch_table
from llmeq_jax.core.qarray import QArray, is_packed
from llmeq_jax.decode_layout import GPU_KMAJOR_MAX_ROWS, scale_group
from llmeq_jax.layer_slice import take_layer
from pallas_kernels import config, decode_hopper, float_matmul, hardware_checked, int4_words, int4_words_prefill, \
    int8_f16, rms_norm as norm_kernel, settings, token_codes, w8a8, w8a8_hopper, weight_only, weight_only_hopper


class KernelUnavailable(ValueError):
    """No Pallas kernel can take this product (raised only when one was required)."""


def _layout(w: QArray) -> tuple[int | None, jnp.ndarray, jnp.ndarray | None, str]:
    """(group or None, scale (G, N), zero point (G, N) or None, why-not) of an (in, out) kernel.

    A stack of kernels (arrays with leading layer axes, ``llmeq_jax.layer_slice``) keeps them:
    scale and zero point come back [L, G, N]."""
    k, n = w.shape
    if w.tile[1] not in (1, n):
        return None, None, None, f"scales grouped along the output dim (tile {w.tile})"
    lead = w.scale.shape[:-2]
    group = scale_group(w)
    groups = 1 if group is None else math.ceil(k / group)
    scale = jnp.broadcast_to(w.scale.astype(jnp.float32), (*lead, groups, n))
    zp = None if w.zero_point is None else jnp.broadcast_to(w.zero_point, (*lead, groups, n))
    return group, scale, zp, ""


def plan(x_shape, x_dtype, w: QArray, act) -> tuple[str | None, str]:
    """("w8a8" | "fp8_w8a8" | "weight_only", "") when a kernel takes ``x @ w``, else (None, why)."""
    if len(w.shape) != 2:
        return None, f"kernel of rank {len(w.shape)}"
    if w.grid == "log2":
        return None, "log2 codes (no kernel decodes them)"
    if w.grid == "fp8" and (act is None or act.grid != "fp8"):
        return None, "fp8 weights without fp8 activations (XLA dequantizes them)"
    if w.zero_point is not None and not jnp.issubdtype(w.zero_point.dtype, jnp.integer):
        # GGUF Q4_1 / K-quant grids kept as stored: the kernels subtract integer zero points in bf16/fp16 exactly.
        return None, "float zero points (the kernels take integer ones)"
    k, n = w.shape
    rows = (math.prod(x_shape[:-1]), k)
    group, _, _, why = _layout(w)
    if why:
        return None, why
    if act is not None:
        if is_packed(w.bits):
            return None, f"W8A8 needs int8-stored weights, got int{w.bits}"
        if act.bits != 8 or not act.symmetric or act.grid != w.grid:
            return None, f"activations {act.describe()} with {w.grid} weights (the kernel quantizes to symmetric int8 " \
                         "for integer weights, to E4M3 for fp8 weights)"
        if w.act_scale is None and act.granularity != "token":
            return None, f"dynamic {act.granularity} activation scales (the kernel does per-token or a static scale)"
        if w.grid == "fp8" and not w8a8.fp8_supported():
            return None, f"FP8 dots need sm_89+ (Ada, Hopper); this device is {config.target_device().device_kind}"
        ok, why = w8a8.can_use(rows, x_dtype, w.qvalue.dtype, k, group)
        return (("fp8_w8a8" if w.grid == "fp8" else "w8a8"), "") if ok else (None, why)
    if w.bits in (2, 3):
        return None, f"int{w.bits} weights (the kernel reads int8, or int4 two per byte)"
    if w.bits == 4 and w.pack_axis != 0:
        return None, f"int{w.bits} values packed along axis {w.pack_axis} (the kernel reads them packed along K)"
    ok, why = weight_only.can_use(rows, x_dtype, 4 if is_packed(w.bits) else 8, k, group)
    return ("weight_only", "") if ok else (None, why)


def table_key(kind: str, rows: int, x_dtype, w: QArray, group: int | None) -> dispatch_table.Key:
    """The :mod:`dispatch_table` key of a product ``plan`` gave to kernel ``kind``, on the default device."""
    k, n = w.shape
    packed_kinds = ("weight_only", "int4_words", "int4_words_prefill", "weight_only_hopper", "decode_hopper",
                    "xla_subchannel", "xla_subchannel_zp")
    bits = 4 if kind in packed_kinds and is_packed(w.bits) else 8
    return dispatch_table.Key(config.target_device().device_kind, kind, bits, group, k, n,
                              dispatch_table.row_bucket(rows), jnp.dtype(x_dtype).name)


# On a GPU, a quantized product no dispatch table measured (nor inferred from its neighbours) goes to its kernel
# only from this many weights on. A small model's products (SmolLM2-135M's: 0.3-1.8 M weights) decoded at
# 0.34-0.50x bf16 through the kernels on an H200 (2026-12-04: grids of 5-24 programs on 132 SMs), where XLA's
# path had given 0.77-0.78x on an H100 (issue #15); the smallest product any table measured, 4096 x 4096 (16.8 M),
# is about where the decode kernels start to win. In interpret mode (no GPU) every product goes to its kernel. (A
# decode step's weight-only product under it runs on its dequantized weight instead: dequantized_decode_wins.)
MIN_KERNEL_WEIGHTS = 1 << 23


# On a GPU, a prompt's weight-only product over (K, N) codes that no table measured (nor inferred) goes to XLA's path
# from this many rows on: the (K, N) kernel lost to it at every prompt size measured, 3-4x, on both GPUs that ran it
# (H100 2026-11-22: 0.27-0.29x bf16; H200 2026-11-27: the shipped table's 512-4096-row entries, every shape, int8 and
# int4), and up to 16 rows it won. A GPU with no table of its own or of its architecture (an A100, an L40S, an H100
# PCIe) took it for every prompt.
WEIGHT_ONLY_PROMPT_ROWS = 17


# How much faster a table must have measured the bf16 dot than every path over a product's codes for a decode step to
# run it on the dequantized weight: that copy holds 2-4x the codes' bytes, and one product's timings spread by 10 %
# and more between runs (H200: the words kernel's 4096x4096 product at 0.97x bf16 on 2026-11-28, 1.05x on 12-04).
DEQUANTIZED_MARGIN = 1.15


def dequantized_decode_wins(rows: int, w: QArray) -> bool:
    """Whether a GPU decode step's weight-only product with the (in, out) QArray ``w`` is fastest on the weight
    dequantized once into its float dtype -- the float model's own path (``pallas_kernels.float_matmul``, or XLA's dot)
    -- rather than over its codes (``decode_layout.for_decode`` then stores it so). Where a dispatch table measured
    the product (its decode kernel's entry: ``int4_words`` / ``weight_only_nk``), where the bf16 dot beat both the
    kernel and XLA's path over the codes by :data:`DEQUANTIZED_MARGIN`; where none did, a product under
    :data:`MIN_KERNEL_WEIGHTS`: no kernel takes it, and XLA's reductions over a small product's codes (launch-bound,
    not bytes-bound) made SmolLM2-135M's quantized decode 0.77-0.78x bf16 on an H100 (issue #15) where the float path
    is bf16's speed. W8A8 products keep their codes (quantizing the activations is the recipe's arithmetic)."""
    if not config.on_gpu() or w.act_spec is not None or len(w.shape) != 2:
        return False
    kind = "int4_words" if is_packed(w.bits) else "weight_only_nk"
    times = dispatch_table.measured(table_key(kind, rows, w.dtype, w, scale_group(w)))
    if times is not None:
        return times["bf16_s"] * DEQUANTIZED_MARGIN < min(times["pallas_s"], times["xla_s"])
    return math.prod(w.shape) < MIN_KERNEL_WEIGHTS


def kernel_takes(kind: str, rows: int, x_dtype, w: QArray, group: int | None) -> bool:
    """Whether a product of ``rows`` rows with the (in, out) QArray ``w`` goes to kernel ``kind`` (a
    :data:`dispatch_table.KERNELS` name) rather than XLA: the dispatch table's measured or inferred path where
    it has one; else, on a GPU, a weight of at least :data:`MIN_KERNEL_WEIGHTS` values, and for the (K, N)
    weight-only kernel fewer than :data:`WEIGHT_ONLY_PROMPT_ROWS` rows."""
    measured = dispatch_table.choice(table_key(kind, rows, x_dtype, w, group))
    if measured is not None:
        return measured == "pallas"
    if not config.on_gpu():
        return True
    if kind == "weight_only" and rows >= WEIGHT_ONLY_PROMPT_ROWS:
        return False
    return math.prod(w.shape) >= MIN_KERNEL_WEIGHTS


def _act_scale(w: QArray, layer):
    """The static activation scale of ``w`` (of its layer ``layer`` in a stack), or None (dynamic)."""
    return w.act_scale if layer is None else take_layer(w.act_scale, layer)


def logical_view(w_nk: QArray) -> QArray:
    """The ``(in, out)`` description of a QArray stored K-major, ``(out, in)`` (a
    ``decode_layout.RowMajorKernel``'s), for planning and for the kernels' scales: shape, tile,
    scales and zero points swapped back (small arrays); the codes stay as stored."""
    swap = lambda a: None if a is None else jnp.swapaxes(a, -1, -2)  # noqa: E731
    return dataclasses.replace(w_nk, scale=swap(w_nk.scale), zero_point=swap(w_nk.zero_point),
                               shape=(w_nk.shape[1], w_nk.shape[0]), tile=(w_nk.tile[1], w_nk.tile[0]), pack_axis=0)


def _unavailable(require: bool):
    """None where kernels cannot run here (an error naming why when one was required)."""
    if require and config.is_disabled():
        raise KernelUnavailable("backend='pallas' inside pallas_kernels.config.disabled(): kernels are off")
    if require:
        raise KernelUnavailable(
            "backend='pallas' needs a CUDA GPU (the default JAX backend here is "
            f"{config.target_backend()!r}); on CPU use `with pallas_kernels.config.interpret(True):`"
        )
    return None


def prompt_words_take(rows: int, x_dtype, w: QArray, group: int | None) -> bool:
    """Whether a prompt's product of ``rows`` rows (more than a decode step's) with int4 weight-only words goes to
    the prompt kernel over them (``pallas_kernels.int4_words_prefill``, half activations only): where the active or
    shipped dispatch table measured or inferred it faster than XLA's path of the packed codes (kernel
    ``int4_words_prefill``). Unmeasured, XLA's path: the kernel is new, and a prompt's weight-only products ran at
    0.88-0.96x bf16 through XLA on an H200 where every kernel timed so far lost to it."""
    if jnp.dtype(x_dtype) not in int4_words_prefill.HALF_DTYPES:
        return False
    return dispatch_table.choice(table_key("int4_words_prefill", rows, x_dtype, w, group)) == "pallas"


def hopper_beats_words(rows: int, x_dtype, w: QArray, group: int | None) -> bool:
    """Whether the active or shipped table measured the Mosaic GPU kernel over the packed int4 codes
    (``weight_only_hopper``) faster than both XLA's path and the prompt kernel over words for this product: a
    prompt layout then keeps the packed codes (``decode_layout.words_for_prompts``)."""
    hopper = dispatch_table.measured(table_key("weight_only_hopper", rows, x_dtype, w, group))
    words = dispatch_table.measured(table_key("int4_words_prefill", rows, x_dtype, w, group))
    return bool(hopper and words) and hopper["pallas_s"] < min(words["pallas_s"], hopper["xla_s"])


def hopper_w8a8_takes(x2, view: QArray, group: int | None, has_zero_point: bool, fp8: bool = False) -> bool:
    """Whether a prompt's int8 (``fp8``: E4M3) W8A8 product (more rows than a decode step's) over K-major weights
    goes to the Mosaic GPU kernel (``pallas_kernels.w8a8_hopper``: wgmma kept in flight, Hopper only) rather than
    the Triton kernel: where the active or shipped dispatch table measured it faster than that kernel (kernel
    ``w8a8_hopper`` / ``fp8_w8a8_hopper``). Unmeasured, the Triton kernel: the Mosaic one is not timed on a GPU
    yet."""
    k, n = view.shape
    if x2.shape[0] <= GPU_KMAJOR_MAX_ROWS:
        return False
    if not w8a8_hopper.can_use(x2.shape, x2.dtype, view.qvalue.dtype, k, n, group, has_zero_point, fp8=fp8)[0]:
        return False
    kernel = "fp8_w8a8_hopper" if fp8 else "w8a8_hopper"
    return dispatch_table.choice(table_key(kernel, x2.shape[0], x2.dtype, view, group)) == "pallas"


def hopper_weight_only_bits(view: QArray) -> int | None:
    """The codes :mod:`pallas_kernels.weight_only_hopper` reads as ``view`` stores them: 8 (int8-stored, 5..8 bits),
    4 (int4 pairs packed along the input dim), or None."""
    if not is_packed(view.bits):
        return 8
    return 4 if view.bits == 4 and view.pack_axis == 0 else None


def hopper_weight_only_takes(x2, view: QArray, group: int | None) -> bool:
    """Whether a prompt's weight-only product (more rows than a decode step's) over ``(in, out)`` codes, int8-stored
    or int4 pairs, goes to the Mosaic GPU kernel (``pallas_kernels.weight_only_hopper``: each tile dequantized into
    shared memory, then bf16 / f16 wgmma; Hopper only): where the active or shipped dispatch table measured it faster
    than XLA's path (kernel ``weight_only_hopper``), the path such a product takes today (the Triton weight-only
    kernel lost to it at every prompt row count measured). Unmeasured, XLA's path: the kernel is not timed on a GPU
    yet."""
    k, n = view.shape
    bits = hopper_weight_only_bits(view)
    if x2.shape[0] <= GPU_KMAJOR_MAX_ROWS or bits is None:
        return False
    if not weight_only_hopper.can_use(x2.shape, x2.dtype, view.qvalue.dtype, k, n, group, bits=bits)[0]:
        return False
    return dispatch_table.choice(table_key("weight_only_hopper", x2.shape[0], x2.dtype, view, group)) == "pallas"


# the table kernel of the Mosaic GPU decode kernel for each kind of product plan() gives
DECODE_HOPPER_KERNELS = {"weight_only": "decode_hopper", "w8a8": "w8a8_decode_hopper",
                         "fp8_w8a8": "fp8_w8a8_decode_hopper"}


def hopper_decode_takes(rows: int, x_dtype, w: QArray, group: int | None, kind: str = "weight_only") -> bool:
    """Whether a decode step's product of ``rows`` rows with the kernel ``w`` (``(in, out)``) of ``plan``'s ``kind``
    goes to the Mosaic GPU decode kernel (``pallas_kernels.decode_hopper``, Hopper only): where the active or shipped
    table measured or inferred it faster than the path it replaces (its kernel in :data:`DECODE_HOPPER_KERNELS`).
    Weight-only int4: the faster of the word kernel and XLA's path; int8: of the K-major Triton kernels and XLA's
    path (``scripts/bench_kernels.py`` kinds ``w4_decode_hopper`` / ``w8_decode_hopper``); W8A8, int8 or FP8 with
    per-channel scales (``w8a8_decode_hopper`` / ``fp8_decode_hopper``): of the K-major Triton W8A8 kernel and XLA's
    path. Unmeasured, the Triton kernels: the Mosaic one is not timed on a GPU yet."""
    k, n = w.shape
    codes = jnp.int4 if is_packed(w.bits) else jnp.int8
    x_shape = (min(rows, decode_hopper.MAX_ROWS), k)
    if rows > decode_hopper.MAX_ROWS or not decode_hopper.can_use(x_shape, x_dtype, codes, k, n, group)[0]:
        return False
    if kind != "weight_only" and (group is not None or w.zero_point is not None):
        return False  # W8A8 decode takes per-channel symmetric weights (its scales applied after the sums)
    kernel = DECODE_HOPPER_KERNELS[kind]
    return dispatch_table.choice(table_key(kernel, rows, x_dtype, w, group)) == "pallas"


def _as_stored(view: QArray, scale, zp):
    """The scale and zero points the Mosaic decode kernel reads: as the QArray stores them where that is already
    ``(…, G, N)`` (read in place, converted in registers), else ``_layout``'s broadcast."""
    return (view.scale, view.zero_point) if view.scale.shape == scale.shape else (scale, zp)


def linear_rows(x, w: QArray, require: bool = False, layer=None):
    """``x @ w`` for a ``decode_layout.Int4RowKernel``'s QArray (its codes ``(out, in)`` int4) at decode rows: the
    Mosaic GPU decode kernel, no table lookup (``decode_layout.for_decode`` consulted it when it made the rows); or
    None where it cannot run (an error if ``require``): XLA's path of the packed codes."""
    if not config.kernels_available():
        return _unavailable(require)
    k, n = w.shape
    x2 = x.reshape(-1, k)
    group, scale, zp, _ = _layout(w)
    if scale is not None:
        scale, zp = _as_stored(w, scale, zp)
    ok, why = decode_hopper.can_use(x2.shape, x2.dtype, w.qvalue.dtype, k, n, group)
    if scale is None or not ok or w.act_spec is not None:
        if require:
            raise KernelUnavailable(f"decode_hopper does not take x {tuple(x.shape)} {x.dtype} @ {w!r}: "
                                    f"{why or 'weight-only kernels with scales per input group only'}")
        return None
    y = decode_hopper.decode_hopper(x2, w.qvalue, scale, zero_point=zp, group=group, layer=layer)
    return y.reshape(*x.shape[:-1], n)


def linear_words(x, w: QArray, require: bool = False, layer=None, norm=None, residual=None, act=None):
    """``x @ w`` for a ``decode_layout.Int4WordKernel``'s QArray (its codes as ``pallas_kernels.int4_words``
    words), or None (an error if ``require``). Decode rows (up to ``decode_layout.GPU_KMAJOR_MAX_ROWS``): the word
    kernel, no table lookup (``decode_layout.for_decode`` consulted it when it made the words). A prompt's rows:
    the prompt kernel over the same words where :func:`prompt_words_take` (or ``require``, half activations) sends
    them, else None (XLA's path of the packed codes; with ``require`` and float32 activations, the word kernel).
    ``norm`` (``pallas_kernels.norm_fold.NormFold``) / ``residual`` (x's rows by w's outputs): ``rms_norm(x) @ w`` /
    ``residual + x @ w`` by the decode word kernel, which folds the norm / adds the residual, or None
    where another path would take the product (:func:`words_decode_takes`). ``act`` "swiglu": a paired gate/up
    kernel's product gated (``int4_words_matmul``'s ``act``), half as many outputs."""
    if not config.kernels_available():
        return _unavailable(require)
    if norm is not None or residual is not None or act is not None:
        if not words_decode_takes(x.shape, x.dtype, w):
            return None
        k, n = w.shape
        group, scale, zp, _ = _layout(w)
        y = int4_words.int4_words_matmul(x.reshape(-1, k), w.qvalue, scale, group=group, w_zero_point=zp,
                                         layer=layer, norm=norm, act=act,
                                         residual=None if residual is None else residual.reshape(-1, n))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    kind, why = plan(x.shape, x.dtype, w, None)
    if kind != "weight_only" or w.act_spec is not None:
        if require:
            raise KernelUnavailable(f"no Pallas kernel takes x {tuple(x.shape)} {x.dtype} @ int4 words {w!r}: "
                                    f"{why or 'weight-only kernels only'}")
        return None
    k, n = w.shape
    rows = math.prod(x.shape[:-1])
    group, scale, zp, _ = _layout(w)
    matmul = int4_words.int4_words_matmul
    if rows > GPU_KMAJOR_MAX_ROWS:
        half = jnp.dtype(x.dtype) in int4_words_prefill.HALF_DTYPES
        if prompt_words_take(rows, x.dtype, w, group) or require and half:
            matmul = int4_words_prefill.int4_words_prefill
        elif not require:
            return None
    y = matmul(x.reshape(-1, k), w.qvalue, scale, group=group, w_zero_point=zp, layer=layer)
    return y.reshape(*x.shape[:-1], n)


def folds_norm(x) -> bool:
    """Whether a norm of ``x`` may be left for the products after it to fold (``llmeq_jax.normed_rows``): a decode
    step's rows where the Pallas kernels run on a GPU (traced for one, interpret mode included) and the fold may
    run there: it has not run on a GPU yet, so only where ``LLMEQ_UNCHECKED_KERNELS`` names it
    (``pallas_kernels.hardware_checked``: ``norm_fold``). bfloat16 or float32 x: the kernels' operand is then x times
    the scale before the norm factor, which float16 (largest value 65504) could overflow where the norm's output
    would not."""
    rows = math.prod(x.shape[:-1])
    return (config.kernels_available() and 0 < rows <= GPU_KMAJOR_MAX_ROWS
            and jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
            and config.on_gpu() and hardware_checked.allowed("norm_fold"))


def words_decode_takes(x_shape, x_dtype, w: QArray) -> bool:
    """Whether :func:`linear_words` with a norm or a residual takes ``x @ w``: the decode word kernel's product."""
    rows = math.prod(x_shape[:-1])
    return (0 < rows <= GPU_KMAJOR_MAX_ROWS and w.act_spec is None
            and plan(x_shape, x_dtype, w, None)[0] == "weight_only")


def linear_float(x, stack, layer, force: bool = False, norm=None, residual=None):
    """``x @ stack[layer]`` for a stacked float kernel ``[L, in, out]`` by ``pallas_kernels.float_matmul``
    (reading the layer in place), or None (XLA's slice-and-dot then). The kernel takes a product it can
    (decode rows, one float dtype) where the active or shipped dispatch table measured it faster than
    XLA's path (kernel ``float``), with ``force`` (``backend="pallas"``), and, where no table measured the
    product, on a GPU: there XLA copies the layer's slice out of the stack before its GEMM, every decode
    step (``scripts/gpu_aot.py``: a 404 MB copy per Llama-2-7B layer and token, three passes over the
    weights where one is needed). Interpret mode keeps XLA's path unless a table or ``force`` says
    otherwise (the CPU tests' stacked float models stay fast). Float products never require a kernel:
    where none applies this is None, not an error. ``norm`` (``pallas_kernels.norm_fold.NormFold``):
    ``rms_norm(x) @ stack[layer]``, the kernel folding the norm, where it takes the product (else None);
    ``residual`` (x's rows by the outputs): ``residual + x @ stack[layer]``, added by the kernel."""
    if not float_kernel_takes(x.shape, x.dtype, stack, force):
        return None  # XLA's slice-and-dot
    k, n = stack.shape[1:]
    y = float_matmul.float_matmul(x.reshape(-1, k), stack, layer=layer, norm=norm,
                                  residual=None if residual is None else residual.reshape(-1, n))
    return y.reshape(*x.shape[:-1], n)


def float_kernel_takes(x_shape, x_dtype, stack, force: bool = False) -> bool:
    """Whether :func:`linear_float` gives ``x @ stack[layer]`` to the float kernel (its doc: where)."""
    if not config.kernels_available():
        return False
    k, n = stack.shape[1:]
    rows = math.prod(x_shape[:-1])
    if not float_matmul.can_use((rows, k), x_dtype, stack.dtype)[0]:
        return False
    key = dispatch_table.Key(config.target_device().device_kind, "float", 8 * jnp.dtype(stack.dtype).itemsize, None, k, n,
                             dispatch_table.row_bucket(rows), jnp.dtype(x_dtype).name)
    measured = dispatch_table.choice(key)
    return force or measured == "pallas" or (measured is None and config.on_gpu())


def rms_norm(x, scale, eps: float, layer=None, force: bool = False):
    """RMSNorm of ``x`` by ``pallas_kernels.rms_norm`` (one kernel where XLA launches two at batch 1), or None
    (XLA's then). ``scale``: (K,), or with ``layer`` a stack (L, K) read in place. Taken at decode rows where
    the active or shipped dispatch table measured it faster than XLA's norm (kernel ``rms_norm``), on a GPU where
    no table measured it once it passed its gpu cases on one (``pallas_kernels.hardware_checked``: not yet), and
    with ``force``; interpret mode keeps XLA's norm unless forced (the CPU tests' models stay as they were)."""
    if not config.kernels_available():
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if not norm_kernel.can_use(x2.shape, x.dtype)[0]:
        return None
    key = dispatch_table.Key(config.target_device().device_kind, "rms_norm", 32, None, k, k,
                             dispatch_table.row_bucket(x2.shape[0]), jnp.dtype(x.dtype).name)
    measured = dispatch_table.choice(key)
    unmeasured = measured is None and config.on_gpu() and hardware_checked.allowed("rms_norm")
    if not (force or measured == "pallas" or unmeasured):
        return None
    return norm_kernel.rms_norm(x2, scale, eps, layer=layer).reshape(x.shape)


def linear(x, w: QArray, act=None, require: bool = False, layer=None, *, w_layout: str = "kn", residual=None,
           norm=None, swiglu: bool = False):
    """``x @ w`` by a Pallas kernel, or None when none applies (an error if ``require``); with ``residual`` (x's rows
    by the outputs), ``residual + x @ w``, added by the Triton kernels where they finish their products
    (``pallas_kernels.split_fixup``), else after the product. ``norm`` (``pallas_kernels.norm_fold.NormFold``):
    ``rms_norm(x) @ w`` where the product goes to the int8 float16-operand kernel and it folds the norm
    (``int8_f16.folds``) or to the W8A8 kernel with its activation codes made by ``pallas_kernels.token_codes``
    (:func:`codes_made_by_kernel`), the norm's too, else None (the caller evaluates the norm; not with ``require``).
    ``swiglu``: ``w``'s outputs pair a SwiGLU's gate and up (``decode_layout.pair_swiglu``) and ``silu(gate) * up``
    comes back, gated by the weight-only or W8A8 Triton kernels as they finish their tiles, or None where the product
    goes to another kernel or XLA (the caller gates the paired product; not with ``require`` or a residual).

    With ``layer``, ``w`` is a stack of kernels (``llmeq_jax.layer_slice.LayerSlice``) and the
    product is with its layer ``layer``, read in place. ``w_layout="nk"``: ``w`` is stored K-major,
    ``(out, in)``; its int8-stored products go to the kernels reading it as stored (packed codes: None)."""
    if not config.kernels_available():
        return _unavailable(require)
    if norm is not None and require:
        raise ValueError("kernel_dispatch.linear: a folded norm is taken where a kernel folds it, never required")
    if swiglu and (require or residual is not None):
        raise ValueError("kernel_dispatch.linear: a SwiGLU gate is taken where a kernel gates, never required, and "
                         "without a residual")
    view = logical_view(w) if w_layout == "nk" else w
    if w_layout == "nk" and is_packed(w.bits):
        kind, why = None, f"int{w.bits} codes stored K-major (the kernels read K-major int8 only)"
    else:
        kind, why = plan(x.shape, x.dtype, view, act)
    if kind is None:
        if require:
            raise KernelUnavailable(f"no Pallas kernel takes x {tuple(x.shape)} {x.dtype} @ {w!r}: {why}")
        return None
    k, n = view.shape
    x2 = x.reshape(-1, k)
    r2 = None if residual is None else residual.reshape(-1, n)

    def done(y, added: bool = False):  # x's leading dims back, the residual added where the kernel did not
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if residual is None or added else residual + y

    group, scale, zp, _ = _layout(view)
    path = _linear_path(kind, x2, view, group, w_layout, zp is not None, require)
    coded = path == "w8a8" and token_codes.can_use(x2.shape, x.dtype)[0] and codes_made_by_kernel(w, x2.shape[0])
    if norm is not None and not ((path == "int8_f16" and int8_f16.folds(x2.shape[0], x.dtype)) or coded):
        return None  # no kernel that folds the norm takes the product
    if swiglu and path not in ("int8_f16", "weight_only", "w8a8"):
        return None  # no kernel that gates takes the product
    fp8 = kind == "fp8_w8a8"
    if path == "xla":
        return None  # XLA's path: measured faster on this device, or a small product no table measured
    if path == "weight_only_hopper":
        y = weight_only_hopper.weight_only_hopper(x2, w.qvalue, scale, zero_point=zp, group=group, layer=layer,
                                                  bits=hopper_weight_only_bits(view))
        return done(y)
    if path == "decode_hopper":  # a decode step's K-major int8 product
        scale, zp = _as_stored(view, scale, zp)
        y = decode_hopper.decode_hopper(x2, w.qvalue, scale, zero_point=zp, group=group, layer=layer)
        return done(y)
    if path == "w8a8_decode_hopper":  # a decode step's K-major W8A8 product
        y = decode_hopper.w8a8_decode_hopper(x2, w.qvalue, scale, act_scale=_act_scale(w, layer), layer=layer, fp8=fp8)
        return done(y)
    if path == "w8a8_hopper":
        return done(w8a8_hopper.w8a8_hopper(x2, w.qvalue, scale, act_scale=_act_scale(w, layer), layer=layer, fp8=fp8))
    if path == "w8a8":
        codes = (token_codes.token_codes(x2, norm=norm, layer=layer if norm is not None else None, fp8=fp8)
                 if coded else None)
        y = w8a8.w8a8_matmul(x2, w.qvalue, scale, w_zero_point=zp, act_scale=_act_scale(w, layer), group=group,
                             layer=layer, fp8=fp8, w_layout=w_layout, residual=r2, codes=codes,
                             act="swiglu" if swiglu else None)
    else:
        bits = 4 if is_packed(w.bits) else 8
        dequant = "f16" if path == "int8_f16" else None
        y = weight_only.weight_only_matmul(x2, w.qvalue, scale, bits=bits, w_zero_point=zp, group=group, layer=layer,
                                           w_layout=w_layout, dequant=dequant, residual=r2, norm=norm,
                                           act="swiglu" if swiglu else None)
    return done(y, added=True)


def _linear_path(kind: str, x2, view: QArray, group: int | None, w_layout: str, has_zero_point: bool,
                 require: bool) -> str:
    """Which kernel :func:`linear` hands ``x2 @ view`` to (``kind`` from :func:`plan`): "weight_only_hopper",
    "decode_hopper", "w8a8_decode_hopper", "w8a8_hopper", "w8a8", "int8_f16" (the weight-only kernel with float16
    operands), "weight_only", or "xla" where a table measured XLA faster. Decided once, so that what takes a folded
    norm and what runs the product cannot drift apart. ``require`` keeps to the portable kernels."""
    rows, packed = x2.shape[0], is_packed(view.bits)
    weight_only_kind = kind == "weight_only"
    if not require:
        if weight_only_kind and w_layout == "kn" and hopper_weight_only_takes(x2, view, group):
            return "weight_only_hopper"
        if weight_only_kind and w_layout == "nk" and not packed and hopper_decode_takes(rows, x2.dtype, view, group):
            return "decode_hopper"
        if not weight_only_kind and w_layout == "nk" and hopper_decode_takes(rows, x2.dtype, view, group, kind):
            return "w8a8_decode_hopper"
        measured_as = f"{kind}_nk" if w_layout == "nk" else kind  # K-major: another kernel, measured apart
        if not kernel_takes(measured_as, rows, x2.dtype, view, group):
            return "xla"
        if not weight_only_kind and w_layout == "nk" \
                and hopper_w8a8_takes(x2, view, group, has_zero_point, fp8=kind == "fp8_w8a8"):
            return "w8a8_hopper"
    if not weight_only_kind:
        return "w8a8"
    return "int8_f16" if _float16_operands(x2, view, group, w_layout) else "weight_only"


def codes_made_by_kernel(w: QArray, rows: int) -> bool:
    """Whether the activation codes of a W8A8 product over ``w`` at ``rows`` rows come from
    ``pallas_kernels.token_codes`` (one launch, a norm before them folded in) rather than XLA's three fusions: int8
    or E4M3 codes with dynamic per-token scales (not a static scale), a decode step's rows, on a GPU (or traced
    for one) where the kernel may run (``hardware_checked``: ``token_codes``, not yet run on one), unless the
    setting ``w8a8:codes=xla`` says otherwise. Interpret mode keeps XLA's quantization (the CPU tests' models stay
    as they were) unless traced for a GPU. The kernel's own limits on x's shape are :func:`linear`'s to check."""
    return (w.act_spec is not None and w.act_spec.granularity == "token" and w.act_scale is None
            and 0 < rows <= token_codes.MAX_ROWS and config.on_gpu() and hardware_checked.allowed("token_codes")
            and settings.of("w8a8", rows).codes != "xla")


def _float16_operands(x2, view: QArray, group: int | None, w_layout: str) -> bool:
    """Whether a K-major int8 weight-only product runs with float16 operands (``pallas_kernels.int8_f16``:
    half the instructions per weight of the kernel with x's dtype, sm_90 SASS): for half-precision x and
    per-channel scales, unless a measured table found it slower than that kernel (kernel ``int8_f16``)."""
    if w_layout != "nk" or is_packed(view.bits) or group is not None or jnp.dtype(x2.dtype) == jnp.float32:
        return False
    return dispatch_table.choice(table_key("int8_f16", x2.shape[0], x2.dtype, view, group)) != "xla"
