"""The one place where a matmul meets a QArray (DESIGN §2).

Models call :func:`linear` for every matmul with a float kernel or a QArray of
shape ``(in, out)``; the weight decides the path:

* plain array          -> ``x @ w`` (on a CPU, a bfloat16 kernel or one layer of a stacked kernel at
  decode's few rows goes to the native float GEMV instead: ``NATIVE_MAX_ROWS``)
* QArray, no act spec  -> weight-only: integer values are dequantized inside
  the jitted computation. For up to ``SMALL_M`` rows (decode, short prompts)
  on CPU the product is a scan over row chunks of the kernel: each chunk is
  dequantized while it is in cache and multiplied at once, so memory streams
  the packed bytes only, never a float copy of the whole kernel (measured in
  ``scripts/bench_core.py``: at M=1 this beats the fp32 GEMV, where a full
  dequantize-then-matmul or a multiply-reduce was 6x to 100x slower).
* QArray with act spec -> W8A8: activations quantized per token (dynamic) or
  with a static per-tensor scale, ``int8 x int8 -> int32`` through
  ``lax.dot_general(preferred_element_type=int32)``, then rescaled by the
  activation and weight scales (per group, when the weight is grouped).

A Pallas kernel takes over when one applies (``backend="auto"`` on a GPU), and
on a CPU a native C++ kernel (:mod:`llmeq_jax.native`) when the table
``NATIVE_MAX_ROWS`` (measured by ``scripts/bench_native.py``) says it is faster
than the XLA path for that many rows; ``"xla"`` forces the fallback.

:func:`linear_nk` is the transposed door, ``x @ dequantize(w).T`` for a ``(out, in)``
matrix whose rows are contiguous (the embedding table used as the LM head).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from llmeq_jax import kernel_dispatch, subchannel
from llmeq_jax.core import fp8grid
from llmeq_jax.core.qarray import QArray, is_packed, packed_length, packing, unpack
from llmeq_jax.core.quantize import Spec, largest_value
from llmeq_jax.decode_layout import Int4RowKernel, Int4WordKernel, PanelKernel, RowMajorKernel, kernel_view, \
    unpack_panels
from llmeq_jax.layer_slice import LayerSlice
from llmeq_jax.normed_rows import NormedRows
from pallas_kernels import config as kernel_config

# Up to this many rows of activations, weight-only avoids materialising the
# dequantized kernel (chunked scan on CPU, multiply-reduce elsewhere).
SMALL_M = 64
# Kernel rows dequantized per scan step: 64 x 4096 floats (1 MiB) stay in cache;
# 16-256 measured within noise of each other on a 2-core CPU, 1024 was slower.
CHUNK_ROWS = 64
BACKENDS = ("auto", "xla", "pallas")
# Native CPU kernels take a product with at most this many rows of activations, per
# kind (0: never). Measured on SmolLM2-135M's whole decode loop (one jit, so no per-call
# dispatch in the figures; 2-core CPU, batch 1): with the row-streaming weight-only
# kernel, rtn-w8 XLA 21.9 -> native 26.4 tok/s, rtn-w4-g128 12.1 -> 36.9, rtn-w8a8
# 27.2 -> 48.3 (fp32 25.4). Beyond 8 rows (prefill, perplexity) XLA's GEMMs win
# (scripts/bench_native.py --rows 512). Raised since, on measurements of batched decode:
# "attention": decode attention over a float cache (kv.attention.native_attention_ok), batch x
# positions; at 16 (batch-16 decode, SmolLM2-135M, 2-core Xeon) the kernel took fp32 / rtn-w4-g128 /
# rtn-w8a8 from 248 / 311 / 387 tok/s with XLA's attention to 266 / 342 / 456; at batch 32 fp32 /
# rtn-w8 / rtn-w4-g128 / rtn-w8a8 from 248 / 291 / 300 / 370 to 325 / 384 / 385 / 470, at batch 64
# fp32 / rtn-w8 / rtn-w8a8 from 292-295 / 302-318 / 363-402 to 366 / 425 / 560.
# "row_major_vnni": weight-only row-major products on a CPU with AVX-512 VNNI (row_major_max_rows).
# Their tiles form 4 activation rows' sums per decoded weight vector, and batch-16 decode of
# SmolLM2-135M ran rtn-w8 / rtn-w4-g128 at 269 / 264 tok/s there against 169 / 156 through XLA and
# 247 / 210 through the dequantized panels (fp32 253-259; 2-core Xeon, docs/cpu-speed.md); at 32
# rows the panels won (325 / 329 against 301 / 295). W8A8 keeps "row_major": past it the VNNI GEMM
# (any rows, below) was as fast at 16 rows and faster at 32.
NATIVE_MAX_ROWS = {"int8": 8, "int4": 8, "w8a8": 8, "nk": 8, "row_major": 8, "row_major_vnni": 16, "attention": 64,
                   "float_layer": 16, "bfloat16": 16}
# ...except W8A8 on a CPU with AVX-512 VNNI: its native GEMM (vpdpbusd) beats XLA's float
# and int8 dots at every row count (512 rows, SmolLM2's shapes, 2-core Xeon: 2.6-3.2x XLA's
# fp32 dot, whose int8 dot ran 0.8-0.9x; docs/cpu-speed.md), so it takes any number of rows there;
# And weight-only int8 / int4 on AVX-512 past NATIVE_PANEL_MIN_ROWS rows (kWoPanelMinRows in
# native/cpu_kernels.cc): those run the float panel GEMM on slices dequantized in cache (XLA
# dequantized the whole kernel to memory first). Past 8 rows (the row-streaming kernels' limit):
# batch-16 / 32 decode of SmolLM2-135M in the (in, out) layout ran rtn-w8 at 247 / 325 tok/s on the
# panels against 169 / 232 through XLA, rtn-w4-g128 210 / 329 against 156 / 214, and a 64-token
# prefill at 0.82-0.85x fp32 against 0.44-0.48x (2-core Xeon).
NATIVE_PANEL_MIN_ROWS = 8
# Float kernels go to the native float GEMV (native.float_matmul) at few rows where it beat XLA:
# "float_layer", one layer of a stacked kernel inside the scan over stacked blocks (XLA copies the
# layer's slice out of the stack before its dot); "bfloat16", any bfloat16 kernel (XLA:CPU's bf16
# dot converts the whole kernel to float32 first). Measured by scripts/bench_native.py --float --cache-mb 600
# (2-core Xeon, weights from DRAM; Llama-2-7B's 4096x11008 / 11008x4096, time vs XLA's float32 dot of
# a kernel of its own): a stack's layer through XLA 0.12x at 1 row, 0.27-0.35x at 8-16, natively
# 1.03-1.05x / 1.13-1.85x; bf16 through XLA 0.12-0.38x, natively 1.72x at 1 row, 1.01-1.82x at 8-16.
# A float32 kernel of its own stays on XLA: natively 0.86x at 1 row there (1.1-1.6x at 8-16 rows).
# Rows of a (out, in) matrix dequantized per scan step by linear_nk_xla at few rows:
# 256 x 576 floats (0.6 MB) stay in L2; the 49k-row head never exists as floats.
NK_CHUNK_ROWS = 256
# Rows up to which a GPU's few-row K-major product is XLA's one multiply-reduce (_nk_reduce): a decode step's
# (each output reads its row of codes once a row of x; past that a GEMM's reuse wins)
GPU_REDUCE_MAX_ROWS = 16


def _check_shapes(x: jax.Array, w: Any) -> None:
    if len(w.shape) != 2:
        raise ValueError(f"linear expects an (in, out) kernel, got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features but the kernel expects {w.shape[0]} (kernel {tuple(w.shape)})"
        )


def linear(
    x: jax.Array,
    w: jax.Array | QArray,
    bias: jax.Array | None = None,
    *,
    act: Spec | None = None,
    backend: str = "auto",
    residual: jax.Array | None = None,
) -> jax.Array:
    """``x @ w + bias`` for a float or quantized ``(in, out)`` kernel; output in ``x.dtype``.

    ``act`` overrides the activation spec carried by a QArray weight. ``residual`` (x's leading dims by the
    outputs): ``residual + (x @ w + bias)``, a decoder block's residual stream -- added by a decode step's float,
    int4 word or int8 kernel where it finishes its product itself (``pallas_kernels.split_fixup``), else after;
    the same numbers either way (the product rounded to x's dtype, then the add), as the caller's own add.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {list(BACKENDS)}")
    _check_shapes(x, w)
    if residual is not None:
        if residual.shape != (*x.shape[:-1], w.shape[1]):
            raise ValueError(f"linear: the residual must be {(*x.shape[:-1], w.shape[1])} (x's rows by the "
                             f"outputs), got {tuple(residual.shape)}")
        y = _linear_into(x, w, bias, residual, backend)
        return y if y is not None else residual + linear(x, w, bias, act=act, backend=backend)
    if isinstance(x, NormedRows):  # a norm left for its products (models.layers.RMSNorm(fold=True))
        y = _linear_folded(x, w, backend)
        if y is not None:
            return y if bias is None else y + bias.astype(y.dtype)
        x = x.value()
    if isinstance(w, RowMajorKernel):
        y = _linear_row_major(x, w, act if act is not None else w.w.act_spec, backend)
        return y if bias is None else y + bias.astype(y.dtype)
    if isinstance(w, (Int4WordKernel, Int4RowKernel)):
        y = _linear_int4_layout(x, w, backend)
        return y if bias is None else y + bias.astype(y.dtype)
    if isinstance(w, PanelKernel):
        y = _linear_panels(x, w, backend)
        return y if bias is None else y + bias.astype(y.dtype)
    if isinstance(w, LayerSlice):
        from pallas_kernels import prefetch  # where asked, the layer's weights read ahead (decode, on a GPU)

        y = _linear_layer_slice(prefetch.before(x, w), w, act, backend)
        prefetch.after(y)
        return y if bias is None else y + bias.astype(y.dtype)
    if not isinstance(w, QArray):
        y = _try_native_float(x, w) if backend == "auto" else None
        if y is None:
            y = jnp.matmul(x, w.astype(x.dtype))
    elif w.grid == "log2":  # log2 codes: no integer kernel applies, dequantize inside the jit
        y = jnp.matmul(x, w.dequantize(x.dtype))
    else:  # uniform integer codes, or fp8 (E4M3) ones: FP8 dots with fp8 activations, else dequantized
        act = act if act is not None else w.act_spec
        y = None
        if backend != "xla":
            y = _try_pallas(x, w, act, backend)
        if y is None and backend == "auto":
            y = _try_native(x, w, act)
        if y is None:
            y = w8a8_xla(x, w, act) if act is not None else weight_only_xla(x, w)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def _linear_folded(x: NormedRows, w, backend):
    """``rms_norm(...) @ w`` by a kernel that folds the norm in (``pallas_kernels.norm_fold``) -- the float kernel,
    the int4 word kernel or the int8 float16-operand kernel over K-major codes, reading the norm's layer of the
    stacked weights -- or None where none takes it."""
    kernel = _decode_kernel(x, w, backend)
    norm = _norm_to_fold(x, w, kernel)
    if norm is not None:
        return _run_decode_kernel(kernel, x.x, w, backend, norm=norm)
    return _int8_folded(x, w, backend)


def _int8_folded(x: NormedRows, w, backend):
    """``rms_norm(...) @ w`` for a stacked layer of K-major int8 codes: weight-only (rtn-w8's decode) by
    ``pallas_kernels.int8_f16``, folding the norm, or W8A8 by ``pallas_kernels.token_codes``, which makes the
    activation codes of the norm's output, where kernel_dispatch sends the product there; else None."""
    if (backend == "xla" or not isinstance(w, LayerSlice) or not isinstance(w.stack, RowMajorKernel)
            or w.stack.split):
        return None
    norm = _norm_to_fold(x, w, _int8_kernel(w.stack))
    # (no read-ahead, pallas_kernels.prefetch: whether the kernel takes the product is known only after the call)
    return None if norm is None else kernel_dispatch.linear(x.x, w.stack.w, w.stack.w.act_spec, layer=w.layer,
                                                            w_layout="nk", norm=norm)


def _int8_kernel(stack: RowMajorKernel) -> str:
    """The kernel whose settings (``norm``) govern a K-major int8 product: "int8_f16" (weight-only) or "w8a8"."""
    return "int8_f16" if stack.w.act_spec is None else "w8a8"


def _norm_to_fold(x, w, kernel: str | None):
    """The norm (``pallas_kernels.norm_fold.NormFold``) that :func:`_decode_kernel`'s ``kernel`` folds into ``x @ w``
    where ``x`` is a norm's unevaluated output and the kernel may fold it (setting ``norm``), else None."""
    from pallas_kernels import settings

    if kernel is None or not isinstance(x, NormedRows):
        return None
    norm = x.fold_for(w.layer)
    return None if norm is None or settings.of(kernel, math.prod(x.shape[:-1])).norm == "apart" else norm


def _linear_into(x, w, bias, residual, backend):
    """``residual + x @ w`` by the decode float kernel, int4 word kernel or K-major weight-only int8 kernels
    (reading ``w``'s layer in place), which add the residual themselves (to the product rounded, as the add after
    it would); or None where none takes the product, or there is a bias."""
    if isinstance(x, NormedRows) or bias is not None:  # (a bias: added after the rounded product, as before)
        return None
    kernel = _decode_kernel(x, w, backend)
    if kernel is not None:
        return _run_decode_kernel(kernel, x, w, backend, residual=residual)
    if (backend != "xla" and isinstance(w, LayerSlice) and isinstance(w.stack, RowMajorKernel)
            and not w.stack.split and (w.stack.w.act_spec is None
                                       or kernel_dispatch.codes_made_by_kernel(w.stack.w, math.prod(x.shape[:-1])))):
        # the int8 kernels over K-major codes (W8A8 only where pallas_kernels.token_codes makes the next product's
        # codes from the residual stream as written: XLA's quantization, fused with the add, keeps excess float32
        # precision across it, which the next product's codes would follow, and a kernel's add cannot)
        from pallas_kernels import prefetch

        y = kernel_dispatch.linear(prefetch.before(x, w), w.stack.w, w.stack.w.act_spec, layer=w.layer,
                                   w_layout="nk", residual=residual)
        prefetch.after(y)
        return y
    return None


def _decode_kernel(x, w, backend) -> str | None:
    """The decode kernel that takes ``x @ w`` for a stacked layer ``w`` (a :class:`LayerSlice`) with a norm to fold
    or a residual to add: "float_matmul", "int4_words", or None (another path)."""
    if backend == "xla" or not isinstance(w, LayerSlice):
        return None
    if isinstance(w.stack, jax.Array) and kernel_dispatch.float_kernel_takes(x.shape, x.dtype, w.stack,
                                                                             backend == "pallas"):
        return "float_matmul"
    if (isinstance(w.stack, Int4WordKernel) and kernel_config.kernels_available()
            and kernel_dispatch.words_decode_takes(x.shape, x.dtype, w.stack.w)):
        return "int4_words"
    return None


def _run_decode_kernel(kernel: str, x, w: LayerSlice, backend, **extra):
    """:func:`_decode_kernel`'s ``kernel`` on ``x @ w`` (``extra``: its norm, residual, act), with the read-ahead
    of ``pallas_kernels.prefetch`` where asked."""
    from pallas_kernels import prefetch

    x = prefetch.before(x, w)
    if kernel == "float_matmul":
        y = kernel_dispatch.linear_float(x, w.stack, w.layer, force=backend == "pallas", **extra)
    else:
        y = kernel_dispatch.linear_words(x, w.stack.w, layer=w.layer, **extra)
    prefetch.after(y)
    return y


def _linear_layer_slice(x, w: LayerSlice, act, backend):
    """One layer of a stacked kernel, read in place from the stack where a Pallas kernel or the native
    row-major kernel applies; every other path takes the layer's slice (a copy, for a custom call)."""
    if isinstance(w.stack, jax.Array):  # a float kernel: the Pallas float kernel where a table chose it
        if backend != "xla":
            y = kernel_dispatch.linear_float(x, w.stack, w.layer, force=backend == "pallas")
            if y is not None:
                return y
        y = _try_native_float(x, w.stack, w.layer) if backend == "auto" else None
        return y if y is not None else linear(x, w.value(), act=act, backend=backend)
    if isinstance(w.stack, RowMajorKernel):
        return _linear_row_major(x, w.stack, act if act is not None else w.stack.w.act_spec, backend, w.layer)
    if isinstance(w.stack, (Int4WordKernel, Int4RowKernel)):
        return _linear_int4_layout(x, w.stack, backend, w.layer)
    if backend != "xla" and w.stack.grid != "log2":
        y = kernel_dispatch.linear(x, w.stack, act if act is not None else w.stack.act_spec, layer=w.layer)
        if y is not None:
            return y
    return linear(x, w.value(), act=act, backend=backend)


def _native_float_rows_ok(x, w_dtype, stacked: bool) -> bool:
    """Whether ``NATIVE_MAX_ROWS`` gives the native float GEMV ``x @ w`` for a float kernel of ``w_dtype``
    (``stacked``: one layer of a stack, read in place)."""
    rows = math.prod(x.shape[:-1])
    if rows == 0 or not jnp.issubdtype(x.dtype, jnp.floating) or w_dtype not in (jnp.float32, jnp.bfloat16):
        return False
    limit = max(NATIVE_MAX_ROWS["bfloat16"] if w_dtype == jnp.bfloat16 else 0,
                NATIVE_MAX_ROWS["float_layer"] if stacked else 0)
    return rows <= limit


def _try_native_float(x, w, layer=None):
    """The native float GEMV's ``x @ w`` (``w[layer]`` of a stack) where ``_native_float_rows_ok`` lets it
    take the product on a CPU, else None."""
    if kernel_config.target_backend() != "cpu" or not _native_float_rows_ok(x, w.dtype, layer is not None):
        return None
    from llmeq_jax import native

    # One device only (native.prefill_kernels_ok): a float model sharded over several devices kept
    # XLA's sharded dot; the SPMD partitioner would gather a custom call's operands.
    if not (native.enabled() and native.prefill_kernels_ok()):
        return None
    return native.float_matmul(x, w, layer=layer)


def _try_pallas(x, w, act, backend):
    """A Pallas kernel's result when one can take this product, else None (XLA fallback)."""
    return kernel_dispatch.linear(x, w, act, require=(backend == "pallas"))


def _native_kind(w: QArray, act: Spec | None) -> str:
    if act is not None:
        return "w8a8"
    return "int4" if is_packed(w.bits) else "int8"


def row_major_max_rows(w8a8: bool) -> int:
    """Rows of activations up to which a row-major kernel goes to the native decode kernels:
    ``NATIVE_MAX_ROWS["row_major_vnni"]`` for a weight-only product on an AVX-512 VNNI CPU, else
    ``NATIVE_MAX_ROWS["row_major"]``."""
    from llmeq_jax import native

    limit = NATIVE_MAX_ROWS["row_major"]
    return limit if w8a8 or not native.vnni() else max(limit, NATIVE_MAX_ROWS["row_major_vnni"])


def _native_rows_ok(x: jax.Array, kind: str) -> bool:
    from llmeq_jax import native

    rows = math.prod(x.shape[:-1])
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return False
    if 0 < rows <= NATIVE_MAX_ROWS[kind]:
        return True
    if not native.prefill_kernels_ok():
        return False
    return (kind == "w8a8" and native.vnni()) or (kind in ("int8", "int4", "nk") and native.avx512()
                                                   and rows > NATIVE_PANEL_MIN_ROWS)


def _try_native(x, w, act):
    """A native CPU kernel's result when one applies and measured faster, else None."""
    if kernel_config.target_backend() != "cpu":
        return None
    from llmeq_jax import native

    kind = _native_kind(w, act)
    if not _native_rows_ok(x, kind):
        return None
    if act is not None:
        if act.bits > 8 or act.grid != "uniform" or native.supports_w8a8(w) is not None or not native.enabled():
            return None
        return native.w8a8_kn(x, w, act)
    if not native.enabled():
        return None
    if w.bits in (2, 3):  # (a full-sequence forward on params not laid out by decode_layout.for_prefill)
        from llmeq_jax.decode_layout import widen_to_int4

        # Re-packed into int4 slots in this call: less work than the XLA path's float copy of the weight.
        w = widen_to_int4(w)
    if native.supports_kn(w) is not None:
        return None
    return native.weight_only_kn(x, w)


def _linear_panels(x, w: PanelKernel, backend):
    """``x @ kernel`` for a float kernel packed in panels: the native AVX-512 GEMM, else XLA."""
    if w.swiglu:
        raise ValueError("linear: a swiglu-packed gate/up kernel (decode_layout.pack_swiglu_panels) runs through ops.swiglu")
    if _panels_native(x, backend):
        from llmeq_jax import native

        return native.panel_matmul(x, w.panels, w.features)
    return jnp.matmul(x, unpack_panels(w.panels, w.features).astype(x.dtype))


def _panels_native(x, backend) -> bool:
    if backend != "auto" or kernel_config.target_backend() != "cpu" or x.dtype != jnp.float32 or math.prod(x.shape[:-1]) == 0:
        return False
    from llmeq_jax import native

    return native.enabled() and native.avx512() and native.prefill_kernels_ok()


def swiglu(x: jax.Array, w: PanelKernel | QArray | Int4WordKernel | LayerSlice, *, backend: str = "auto") -> jax.Array:
    """``silu(x @ gate) * (x @ up)`` for a SwiGLU MLP's joined gate/up kernel: one packed by
    ``decode_layout.pack_swiglu_panels`` (one native pass, the activation applied in the GEMM's
    registers, else XLA), a weight-only ``(in, 2 F)`` QArray, gate first (the same native pass
    on dequantized panels where :func:`swiglu_fuses`, else :func:`linear` and the activation), or a word kernel
    with paired columns (``decode_layout.pair_swiglu``; a stacked layer of one): the decode word kernel gates its
    tiles. ``x`` may be a norm's unevaluated output (``llmeq_jax.normed_rows``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {list(BACKENDS)}")
    if paired_swiglu(w):  # decode_layout.pair_swiglu: gate and up interleaved
        _check_shapes(x, w)
        return _swiglu_paired(x, w, backend)
    if isinstance(x, NormedRows):
        x = x.value()
    if isinstance(w, QArray):
        _check_shapes(x, w)
        if w.shape[1] % 2:
            raise ValueError(f"swiglu: a joined gate/up kernel has an even number of columns, got shape {tuple(w.shape)}")
        if backend == "auto" and swiglu_fuses(x, w):
            from llmeq_jax import native

            return native.weight_only_swiglu(x, w)
        return gated(linear(x, w, backend=backend))
    if not (isinstance(w, PanelKernel) and w.swiglu):
        raise ValueError("swiglu: expects a kernel packed by decode_layout.pack_swiglu_panels or a weight-only QArray")
    _check_shapes(x, w)
    if _panels_native(x, backend):
        from llmeq_jax import native

        return native.panel_matmul(x, w.panels, w.features, swiglu=True)
    return gated(jnp.matmul(x, unpack_panels(w.panels, w.features, swiglu=True).astype(x.dtype)))


def paired_swiglu(w) -> bool:
    """Whether ``w`` is a SwiGLU's gate/up kernel with paired outputs (``decode_layout.pair_swiglu``: a word kernel
    or an int8 row-major one), or a stacked layer of one."""
    stack = w.stack if isinstance(w, LayerSlice) else w
    return isinstance(stack, (Int4WordKernel, RowMajorKernel)) and stack.paired


def _swiglu_paired(x, w, backend):
    """``silu(x @ gate) * (x @ up)`` of a paired kernel (``decode_layout.pair_swiglu``): gated by the decode word
    kernel or the int8 kernels as they finish each tile (a norm before it folded in too), else the paired product
    gated after."""
    kernel = _decode_kernel(x, w, backend)
    if kernel is not None:
        norm = _norm_to_fold(x, w, kernel)
        raw = x.x if norm is not None else (x.value() if isinstance(x, NormedRows) else x)
        return _run_decode_kernel(kernel, raw, w, backend, norm=norm, act="swiglu")
    y = _int8_gated(x, w, backend)
    if y is not None:
        return y
    from pallas_kernels.common import swiglu_pairs

    return swiglu_pairs(linear(x, w, backend=backend))


def _int8_gated(x, w, backend):
    """``silu(x @ gate) * (x @ up)`` of a paired int8 row-major kernel (or a stacked layer of one) by the K-major int8
    kernels, which gate their tiles -- weight-only (the float16-operand one folding a norm before it where it may) or
    W8A8 (a norm folded where ``pallas_kernels.token_codes`` makes the codes) -- or None where kernel_dispatch sends
    the product elsewhere."""
    stack, layer = (w.stack, w.layer) if isinstance(w, LayerSlice) else (w, None)
    if backend == "xla" or not isinstance(stack, RowMajorKernel):
        return None
    act = stack.w.act_spec
    norm = _norm_to_fold(x, w, _int8_kernel(stack)) if layer is not None else None
    if norm is not None:
        y = kernel_dispatch.linear(x.x, stack.w, act, layer=layer, w_layout="nk", norm=norm, swiglu=True)
        if y is not None:
            return y
    raw = x.value() if isinstance(x, NormedRows) else x
    return kernel_dispatch.linear(raw, stack.w, act, layer=layer, w_layout="nk", swiglu=True)


def gated(y: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of a joined gate/up product ``y`` (gate the first half of its last axis)."""
    half = y.shape[-1] // 2
    return jax.nn.silu(y[..., :half]) * y[..., half:]


