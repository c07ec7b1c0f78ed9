"""Native CPU kernels for quantized matmuls (C++ through ``jax.ffi``).

The shared library ``llmeq_jax/_native_cpu*.so`` is compiled from
``native/cpu_kernels.cc`` by the package build (``setup.py``) on ``pip install``.
This module loads it with ctypes, registers its XLA FFI handlers for the CPU
platform and wraps them as jittable functions on QArrays:

* :func:`weight_only_kn` -- ``x @ dequantize(w)`` for an ``(in, out)`` kernel (int8 or
  row-packed int4/int3, per-channel / per-tensor / groups along ``in``, sym or asym).
* :func:`weight_only_nk` -- ``x @ dequantize(w).T`` for a ``(out, in)`` matrix with
  rows contiguous (an embedding table used as the LM head), int4 packed along ``in``.
* :func:`w8a8_kn` -- activations quantized by :func:`llmeq_jax.ops.quantize_activations`
  (so numerics match the XLA path), int8 x int8 -> exact int32 per weight group.
* :func:`float_matmul` -- ``x @ w`` for a float32 / bfloat16 kernel at decode's few rows, also
  one layer of a stacked kernel read in place (the scan over stacked blocks).

``ops.linear`` picks these on CPU when they measured faster (see ``ops.NATIVE_MAX_ROWS``).
If the library was not built (no compiler at install time) or cannot load, every
caller falls back to XLA and one warning says why. Turn the kernels off with
``LLMEQ_NATIVE=0`` in the environment, ``with native.disabled():`` or
``with pallas_kernels.config.disabled():`` (the "no custom kernels" switch of the CLI's
``--xla``). The switches are read at trace time, like the Pallas ones.

Under ``vmap`` the FFI calls run sequentially per batch element (``vmap_method=
"sequential"``); ``ops.linear`` flattens leading dims itself, so that never happens there.
Gradients: the wrappers are ``custom_vjp`` functions whose backward pass is the vjp of
the XLA reference, so ``jax.grad`` through them is the XLA gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import ctypes
import glob
import math
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray, is_packed
from llmeq_jax.layer_slice import LayerSlice, take_layer
from pallas_kernels import config as kernel_config

_WO_TARGET = "llmeq_wo_matmul"
_W8_TARGET = "llmeq_w8a8_matmul"
_RM_A16_TARGET = "llmeq_rm_a16"
_RM_A8_TARGET = "llmeq_rm_a8"
_ATTN_TARGET = "llmeq_decode_attention"
_KV_STORE_TARGET = "llmeq_kv_store_attention"
_KV_APPEND_TARGET = "llmeq_kv_store_append"
_PANEL_TARGET = "llmeq_panel_matmul"
_FLOAT_TARGET = "llmeq_float_gemv"
# Columns per panel of a packed float kernel (kPanelCols in native/cpu_kernels.cc).
PANEL_COLS = 32
# Query positions from which the attention kernel runs its blocked prefill path (kFlashMinT in
# native/cpu_kernels.cc); between NATIVE_MAX_ROWS["attention"] and this, XLA's attention is used.
PREFILL_ATTENTION_MIN_POSITIONS = 16
_ABI_VERSION = 18
_DISABLED = contextvars.ContextVar("llmeq_native_disabled", default=False)
_INT_PANELS = contextvars.ContextVar("llmeq_native_int_panels", default=0)  # activation bits, 0: float panels


class _State:
    """Load result, computed once: the ctypes handle or the reason there is none."""

    lib: Any = None
    reason: str | None = None
    loaded: bool = False
    warned: bool = False


_state = _State()


def library_path() -> str | None:
    """The built library inside the package (``LLMEQ_NATIVE_LIB`` overrides, for tests)."""
    override = os.environ.get("LLMEQ_NATIVE_LIB")
    if override is not None:
        return override if os.path.exists(override) else None
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_native_cpu*.so")) + glob.glob(os.path.join(here, "_native_cpu*.pyd")))
    return found[0] if found else None


def _load() -> None:
    if _state.loaded:
        return
    _state.loaded = True
    path = library_path()
    if path is None:
        _state.reason = (
            "the native CPU library was not built (no C++ compiler at install time?); reinstall with "
            "`pip install -e .` where g++ is available"
        )
        return
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        if lib.llmeq_native_abi_version() != _ABI_VERSION:
            raise OSError(f"ABI version {lib.llmeq_native_abi_version()} != {_ABI_VERSION}; rebuild the package")
        for name in (_WO_TARGET, _W8_TARGET, _RM_A16_TARGET, _RM_A8_TARGET, _ATTN_TARGET, _PANEL_TARGET,
                     _FLOAT_TARGET, _KV_STORE_TARGET, _KV_APPEND_TARGET):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
        lib.llmeq_native_amx_blocks.restype = ctypes.c_int64
    except (OSError, AttributeError) as e:  # a stale or foreign build: XLA still works
        _state.reason = f"the native CPU library {path} could not be loaded: {e}"
        return
    _state.lib = lib


def available() -> bool:
    """The library is built, loaded and its FFI targets are registered."""
    _load()
    return _state.lib is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    _load()
    return _state.reason


def simd() -> bool:
    """The AVX2+FMA code runs on this CPU (else the portable scalar loops do)."""
    return available() and bool(_state.lib.llmeq_native_simd())


def vnni() -> bool:
    """The AVX-512 VNNI W8A8 GEMM runs on this CPU (vpdpbusd: 4x a float FMA's multiply-adds)."""
    return available() and bool(_state.lib.llmeq_native_vnni())


def avx512() -> bool:
    """The AVX-512 float tiles run on this CPU: packed-panel prefill GEMMs (:func:`panel_matmul`) and
    the prefill attention's wide tiles. On the same switch as :func:`vnni`."""
    return available() and bool(_state.lib.llmeq_native_avx512())


def amx() -> bool:
    """The W8A8 GEMM and the integer panels with int8 activations run 16 rows at a time on AMX-INT8 tiles
    on this CPU (``tdpbsud`` / ``tdpbusd``, 16x ``vpdpbusd``'s products an instruction; the same bits as the
    VNNI tiles)."""
    return available() and bool(_state.lib.llmeq_native_amx())


def prefill_kernels_ok() -> bool:
    """Prefill-sized native products (the panel GEMMs, the VNNI GEMM past a few rows) may be traced:
    only with one device. XLA's SPMD partitioner runs a custom call replicated, its inputs
    gathered, and the program after it too (a data-sharded forward came back replicated)."""
    return jax.device_count() == 1


@contextlib.contextmanager
def without_vnni():
    """Run the kernels that have an AVX-512 VNNI version (W8A8 GEMMs, the row-major decode products)
    through their AVX2 code even on a VNNI CPU (tests of that path); process-wide."""
    if not available():
        yield
        return
    _state.lib.llmeq_native_allow_vnni(0)
    try:
        yield
    finally:
        _state.lib.llmeq_native_allow_vnni(1)


def amx_blocks() -> int:
    """16-row blocks the AMX tiles have multiplied in this process so far (0 where they never run)."""
    if not available():
        return 0
    return int(_state.lib.llmeq_native_amx_blocks())


@contextlib.contextmanager
def without_amx():
    """Run the W8A8 GEMM and the integer panels' int8 products on the AVX-512 VNNI tiles even on an AMX CPU
    (tests of that path, A/B timings); process-wide."""
    if not available():
        yield
        return
    _state.lib.llmeq_native_allow_amx(0)
    try:
        yield
    finally:
        _state.lib.llmeq_native_allow_amx(1)


@contextlib.contextmanager
def integer_panels(on: bool = True, activation_bits: int = 16):
    """Weight-only products of more than ``ops.NATIVE_PANEL_MIN_ROWS`` rows traced inside run on the
    integer panels where the CPU has AVX-512 VNNI: x quantized per flush group as the decode kernels
    group it, the integer products summed exactly. ``activation_bits`` 16: int16 x, as the decode kernels
    quantize it (at most 2^-16 of each group's absmax off), pairs summed by ``vpdpwssd`` -- 1.4-1.9x the
    float panels' speed; 8: int8 x (scale absmax / 127, up to 2^-8 off, as llama.cpp quantizes a prompt's
    activations), quads summed by ``vpdpbusd`` at twice the products an instruction. Outside (the default)
    they run on float panels, the codes dequantized in cache: the dequantized model's products to float
    rounding, which perplexity and the exports' comparisons rely on. :func:`llmeq_jax.generate.generate`
    traces its prompt's prefill (int16, or int8 with ``prompt_activation_bits=8``) and its decode loop (int16:
    the decode kernels' activations) inside.
    Read at trace time: a function jitted outside keeps what it was traced with."""
    if activation_bits not in (8, 16):
        raise ValueError(f"integer_panels: activation_bits must be 8 or 16, got {activation_bits!r}")
    token = _INT_PANELS.set(activation_bits if on else 0)
    try:
        yield
    finally:
        _INT_PANELS.reset(token)


@contextlib.contextmanager
def force_scalar(on: bool = True):
    """Run the portable scalar loops even on an AVX2 CPU (tests of that path); process-wide."""
    if not available():
        yield
        return
    _state.lib.llmeq_native_force_scalar(int(on))
    try:
        yield
    finally:
        _state.lib.llmeq_native_force_scalar(0)


@contextlib.contextmanager
def disabled():
    """No native kernel is traced inside this block: XLA everywhere."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def _switched_off() -> bool:
    if _DISABLED.get() or os.environ.get("LLMEQ_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return True
    return kernel_config.is_disabled()


def enabled() -> bool:
    """Native kernels may be used now: on a CPU backend, not switched off, library loaded.

    The first time the library is missing where it would have been used, one warning
    says why (and every product then runs through XLA).
    """
    # the backend traced for: kernel_config.compiling_for may name a GPU from a CPU
    if _switched_off() or kernel_config.target_backend() != "cpu":
        return False
    if available():
        return True
    if not _state.warned:
        _state.warned = True
        warnings.warn(f"llmeq_jax native CPU kernels are off, using XLA: {_state.reason}", RuntimeWarning, stacklevel=3)
    return False


# --------------------------------------------------------------------------- what a kernel takes


def _grid_reason(w: QArray) -> str | None:
    """Why the native kernels cannot read ``w``'s codes: they multiply uniform integers (not log2 or fp8 codes)."""
    return None if w.grid == "uniform" else f"{w.grid} grids have no integer kernel"


def _sub_byte_reason(w: QArray) -> str | None:
    """Why the native kernels cannot read ``w``'s packed values (they read int8, or int4 two per byte)."""
    if w.bits in (2, 3):
        return (f"{w.bits}-bit packings have no native kernel (decode_layout.widen_to_int4 makes them int4 "
                "for decode and prefill)")
    return None


def _bits_ok(w: QArray, pack_dim: int) -> str | None:
    if (why := _sub_byte_reason(w)) is not None:
        return why
    if w.bits == 4 and w.pack_axis % 2 != pack_dim:
        return f"int{w.bits} values must be packed along the contraction dim (pack_axis={pack_dim})"
    if w.bits == 4 and w.tile[pack_dim] % 2 and w.tile[pack_dim] < w.shape[pack_dim]:
        return "int4 groups along the contraction dim must have an even size"
    return None


def supports_kn(w: QArray) -> str | None:
    """None when :func:`weight_only_kn` takes ``w``, else the reason it does not."""
    if not isinstance(w, QArray) or len(w.shape) != 2:
        return "needs a 2-D QArray"
    if w.tile[1] not in (1, w.shape[1]):
        return "scales grouped along the output dim"
    return _grid_reason(w) or _bits_ok(w, 0)


def supports_nk(w: QArray) -> str | None:
    """None when :func:`weight_only_nk` takes ``w`` (shape (out, in)), else the reason."""
    if not isinstance(w, QArray) or len(w.shape) != 2:
        return "needs a 2-D QArray"
    if w.tile[0] not in (1, w.shape[0]):
        return "scales grouped along the output (row) dim"
    return _grid_reason(w) or _bits_ok(w, 1)


def supports_w8a8(w: QArray) -> str | None:
    """None when :func:`w8a8_kn` takes ``w``, else the reason."""
    if not isinstance(w, QArray) or len(w.shape) != 2:
        return "needs a 2-D QArray"
    if is_packed(w.bits):
        return f"W8A8 needs unpacked weights of 5-8 bits, got int{w.bits}"
    if w.tile[1] not in (1, w.shape[1]):
        return "scales grouped along the output dim"
    return _grid_reason(w)


# Longest weight group the row-major kernels sum in int32 (weight-only / W8A8).
_RM_MAX_GROUP = 2048


def supports_row_major(w: QArray, act=None, split: bool = False) -> str | None:
    """None when :func:`row_major_matmul` takes the ``(out, in)`` QArray ``w`` (with activation spec ``act``;
    ``split``: its codes as ``decode_layout.split_codes`` bytes, which hold 2- and 3-bit codes too)."""
    if not isinstance(w, QArray) or len(w.shape) != 2:
        return "needs a 2-D QArray"
    if (why := _grid_reason(w)) is not None:
        return why
    n, k = w.shape
    if not split and (why := _sub_byte_reason(w)) is not None:
        return why
    if w.bits == 4 and w.pack_axis % 2 != 1:
        return f"int{w.bits} values must be packed along the contraction dim (pack_axis=1)"
    if k % 32:
        return f"the contraction dim ({k}) must be a multiple of 32"
    if w.tile[0] not in (1, n):
        return "scales grouped along the output (row) dim"
    g = w.tile[1]
    # Groups of 16 (llama.cpp's Q6_K; Q3_K / Q2_K widened to int4) weight-only: the tiles take two or four a step.
    sixteen = g == 16 and act is None
    if g < k and (g % 32 or g > _RM_MAX_GROUP) and not sixteen:
        return (f"groups along the contraction dim must be multiples of 32 up to {_RM_MAX_GROUP} (or 16 for "
                f"weight-only codes), got {g}")
    if act is not None:
        if act.grid != "uniform":
            return f"{act.grid} activations have no integer kernel"
        if act.bits > 8:
            return f"activations of {act.bits} bits"
        if is_packed(w.bits):
            return f"W8A8 needs unpacked weights of 5-8 bits, got int{w.bits}"
    return None


def _require(reason: str | None, what: str) -> None:
    if reason is not None:
        raise ValueError(f"native.{what}: {reason}")
    if not available():
        raise RuntimeError(f"native.{what}: {unavailable_reason()}")


def _as_grid(a: jax.Array, rows: int, cols: int) -> jax.Array:
    """A scale / zero-point array broadcast to (rows, cols) float32 (tiny arrays: cheap)."""
    return jnp.broadcast_to(a.astype(jnp.float32), (rows, cols))


def _zp_arg(w: QArray, rows: int, cols: int) -> jax.Array:
    if w.zero_point is None:
        return jnp.zeros((1, 1), jnp.float32)
    return _as_grid(w.zero_point, rows, cols)


def _rm_zp_arg(w: QArray, lead: tuple, n: int, groups: int) -> jax.Array:
    """The row-major kernels' zero points ``(*lead, n, groups)``: int8 and float32 ones as stored (a stack
    read in place at the layer the kernel is given), other types as float32. Converting int8 zero points
    here ran on every decode step (XLA keeps the widening conversion inside the loop): one 4096 x 11008 int4
    kernel in groups of 128 read from a stack, 1113 -> 1058 us a product without it (docs/cpu-speed.md)."""
    if w.zero_point is None:
        return jnp.zeros((1, 1), jnp.float32)
    zp = w.zero_point if w.zero_point.dtype in (jnp.int8, jnp.float32) else w.zero_point.astype(jnp.float32)
    return jnp.broadcast_to(zp, (*lead, n, groups))


def _check_x(x: jax.Array, k: int, what: str) -> None:
    if x.shape[-1] != k:
        raise ValueError(f"native.{what}: x has {x.shape[-1]} features, the weight contracts {k}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"native.{what}: x must be floating point, got {x.dtype}")


# --------------------------------------------------------------------------- raw FFI calls


def _wo_call(x2, q, scale, zp, *, layout: int, bits: int, group_size: int, has_zp: bool, n: int,
             swiglu: bool = False):
    _require(None, "weight-only call")
    out = jax.ShapeDtypeStruct((x2.shape[0], n // 2 if swiglu else n), jnp.float32)
    call = jax.ffi.ffi_call(_WO_TARGET, out, vmap_method="sequential")
    return call(
        x2, q, scale, zp,
        layout=np.int64(layout), bits=np.int64(bits), group_size=np.int64(group_size), has_zp=np.int64(has_zp),
        swiglu=np.int64(swiglu), int_panels=np.int64(_INT_PANELS.get()),
    )  # fmt: skip


def _w8_call(xq2, q, scale, zp, sx, *, group_size: int, has_zp: bool):
    _require(None, "W8A8 call")
    out = jax.ShapeDtypeStruct((xq2.shape[0], q.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(_W8_TARGET, out, vmap_method="sequential")
    return call(xq2, q, scale, zp, sx, group_size=np.int64(group_size), has_zp=np.int64(has_zp))


def _layer_arg(layer) -> jax.Array:
    """The row-major kernels' layer operand: which layer of a stacked q / scale to read (0 unstacked)."""
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))


def _rm_a16_call(x2, q, scale, zp, *, bits: int, group_size: int, has_zp: bool, layer=None, steps=None,
                 split: bool = False):
    """``scale`` float32, or int8 codes with ``steps`` (one float32 per ``codes.shape[-1] // steps.shape[-1]``
    groups: :class:`llmeq_jax.decode_layout.ScaleCodes`). ``split``: ``q`` is int2-int6 codes as
    ``decode_layout.split_codes`` bytes."""
    _require(None, "row-major call")
    out = jax.ShapeDtypeStruct((x2.shape[0], q.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call(_RM_A16_TARGET, out, vmap_method="sequential")
    step_groups = 0 if steps is None else scale.shape[-1] // steps.shape[-1]
    steps = jnp.zeros((1, 1), jnp.float32) if steps is None else steps
    return call(x2, q, scale, zp, steps, _layer_arg(layer), bits=np.int64(bits), group_size=np.int64(group_size),
                has_zp=np.int64(has_zp), step_groups=np.int64(step_groups), split=np.int64(split))


def _rm_a8_call(xq2, q, scale, zp, sx, *, group_size: int, has_zp: bool, layer=None):
    _require(None, "row-major W8A8 call")
    out = jax.ShapeDtypeStruct((xq2.shape[0], q.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call(_RM_A8_TARGET, out, vmap_method="sequential")
    return call(xq2, q, scale, zp, sx, _layer_arg(layer), group_size=np.int64(group_size), has_zp=np.int64(has_zp))


# --------------------------------------------------------------------------- QArray products


def _kn_forward(x: jax.Array, w: QArray, swiglu: bool = False) -> jax.Array:
    k, n = w.shape
    g = w.tile[0]
    groups = math.ceil(k / g)
    x2 = x.reshape(-1, k).astype(jnp.float32)
    y = _wo_call(
        x2, w.qvalue, _as_grid(w.scale, groups, n), _zp_arg(w, groups, n),
        layout=0, bits=w.bits, group_size=g, has_zp=w.zero_point is not None, n=n, swiglu=swiglu,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)


def _nk_forward(x: jax.Array, w: QArray) -> jax.Array:
    n, k = w.shape
    g = w.tile[1]
    groups = math.ceil(k / g)
    x2 = x.reshape(-1, k).astype(jnp.float32)
    y = _wo_call(
        x2, w.qvalue, _as_grid(w.scale, n, groups), _zp_arg(w, n, groups),
        layout=1, bits=w.bits, group_size=g, has_zp=w.zero_point is not None, n=n,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def _w8_forward(x: jax.Array, w: QArray, act) -> jax.Array:
    from llmeq_jax.ops import quantize_activations  # same activation numerics as the XLA path

    k, n = w.shape
    g = w.tile[0]
    groups = math.ceil(k / g)
    xq, sx = quantize_activations(x, act, w.act_scale)
    xq2 = xq.reshape(-1, k)
    # Per-token scales are (..., 1), a static or per-tensor one broadcasts: one entry per row.
    sx_rows = jnp.broadcast_to(jnp.asarray(sx, jnp.float32), (*xq.shape[:-1], 1))
    y = _w8_call(
        xq2, w.qvalue.astype(jnp.int8), _as_grid(w.scale, groups, n), _zp_arg(w, groups, n),
        sx_rows.reshape(-1), group_size=g, has_zp=w.zero_point is not None,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def _rm_forward(x: jax.Array, w: QArray, act, layer=None, codes=None, split=False) -> jax.Array:
    n, k = w.shape
    g = w.tile[1]
    groups = math.ceil(k / g)
    lead = () if layer is None else w.qvalue.shape[:1]
    zp = _rm_zp_arg(w, lead, n, groups)
    if layer is None:
        scale, act_scale = _as_grid(w.scale, n, groups), w.act_scale
    else:  # a stack: codes, scales and zero points read in place by the kernel; the act scale (small) sliced
        scale = jnp.broadcast_to(w.scale.astype(jnp.float32), (*lead, n, groups))
        act_scale = take_layer(w.act_scale, layer)
    if act is None:  # with scale codes the kernel reads them (and their steps), not w.scale
        x2 = x.reshape(-1, k).astype(jnp.float32)
        y = _rm_a16_call(x2, w.qvalue, scale if codes is None else codes.codes, zp, bits=w.bits, group_size=g,
                         has_zp=w.zero_point is not None, layer=layer, steps=None if codes is None else codes.steps,
                         split=split)
    else:
        from llmeq_jax.ops import quantize_activations  # same activation numerics as the XLA path

        xq, sx = quantize_activations(x, act, act_scale)
        sx_rows = jnp.broadcast_to(jnp.asarray(sx, jnp.float32), (*xq.shape[:-1], 1))
        y = _rm_a8_call(xq.reshape(-1, k), w.qvalue.astype(jnp.int8), scale, zp, sx_rows.reshape(-1),
                        group_size=g, has_zp=w.zero_point is not None, layer=layer)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def _xla_row_major(x, w, act, split=False):
    from llmeq_jax.decode_layout import RowMajorKernel
    from llmeq_jax.ops import linear_nk_xla, w8a8_nk_xla

    w = RowMajorKernel(w, split=split).qarray()
    return linear_nk_xla(x, w) if act is None else w8a8_nk_xla(x, w, act)


def _xla_kn(x, w):
    from llmeq_jax.ops import weight_only_xla

    return weight_only_xla(x, w)


def _xla_swiglu(x, w):
    from llmeq_jax.ops import gated

    return gated(_xla_kn(x, w))


def _xla_nk(x, w):
    from llmeq_jax.ops import linear_nk_xla

    return linear_nk_xla(x, w)


def _xla_w8(x, w, act):
    from llmeq_jax.ops import w8a8_xla

    return w8a8_xla(x, w, act)


def _with_xla_grad(forward, reference):
    """``forward`` on the way in; the vjp of the XLA ``reference`` on the way back."""

    @jax.custom_vjp
    def f(*args):
        return forward(*args)

    def fwd(*args):
        return forward(*args), args

    def bwd(args, g):
        return jax.vjp(reference, *args)[1](g)

    f.defvjp(fwd, bwd)
    return f


_kn = _with_xla_grad(_kn_forward, _xla_kn)
_nk = _with_xla_grad(_nk_forward, _xla_nk)


def weight_only_kn(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ dequantize(w)`` for an ``(in, out)`` QArray kernel, by the native kernel."""
    _require(supports_kn(w), "weight_only_kn")
    _check_x(x, w.shape[0], "weight_only_kn")
    return _kn(x, w)


_swiglu_kn = _with_xla_grad(functools.partial(_kn_forward, swiglu=True), _xla_swiglu)


def weight_only_swiglu(x: jax.Array, w: QArray) -> jax.Array:
    """``silu(x @ gate) * (x @ up)`` for a joined ``(in, 2 F)`` weight-only gate/up QArray (gate
    first), by the native kernel: where the dequantized-panel GEMM runs (AVX-512, more than
    ``ops.NATIVE_PANEL_MIN_ROWS`` rows) the activation is applied in its registers, elsewhere in a
    second pass over the joined product."""
    _require(supports_kn(w), "weight_only_swiglu")
    _check_x(x, w.shape[0], "weight_only_swiglu")
    if w.shape[1] % 2:
        raise ValueError(f"native.weight_only_swiglu: a joined gate/up kernel has an even number of columns, got "
                         f"shape {tuple(w.shape)}")
    return _swiglu_kn(x, w)


def weight_only_nk(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ dequantize(w).T`` for an ``(out, in)`` QArray (rows contiguous), by the native kernel."""
    _require(supports_nk(w), "weight_only_nk")
    _check_x(x, w.shape[1], "weight_only_nk")
    return _nk(x, w)


def w8a8_kn(x: jax.Array, w: QArray, act) -> jax.Array:
    """W8A8 ``x @ w``: activations quantized as in :func:`llmeq_jax.ops.quantize_activations`."""
    _require(supports_w8a8(w), "w8a8_kn")
    _check_x(x, w.shape[0], "w8a8_kn")
    if act is None or act.bits > 8:
        raise ValueError(f"native.w8a8_kn: needs an activation spec of at most 8 bits, got {act!r}")
    f = _with_xla_grad(lambda a, b: _w8_forward(a, b, act), lambda a, b: _xla_w8(a, b, act))
    return f(x, w)


def row_major_matmul(x: jax.Array, w: QArray, act=None, layer=None, codes=None, split: bool = False) -> jax.Array:
    """``x @ dequantize(w).T`` for an ``(out, in)`` QArray by the row-major integer kernels.

    Weight-only (``act`` None): x is quantized on the fly to int16 per row and per
    group (the weight's, or 128 values for per-channel weights) -- a relative error
    of at most 2^-16 of the group's absmax -- and multiplied with the int8 / int4 codes
    in exact int32. With ``act`` (W8A8): activations quantized as in
    :func:`llmeq_jax.ops.quantize_activations`, exact int32 products.

    With ``layer`` (an int32 scalar, traced inside a scan), ``w`` is a stack of such QArrays
    (arrays with a leading layer axis, ``llmeq_jax.layer_slice``) and the product is with
    layer ``layer``, whose codes and scales the kernel reads in place.

    ``codes`` (weight-only): ``w``'s scales as :class:`llmeq_jax.decode_layout.ScaleCodes` (int8 codes
    times one float step per super-block, equal to ``w.scale`` exactly), which the kernel reads instead
    of ``w.scale``: the same products from fewer bytes.

    ``split`` (weight-only, int2-int6): ``w.qvalue`` holds the codes as
    :func:`llmeq_jax.decode_layout.split_codes` bytes (``decode_layout.split_rows``), read by the AVX-512
    VNNI tile (the portable loop where that tile is off; there is no AVX2 one).
    """
    _require(supports_row_major(w, act, split), "row_major_matmul")
    _check_x(x, w.shape[1], "row_major_matmul")
    if codes is not None and act is not None:
        raise ValueError("native.row_major_matmul: scale codes are for weight-only products (act=None)")
    if split:
        from llmeq_jax.decode_layout import SPLIT_BLOCK, split_block_bytes, split_tile_takes

        takes = act is None and split_tile_takes(w)
        row_bytes = w.shape[1] // SPLIT_BLOCK * split_block_bytes(w.bits) if takes else None
        if not takes or w.qvalue.shape[-1] != row_bytes or w.qvalue.dtype != jnp.uint8:
            raise ValueError(f"native.row_major_matmul: split codes need a weight-only int2-int6 kernel whose "
                             f"qvalue is decode_layout.split_codes bytes (uint8, {row_bytes} a row), got "
                             f"int{w.bits} {w.qvalue.dtype}{list(w.qvalue.shape)} with act={act}")
    if layer is not None:
        if w.qvalue.ndim != 3:
            raise ValueError(f"native.row_major_matmul: with layer=, w must be a stack [L, ...], got codes "
                             f"{w.qvalue.shape}")
        f = _with_xla_grad(lambda a, b, l, c: _rm_forward(a, b, act, l, c, split),
                           lambda a, b, l, c: _xla_row_major(a, LayerSlice(b, l).value(), act, split))
        return f(x, w, layer, codes)
    f = _with_xla_grad(lambda a, b, c: _rm_forward(a, b, act, codes=c, split=split),
                       lambda a, b, c: _xla_row_major(a, b, act, split))
    return f(x, w, codes)


def _panel_forward(x: jax.Array, panels: jax.Array, n: int, swiglu: bool) -> jax.Array:
    _require(None, "panel_matmul")
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    y = jax.ffi.ffi_call(_PANEL_TARGET, out, vmap_method="sequential")(x2, panels, swiglu=int(swiglu))
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def _panel_reference(x: jax.Array, panels: jax.Array, n: int, swiglu: bool) -> jax.Array:
    from llmeq_jax.decode_layout import unpack_panels
    from llmeq_jax.ops import gated

    y = x @ unpack_panels(panels, n, swiglu=swiglu).astype(x.dtype)
    return gated(y) if swiglu else y


def panel_matmul(x: jax.Array, panels: jax.Array, n: int, *, swiglu: bool = False) -> jax.Array:
    """``x @ w`` for a float kernel packed as ``decode_layout.pack_panels`` does: ``panels`` is
    ``[ceil(n / 32), K, 32]`` float32 (column ``c`` of ``w`` at ``panels[c // 32, :, c % 32]``).

    ``swiglu``: ``panels`` is a SwiGLU gate/up kernel packed by ``decode_layout.pack_swiglu_panels``
    (``[ceil(n / 16), K, 32]``, 16 gate then the 16 matching up columns per panel) and the result
    is ``silu(x @ gate) * (x @ up)``, ``n`` columns."""
    width = PANEL_COLS // 2 if swiglu else PANEL_COLS
    if panels.ndim != 3 or panels.shape[2] != PANEL_COLS or panels.shape[0] != -(-n // width):
        raise ValueError(f"native.panel_matmul: panels must be [ceil({n}/{width}), K, 32], got {panels.shape}")
    _check_x(x, panels.shape[1], "panel_matmul")
    f = _with_xla_grad(lambda a, b: _panel_forward(a, b, n, swiglu), lambda a, b: _panel_reference(a, b, n, swiglu))
    return f(x, panels)


def _float_forward(x: jax.Array, w: jax.Array, layer) -> jax.Array:
    _require(None, "float_matmul")
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[-1]), jnp.float32)
    y = jax.ffi.ffi_call(_FLOAT_TARGET, out, vmap_method="sequential")(x2, w, _layer_arg(layer))
    return y.reshape(*x.shape[:-1], w.shape[-1]).astype(x.dtype)


def _float_reference(x: jax.Array, w: jax.Array, layer) -> jax.Array:
    return x @ (w if layer is None else take_layer(w, layer)).astype(x.dtype)


def float_matmul(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
    """``x @ w`` for a float32 or bfloat16 ``(in, out)`` kernel ``w`` by the native decode GEMV: the
    kernel's rows streamed once per 8 rows of x (written for decode's few rows; XLA's dot is the
    better GEMM), accumulated in float32, returned in x's dtype.

    With ``layer`` (an int32 scalar, traced inside a scan), ``w`` is a stack ``[L, in, out]`` and the
    product is with layer ``layer``, read in place (XLA's dot of the layer's dynamic slice copies the
    slice out of the stack first: ``llmeq_jax.layer_slice``)."""
    if w.ndim != (2 if layer is None else 3):
        want = "a stack [L, in, out] with layer=" if layer is not None else "an (in, out) kernel"
        raise ValueError(f"native.float_matmul: w must be {want}, got shape {w.shape}")
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"native.float_matmul: w must be float32 or bfloat16, got {w.dtype}")
    _check_x(x, w.shape[-2], "float_matmul")
    return _with_xla_grad(_float_forward, _float_reference)(x, w, layer)


def _attention_forward(q, k, v, mask, layer, masked: float):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(_ATTN_TARGET, out, vmap_method="sequential")
    return call(q, k, v, mask, jnp.asarray(layer, jnp.int32), masked=np.float32(masked))


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, masked: float, reference,
                     layer=None) -> jax.Array:
    """Grouped-query attention of a few float32 query positions over a float32 cache, in one native call.

    q [B, T, H, D]; k, v [B, KV, S, D]; mask [B, T, S] bool -> [B, T, H, D]: scores
    ``q . k / sqrt(D)`` (``masked`` where the mask is False), softmax over S, weighted
    sum of v -- ``reference``'s math (its XLA code is also the backward pass).

    ``layer`` (an int or a traced int32 scalar): k and v are a stack of caches [L, B, KV, S, D]
    and the kernel reads ``k[layer]``, ``v[layer]`` in place (XLA's slice would copy them).
    """
    _require(None, "decode_attention")
    cache_ndim = 4 if layer is None else 5
    for name, a, ndim in (("q", q, 4), ("k", k, cache_ndim), ("v", v, cache_ndim)):
        if a.ndim != ndim or a.dtype != jnp.float32:
            raise ValueError(f"native.decode_attention: {name} must be a {ndim}-D float32 array, "
                             f"got {a.shape} {a.dtype}")
    if mask.shape != (q.shape[0], q.shape[1], k.shape[-2]):
        raise ValueError(f"native.decode_attention: mask must be [B, T, S] = {(q.shape[0], q.shape[1], k.shape[-2])}, "
                         f"got {mask.shape}")
    if layer is None:
        f = _with_xla_grad(lambda a, b, c, m: _attention_forward(a, b[None], c[None], m.astype(jnp.bool_), 0, masked),
                           reference)
        return f(q, k, v, mask)
    if isinstance(layer, int) and not 0 <= layer < k.shape[0]:
        raise ValueError(f"native.decode_attention: layer {layer} is outside the stack of {k.shape[0]} caches")
    f = _with_xla_grad(lambda a, b, c, m, i: _attention_forward(a, b, c, m.astype(jnp.bool_), i, masked),
                       lambda a, b, c, m, i: reference(a, b[i], c[i], m))
    return f(q, k, v, mask, jnp.asarray(layer, jnp.int32))


def kv_store_attention(q, k_codes, v_codes, k_scale, k_lo, v_scale, v_lo, scan, *, bits: int, layer,
                       allowed=None, rope_tables=None, extra=None, sm_scale: float | None = None):
    """One query per head over layer ``layer`` of a quantized KV store, read in place: ``(out [B, Hq, D]
    float32, lse [B, Hq])``, lse the log-sum-exp of the scaled scores (-1e30 where no slot is read).

    Codes ``[L, B, KV, T, D]`` int8 or ``[L, B, KV, T, D / 2]`` uint8 (int4, low nibble first) on
    asymmetric grids, ``(code - qmin) * scale + lo`` (``kv.grid.dequantize_grid``): keys per channel,
    ``[1 or B, KV, D]``; values per token, ``[L, B, KV, T, 1]`` float16 or float32. Slots ``0 .. scan - 1``
    where ``allowed`` [B, T] is set (all of them without it). ``rope_tables``: ``(cos, sin)`` [B, T, D / 2]
    of each slot's position for keys stored before RoPE (rotate-half). ``extra``: ``(k, v, seen)``, float32
    keys and values ``[L, B, KV, N, D]`` (post-RoPE; layer ``layer`` is read) and ``seen`` [B, N]: a float
    part (the cache's sinks) in the same softmax, so out and lse are over both. Forward only (decode).
    """
    _require(None, "kv_store_attention")
    b, hq, d = q.shape
    n_layers, bk, kv, t, row = k_codes.shape
    if bits not in (4, 8) or row != (d if bits == 8 else d // 2) or v_codes.shape != k_codes.shape or bk != b:
        raise ValueError(f"native.kv_store_attention: codes {k_codes.shape} / {v_codes.shape} do not hold "
                         f"{bits}-bit rows of head dim {d} for batch {b}")
    k_scale, k_lo = (jnp.asarray(a, jnp.float32).reshape(-1, kv, d) for a in (k_scale, k_lo))
    dummy = jnp.zeros((1,), jnp.float32)
    cos, sin = (dummy, dummy) if rope_tables is None else (a.astype(jnp.float32) for a in rope_tables)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out_types = (jax.ShapeDtypeStruct((b, hq, d), jnp.float32), jax.ShapeDtypeStruct((b, hq), jnp.float32))
    if extra is None:
        k_extra = v_extra = dummy
        seen = jnp.zeros((1,), jnp.int8)
    else:
        k_extra, v_extra, seen = extra
        if k_extra.ndim != 5 or k_extra.shape[:3] != (n_layers, b, kv) or k_extra.shape[4] != d \
                or v_extra.shape != k_extra.shape or seen.shape != (b, k_extra.shape[3]):
            raise ValueError(f"native.kv_store_attention: the float part must be [L, B, KV, N, D] = "
                             f"[{n_layers}, {b}, {kv}, N, {d}] keys and values and [B, N] seen, got "
                             f"{k_extra.shape} / {v_extra.shape} / {seen.shape}")
        k_extra, v_extra, seen = k_extra.astype(jnp.float32), v_extra.astype(jnp.float32), seen.astype(jnp.int8)
    call = jax.ffi.ffi_call(_KV_STORE_TARGET, out_types, vmap_method="sequential")
    return call(
        q.astype(jnp.float32) * scale, k_codes, v_codes, k_scale, k_lo, v_scale, v_lo,
        jnp.zeros((1,), jnp.int8) if allowed is None else allowed.astype(jnp.int8), cos, sin,
        jnp.asarray(scan, jnp.int32).reshape(()), jnp.asarray(layer, jnp.int32), k_extra, v_extra, seen,
        bits=np.int64(bits), masked=np.int64(allowed is not None), rope=np.int64(rope_tables is not None),
        extra=np.int64(extra is not None))


def kv_store_append(k_codes, v_codes, v_scale, v_lo, k, v, k_scale, k_lo, start, *, bits: int, layer):
    """A step's keys and values quantized and written into layer ``layer`` of a quantized KV store, in place:
    ``(k_codes, v_codes, v_scale, v_lo)`` updated (the outputs alias those inputs, so XLA writes no copy).

    Bit for bit ``kv.grid.quantize_per_channel`` (keys, on the per-channel grid ``k_scale`` / ``k_lo``
    ``[1 or B, KV, D]``) and ``kv.grid.quantize_per_token`` (values, each token's own float16 grid) written
    by ``dynamic_update_slice`` at slots ``start .. start + T - 1`` (the start clamped as it clamps): k, v
    ``[B, KV, T, D]``; codes ``[L, B, KV, S, D or D / 2]``; value grids ``[L, B, KV, S, 1]`` float16 or
    float32. No outliers. One call for what XLA runs as ~8 small ops a layer (~4 us of dispatch each on a
    CPU: most of what a quantized cache's decode step lost to a float cache's)."""
    _require(None, "kv_store_append")
    n_layers, b, kv, s, row = k_codes.shape
    d = k.shape[-1]
    if bits not in (4, 8) or row != (d if bits == 8 else d // 2) or v_codes.shape != k_codes.shape \
            or k.ndim != 4 or k.shape[:2] != (b, kv) or v.shape != k.shape or k.shape[2] > s \
            or v_scale.shape != (n_layers, b, kv, s, 1) or v_lo.shape != v_scale.shape:
        raise ValueError(f"native.kv_store_append: codes {k_codes.shape} / grids {v_scale.shape} do not hold "
                         f"{bits}-bit rows of keys / values {k.shape} / {v.shape}")
    k_scale, k_lo = (jnp.asarray(a, jnp.float32).reshape(-1, kv, d) for a in (k_scale, k_lo))
    out_types = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (k_codes, v_codes, v_scale, v_lo))
    call = jax.ffi.ffi_call(_KV_APPEND_TARGET, out_types, vmap_method="sequential",
                            input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3})
    return call(k_codes, v_codes, v_scale, v_lo, k.astype(jnp.float32), v.astype(jnp.float32), k_scale, k_lo,
                jnp.asarray(start, jnp.int32).reshape(()), jnp.asarray(layer, jnp.int32).reshape(()),
                bits=np.int64(bits))


def _w8_int32_for_tests(xq2: jax.Array, q: jax.Array, group_size: int) -> jax.Array:
    """The kernel's integer part alone, as float32 (exact: unit scales, sx = 1); for tests."""
    k, n = q.shape
    groups = math.ceil(k / group_size)
    if groups != 1:
        raise ValueError("the integer check uses one group")
    return _w8_call(
        xq2, q, jnp.ones((1, n), jnp.float32), jnp.zeros((1, 1), jnp.float32), jnp.ones((xq2.shape[0],), jnp.float32),
        group_size=group_size, has_zp=False,
    )  # fmt: skip


__all__ = [
    "PANEL_COLS",
    "available",
    "avx512",
    "decode_attention",
    "disabled",
    "enabled",
    "force_scalar",
    "integer_panels",
    "kv_store_append",
    "kv_store_attention",
    "library_path",
    "panel_matmul",
    "prefill_kernels_ok",
    "row_major_matmul",
    "simd",
    "supports_kn",
    "supports_nk",
    "supports_row_major",
    "supports_w8a8",
    "unavailable_reason",
    "w8a8_kn",
    "weight_only_kn",
    "weight_only_nk",
]