def swiglu_fuses(x: jax.Array, w: Any) -> bool:
    """Whether :func:`swiglu` runs a joined weight-only gate/up QArray ``w`` in one native pass on
    ``x``: where ``linear`` would take the dequantized-panel GEMM (AVX-512, more than
    ``NATIVE_PANEL_MIN_ROWS`` rows, one device), which then applies the activation in its registers
    instead of writing the ``[rows, 2 F]`` product for a second pass."""
    if not (isinstance(w, QArray) and w.act_spec is None and w.grid == "uniform" and w.shape[1] % 2 == 0):
        return False
    if kernel_config.target_backend() != "cpu" or math.prod(x.shape[:-1]) <= NATIVE_PANEL_MIN_ROWS:
        return False
    from llmeq_jax import native

    # past NATIVE_PANEL_MIN_ROWS, _native_rows_ok holds only where the panels run (AVX-512, one device)
    return _native_rows_ok(x, _native_kind(w, None)) and native.enabled() and native.supports_kn(w) is None


def _linear_int4_layout(x, w: Int4WordKernel | Int4RowKernel, backend, layer=None):
    """``x @ kernel`` for an int4 kernel in a GPU decode layout -- words (the Pallas word kernel) or ``(out, in)``
    int4 rows (the Mosaic GPU decode kernel) -- where its kernel runs (with ``layer``, reading that layer of the
    stack in place), else the codes packed again for XLA's path."""
    if backend != "xla":
        kernel = kernel_dispatch.linear_words if isinstance(w, Int4WordKernel) else kernel_dispatch.linear_rows
        y = kernel(x, w.w, require=backend == "pallas", layer=layer)
        if y is not None:
            return y
    if layer is not None:
        w = type(w)(LayerSlice(w.w, layer).value())
    return linear(x, w.packed(), backend=backend)


def _linear_row_major(x, kernel: RowMajorKernel, act, backend, layer=None):
    """``x @ kernel`` for a kernel stored row-major (``kernel.w`` is ``(out, in)``): a Pallas kernel reading
    it K-major (int8 codes, where kernels run), else native, else XLA.

    With ``layer``, the kernel is a stack of such kernels: the kernels read that layer in place, XLA takes
    its slice. The native weight-only kernel reads ``kernel.codes`` (scales as ``decode_layout.ScaleCodes``)
    instead of ``w.scale``, and split codes (``kernel.split``) as they are; the other paths, the codes as a
    QArray stores them (``kernel.qarray()``)."""
    w = kernel.w
    if backend != "xla" and not kernel.split:
        y = kernel_dispatch.linear(x, w, act, layer=layer, w_layout="nk")
        if y is not None:
            return y
    rows = math.prod(x.shape[:-1])
    if (backend == "auto" and kernel_config.target_backend() == "cpu" and jnp.issubdtype(x.dtype, jnp.floating)
            and 0 < rows <= row_major_max_rows(act is not None)):
        from llmeq_jax import native

        if (native.enabled() and native.supports_row_major(w, act, kernel.split) is None
                and not (kernel.split and act is not None)):
            return native.row_major_matmul(x, w, act, layer=layer, codes=None if act is not None else kernel.codes,
                                           split=kernel.split)
    w = kernel.qarray()
    if layer is not None:
        w = LayerSlice(w, layer).value()
    return w8a8_nk_xla(x, w, act) if act is not None else linear_nk_xla(x, w)


# --------------------------------------------------------------------------- transposed (nk)


def linear_nk(
    x: jax.Array,
    w: jax.Array | QArray,
    bias: jax.Array | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """``x @ dequantize(w).T (+ bias)`` for a ``(out, in)`` matrix ``w``; output in ``x.dtype``.

    Meant for an embedding table used as the LM head: rows are contiguous along ``in``,
    scales are per row ``(out, 1)`` (or per tensor) or groups along ``in``
    ``(out, ceil(in / g))``, int4 values packed along ``in`` (``pack_axis=1``).
    ``backend="auto"`` takes the native CPU kernel where it applies; the XLA path
    never builds the whole float table for a few rows (a scan over row chunks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {list(BACKENDS)}")
    if len(w.shape) != 2:
        raise ValueError(f"linear_nk expects an (out, in) matrix, got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear_nk: input has {x.shape[-1]} features but the matrix has {w.shape[1]} columns (matrix {tuple(w.shape)})"
        )
    if backend == "pallas":
        raise NotImplementedError("linear_nk has no Pallas kernel")
    if not isinstance(w, QArray):
        y = jnp.matmul(x, w.astype(x.dtype).T)
    elif w.grid != "uniform":  # log2 codes: the chunked XLA path dequantizes through QArray.dequantize
        y = linear_nk_xla(x, w)
    else:
        y = None
        if backend == "auto":
            y = _try_native_nk(x, w)
        if y is None:
            y = linear_nk_xla(x, w)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


def _try_native_nk(x, w):
    from llmeq_jax import native

    if kernel_config.target_backend() != "cpu" or not jnp.issubdtype(x.dtype, jnp.floating) or not native.enabled():
        return None
    # int16 activations x integer codes: the faster kernel, as far as row-major products go (the int8
    # head of SmolLM2-135M, 49152 x 576, at 16 rows on the VNNI tiles: 5.6 ms against XLA's 13.8)
    if native.supports_row_major(w) is None and 0 < math.prod(x.shape[:-1]) <= row_major_max_rows(w8a8=False):
        return native.row_major_matmul(x, w)
    if not _native_rows_ok(x, "nk") or native.supports_nk(w) is not None:
        return None
    return native.weight_only_nk(x, w)


def linear_nk_xla(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ dequantize(w).T`` in XLA: for few rows one multiply-reduce over the codes on a GPU, a scan over
    chunks of ``w``'s rows elsewhere."""
    n, k = w.shape
    rows = math.prod(x.shape[:-1])
    if rows > SMALL_M or w.tile[0] not in (1, n):
        return jnp.matmul(x, w.dequantize(x.dtype).T)
    if kernel_config.target_backend() != "cpu" and w.grid == "uniform" and rows <= GPU_REDUCE_MAX_ROWS:
        return _nk_reduce(x, w)
    if n <= NK_CHUNK_ROWS:
        return jnp.matmul(x, w.dequantize(x.dtype).T)
    return _nk_chunked(x, w)


def _nk_reduce(x: jax.Array, w: QArray) -> jax.Array:
    """Few-row ``x @ dequantize(w).T`` for an ``(out, in)`` QArray as one multiply-reduce over ``in``, the minor dim
    the codes lie along (packed sub-byte values too): XLA reads them in place in a row reduction, integer values
    summed per scale group, then the groups' sums scaled. On a GPU: the scan of :func:`_nk_chunked` is a loop of
    launches there, and XLA's reduction over an ``(in, out)`` int4 kernel wrote each product's ``x * q`` as float32
    before reducing it (8x the codes' bytes; ``scripts/gpu_aot.py``, SmolLM2-135M)."""
    n, k = w.shape
    groups = math.ceil(k / w.tile[1])  # scales per group of ``in`` values (one group: one a row, or one in all)
    xg = _grouped(x.reshape(-1, k).astype(jnp.float32), groups, w.tile[1])  # (M, G, g), a short last group padded
    qg = _grouped(w.values(), groups, w.tile[1]).astype(jnp.float32)  # (N, G, g)
    per_group = lambda a: jnp.broadcast_to(a.astype(jnp.float32), (n, groups))  # noqa: E731
    if w.zero_point is not None:  # off each code inside the one reduction (x's sums apart were launches of their own)
        qg = qg - per_group(w.zero_point)[..., None]
    partial = jnp.sum(xg[:, None] * qg[None], axis=-1)  # (M, N, G)
    y = jnp.sum(partial * per_group(w.scale), axis=-1)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def _rows_of(a: jax.Array | None, start, size: int, per_row: bool):
    """Rows [start, start + size) of a per-row scale / zero point (shared ones pass through)."""
    if a is None or not per_row:
        return a
    return jax.lax.dynamic_slice_in_dim(a, start, size, axis=0)


def _nk_chunked(x: jax.Array, w: QArray) -> jax.Array:
    """Few-row ``x @ dequantize(w).T``: each step dequantizes NK_CHUNK_ROWS rows (in cache)."""
    import dataclasses

    n, k = w.shape
    chunk = NK_CHUNK_ROWS
    steps = math.ceil(n / chunk)
    pad = steps * chunk - n
    per_row = w.scale.shape[0] != 1
    # Stored rows per chunk: fewer when sub-byte values are packed along the rows (NK_CHUNK_ROWS is
    # a whole number of packed chunks for every width).
    q_rows = packed_length(chunk, w.bits) if w.pack_axis % 2 == 0 else chunk
    q, scale, zp = w.qvalue, w.scale, w.zero_point
    if pad:  # padded rows give outputs that are cut off below
        q = jnp.pad(q, ((0, steps * q_rows - q.shape[0]), (0, 0)))
        if per_row:
            scale = jnp.pad(scale, ((0, pad), (0, 0)))
            zp = None if zp is None else jnp.pad(zp, ((0, pad), (0, 0)))
    x2 = x.reshape(-1, k).astype(jnp.float32)
    tile = (1 if per_row else chunk, w.tile[1])

    def step(_, i):
        start = i * chunk
        part = dataclasses.replace(
            w,
            qvalue=jax.lax.dynamic_slice_in_dim(q, i * q_rows, q_rows, axis=0),
            scale=_rows_of(scale, start, chunk, per_row),
            zero_point=_rows_of(zp, start, chunk, per_row),
            shape=(chunk, k),
            tile=tile,
            act_spec=None,
            act_scale=None,
        )
        return None, x2 @ part.dequantize(jnp.float32).T

    _, ys = jax.lax.scan(step, None, jnp.arange(steps))  # (steps, M, chunk)
    y = jnp.moveaxis(ys, 0, 1).reshape(x2.shape[0], steps * chunk)[:, :n]
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


# --------------------------------------------------------------------------- layout helpers


def contraction_groups(w: QArray) -> tuple[int, int]:
    """(number of groups, group size) of ``w`` along its contraction dim (dim 0)."""
    k = w.shape[0]
    g = w.tile[0]
    return math.ceil(k / g), g


def _out_scale_ok(w: QArray) -> bool:
    """Scales vary along out only per element or not at all (true for every Spec on a kernel)."""
    return w.tile[1] in (1, w.shape[1])


def _grouped(a: jax.Array, groups: int, g: int) -> jax.Array:
    """(..., K) -> (..., G, g), zero-padding a shorter last group."""
    k = a.shape[-1]
    pad = groups * g - k
    if pad:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a.reshape(*a.shape[:-1], groups, g)


def _grouped_weight(q: jax.Array, groups: int, g: int) -> jax.Array:
    """(K, N) -> (G, g, N), zero-padding a shorter last group."""
    pad = groups * g - q.shape[0]
    if pad:
        q = jnp.pad(q, [(0, pad), (0, 0)])
    return q.reshape(groups, g, q.shape[-1])


def _per_group(a: jax.Array, w: QArray, groups: int) -> jax.Array:
    """A scale/zero-point array of ``w`` as (G, N), whatever its tile along dims 0 and 1."""
    a = a.astype(jnp.float32)
    return jnp.broadcast_to(a, (groups if a.shape[0] != 1 else 1, w.shape[1])).reshape(-1, w.shape[1])


# --------------------------------------------------------------------------- weight-only


def weight_only_xla(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ dequantize(w)`` in XLA, choosing the formulation by the number of rows."""
    if w.grid != "uniform":  # the integer formulations below read uniform codes
        return jnp.matmul(x, w.dequantize(x.dtype))
    rows = math.prod(x.shape[:-1])
    if rows <= SMALL_M and _out_scale_ok(w):
        if kernel_config.target_backend() == "cpu" and _chunk_rows(w) is not None:
            return _weight_only_chunked(x, w)
        return _weight_only_reduce(x, w)
    if subchannel.takes(rows, x.dtype, w):  # int4 groups on a GPU: one GEMM over the codes
        return subchannel.matmul(x, w)
    if kernel_config.target_backend() != "cpu" and _codes_into_gemm(w):
        return _per_channel_gemm(x, w)
    return jnp.matmul(x, w.dequantize(x.dtype))


def _codes_into_gemm(w: QArray) -> bool:
    """Whether ``x @ dequantize(w)`` can be one GEMM over the codes as stored: int8 codes (not packed) with one
    scale (and zero point) per output column, so the scaling moves past the dot."""
    return w.bits == 8 and w.grid == "uniform" and w.ndim == 2 and w.tile[0] == w.shape[0] and _out_scale_ok(w)


def _per_channel_gemm(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ ((q - z) * s)`` as ``(x @ q - sum(x) z) * s``: the GEMM reads the int8 codes in place, XLA converting
    them in its operand loads, where the dequantized form had it write the whole weight in x's dtype before every
    prompt's product (a GPU's weight-only prefill: rtn-w8 0.90x bf16 on an H200). The codes are exact in bfloat16 /
    float16.

    Symmetric codes with bfloat16 activations: the GEMM writes bfloat16 (it accumulates in float32 either way) and the
    scaling follows in a multiply XLA fuses into the next elementwise op. In a model's layer loop XLA fuses no
    operand but the program's own parameters into a GEMM's epilogue, and the scales there are slices of the stacked
    layers, so a float32 GEMM output was written and read whole before (deviceless H100, Llama-2-7B prompt layer:
    332 -> 166 MiB of GEMM outputs). One more rounding than a float32 output (the code product, then the scaled
    value), within the bfloat16 output's own. Float16's range cannot hold a product of codes (up to 127 times
    x's sum), nor may a zero point's correction cancel rounded terms: those accumulate and subtract in float32."""
    written = x.dtype if w.zero_point is None and x.dtype == jnp.bfloat16 else jnp.float32  # the GEMM's output
    y = jnp.matmul(x, w.qvalue.astype(x.dtype), preferred_element_type=written).astype(jnp.float32)
    if w.zero_point is not None:
        y = y - jnp.sum(x.astype(jnp.float32), axis=-1, keepdims=True) * w.zero_point.astype(jnp.float32)
    return (y * w.scale.astype(jnp.float32)).astype(x.dtype)


def _chunk_rows(w: QArray) -> int | None:
    """Rows per scan step for :func:`_weight_only_chunked`, or None when the layout does not suit it.

    A step must lie inside one scale group (so it needs one scale row) and hold
    whole packed bytes (sub-byte values must be packed along the rows).
    """
    if is_packed(w.bits) and w.pack_axis != 0:
        return None
    groups, g = contraction_groups(w)
    chunk = CHUNK_ROWS if groups == 1 else math.gcd(CHUNK_ROWS, g)
    return chunk if chunk >= 16 and chunk % packing(w.bits)[0] == 0 else None


def _unpack_rows(packed: jax.Array, bits: int) -> jax.Array:
    """Values of a row-packed block of whole chunks, (rows, N) int32, without a transpose."""
    per_chunk, nbytes = packing(bits)
    return unpack(packed, bits, 0, packed.shape[0] // nbytes * per_chunk).astype(jnp.int32)


def _weight_only_chunked(x: jax.Array, w: QArray) -> jax.Array:
    """Few-row ``x @ dequantize(w)`` as a scan over chunks of kernel rows.

    Each step unpacks and dequantizes ``chunk`` rows (one scale row: a step
    never crosses a group) and adds ``x[:, chunk] @ rows`` to the accumulator.
    The contraction dim is zero-padded to whole groups / chunks; padded x
    columns are zero, so they add nothing.
    """
    k, n = w.shape
    chunk = _chunk_rows(w)
    groups, g = contraction_groups(w)
    steps = math.ceil(k / chunk) if groups == 1 else groups * (g // chunk)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    x2 = jnp.pad(x2, ((0, 0), (0, steps * chunk - k)))
    xs = jnp.moveaxis(x2.reshape(-1, steps, chunk), 1, 0)  # (steps, M, chunk)
    q = w.qvalue
    q_rows = packed_length(chunk, w.bits)  # stored rows per step (chunk is whole packed chunks)
    q = jnp.pad(q, ((0, steps * q_rows - q.shape[0]), (0, 0)))
    qs = q.reshape(steps, q_rows, n)
    scale = w.scale.astype(jnp.float32)  # (groups or 1, 1 or n)
    zp = None if w.zero_point is None else w.zero_point.astype(jnp.float32)

    def term(i, xi, qi):
        group = i * chunk // g if groups > 1 else 0
        v = _unpack_rows(qi, w.bits).astype(jnp.float32)
        if zp is not None:
            v = v - jax.lax.dynamic_index_in_dim(zp, group, 0)
        return (xi @ v) * jax.lax.dynamic_index_in_dim(scale, group, 0)

    # The first chunk starts the sum (not zeros): inside shard_map the carry then has the
    # same varying-axes type as the products.
    acc = term(0, xs[0], qs[0])
    if steps > 1:
        acc, _ = jax.lax.scan(lambda a, inp: (a + term(*inp), None), acc, (jnp.arange(1, steps), xs[1:], qs[1:]))
    return acc.reshape(*lead, n).astype(x.dtype)


def _weight_only_reduce(x: jax.Array, w: QArray) -> jax.Array:
    """Few-row product as one fused multiply-reduce over the integer values.

    sum_k x[k] * (q[k, n] - zp[g(k), n]) * s[g(k), n], reduced first within each
    group (on the int values) then across groups with the scales applied.
    """
    groups, g = contraction_groups(w)
    xg = _grouped(x.astype(jnp.float32), groups, g)  # (..., G, g)
    qg = _grouped_weight(w.values(), groups, g).astype(jnp.float32)  # (G, g, N)
    partial = jnp.sum(xg[..., :, :, None] * qg, axis=-2)  # (..., G, N)
    scale = _per_group(w.scale, w, groups)
    if w.zero_point is not None:
        xsum = jnp.sum(xg, axis=-1)[..., None]  # (..., G, 1)
        partial = partial - xsum * _per_group(w.zero_point, w, groups)
    return jnp.sum(partial * scale, axis=-2).astype(x.dtype)


# --------------------------------------------------------------------------- embedding lookup


def take_rows(table: jax.Array | QArray, ids: jax.Array, dtype: Any = None) -> jax.Array:
    """Rows ``table[ids]`` -> ``ids.shape + (features,)``; a QArray table dequantizes only the rows it reads.

    The table's scales must be per row, per tensor or grouped along the features, and
    sub-byte values packed along the features (``pack_axis=1``), so each row is whole.
    """
    if not isinstance(table, QArray):
        rows = jnp.take(table, ids, axis=0)
        return rows if dtype is None else rows.astype(dtype)
    if len(table.shape) != 2:
        raise ValueError(f"take_rows expects a (rows, features) table, got shape {table.shape}")
    if is_packed(table.bits) and table.pack_axis != 1:
        raise ValueError(f"take_rows needs sub-byte values packed along the features (pack_axis=1), "
                         f"got pack_axis={table.pack_axis}")
    if table.tile[0] not in (1, table.shape[0]):
        raise ValueError(f"take_rows needs scales per row or per tensor, not groups of {table.tile[0]} rows")
    flat = jnp.reshape(ids, (-1,))

    def gather(a):  # a scale / zero point with one entry per row is gathered, a shared one kept
        return None if a is None else (a if a.shape[0] == 1 else jnp.take(a, flat, axis=0))

    scale = gather(table.scale)
    picked = QArray(
        qvalue=jnp.take(table.qvalue, flat, axis=0),
        scale=scale,
        zero_point=gather(table.zero_point),
        bits=table.bits,
        shape=(flat.shape[0], table.shape[1]),
        tile=(1 if scale.shape[0] > 1 else flat.shape[0], table.tile[1]),
        dtype=table.dtype,
        pack_axis=1,
        grid=table.grid,
    )
    return picked.dequantize(dtype).reshape(*jnp.shape(ids), table.shape[1])


# --------------------------------------------------------------------------- W8A8


def quantize_activations(x: jax.Array, act: Spec, act_scale: jax.Array | None):
    """int8 activations (fp8 act spec: ``float8_e4m3fn``) and their per-token (..., 1) or per-tensor () scale."""
    qmax = largest_value(act)
    xf = x.astype(jnp.float32)
    if act_scale is not None:
        scale = act_scale.astype(jnp.float32)
    elif act.granularity == "token":
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
        scale = jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / qmax
    else:  # dynamic per-tensor
        scale = jnp.maximum(jnp.max(jnp.abs(xf)), jnp.finfo(jnp.float32).tiny) / qmax
    if act.grid == "fp8":
        return fp8grid.to_fp8(xf / scale), scale
    xq = jnp.clip(jnp.round(xf / scale), -qmax, qmax).astype(jnp.int8)
    return xq, scale


def w8a8_xla(x: jax.Array, w: QArray, act: Spec) -> jax.Array:
    """Quantize activations, int8 x int8 -> int32 dots per weight group, rescale.

    fp8 weights with an fp8 act spec: E4M3 x E4M3 -> float32 dots instead (XLA runs them on FP8 tensor
    cores where the GPU has them and widens the operands elsewhere)."""
    if w.bits > 8:
        raise ValueError(f"W8A8 needs weights of at most 8 bits, got int{w.bits}")
    if (w.grid == "fp8") != (act.grid == "fp8") or w.grid == "log2":
        raise ValueError(f"W8A8: {act.describe()} activations cannot meet {w!r} in one dot; integer activations go "
                         "with uniform integer weights, fp8 activations with fp8 weights")
    if not _out_scale_ok(w):
        return jnp.matmul(x, w.dequantize(x.dtype))
    xq, sx = quantize_activations(x, act, w.act_scale)
    groups, g = contraction_groups(w)
    fp8 = w.grid == "fp8"
    exact = jnp.float32 if fp8 else jnp.int32  # what the dots accumulate in
    q = fp8grid.as_fp8(w.qvalue) if fp8 else w.values()
    scale = _per_group(w.scale, w, groups)  # (G, N)
    if groups == 1:
        acc = jax.lax.dot_general(
            xq, q, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=exact
        )[..., None, :]  # (..., 1, N)
    else:
        xg = _grouped(xq, groups, g)  # (..., G, g)
        qg = _grouped_weight(q, groups, g)  # (G, g, N)
        lead = xg.ndim - 2
        xg_t = jnp.moveaxis(xg, -2, 0)  # (G, ..., g)
        acc = jax.lax.dot_general(
            xg_t, qg, (((xg_t.ndim - 1,), (1,)), ((0,), (0,))), preferred_element_type=exact
        )  # (G, ..., N)
        acc = jnp.moveaxis(acc, 0, lead)  # (..., G, N)
    accf = acc.astype(jnp.float32)
    if w.zero_point is not None:
        xsum = jnp.sum(_grouped(xq.astype(jnp.int32), groups, g), axis=-1)[..., None]  # (..., G, 1)
        accf = accf - xsum.astype(jnp.float32) * _per_group(w.zero_point, w, groups)
    y = jnp.sum(accf * scale, axis=-2) * sx
    return y.astype(x.dtype)


def w8a8_nk_xla(x: jax.Array, w: QArray, act: Spec) -> jax.Array:
    """W8A8 ``x @ dequantize(w).T`` for an ``(out, in)`` QArray: the XLA W8A8 path on its kernel view."""
    return w8a8_xla(x, kernel_view(w), act)


def qeinsum(subscripts: str, x: jax.Array, w: jax.Array | QArray) -> jax.Array:
    """``einsum`` with a float or QArray second operand (weight-only: dequantized in the jit)."""
    if isinstance(w, QArray):
        w = w.dequantize(x.dtype)
    return jnp.einsum(subscripts, x, w)


def dequantize_tree_leaf(w: Any, dtype: Any = jnp.float32) -> Any:
    """A float view of a leaf that may be a QArray (for code that needs the raw matrix)."""
    return w.dequantize(dtype) if isinstance(w, QArray) else w


__all__ = ["linear", "linear_nk", "linear_nk_xla", "qeinsum", "quantize_activations", "take_rows", "weight_only_xla",
           "w8a8_nk_xla", "w8a8_xla"]
