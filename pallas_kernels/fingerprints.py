"""What each hardware-checked kernel lowers to, as digests: "checked on a GPU" said of the code that ran there.

A kernel a GPU takes by itself is one whose gpu cases passed on a GPU (``pallas_kernels.hardware_checked``). A
kernel edited after that run is not the kernel that passed, and nothing said so: four of the six checked kernels
had changed since their runs, unnoticed, when this record began (2026-12-06). So each checked kernel has a few
canonical lowerings (:func:`cases`: the shapes and dtypes a GPU's decode and prompts hand it, traced for a GPU)
whose Triton IR -- as Pallas emits it for CUDA on this CPU (``pallas_kernels.ttir``, no debug locations), with the
launch grid, warps and stages; for a path that is XLA's own fusion of our program, the jaxpr XLA gets -- is digested
into ``hardware_fingerprints.json``, the record:

* ``digests``: the lowerings whose gpu cases passed on ``run`` (a kernel in the record is checked);
* ``unrun``: lowerings changed since, with what changed, not yet run on a GPU (``gpu_session.sh`` runs those
  kernels' gpu cases first).

``tests/pallas_kernels/test_fingerprints.py`` fails where a checked kernel lowers to something the record does not
know: run its gpu cases on a GPU and record the run, record the change as unrun, or keep it behind a switch that is
off on a GPU until then. The digests are the pinned CPU JAX's (the test venv's), not the GPU machine's: they say
whether *our* kernel changed, not what Triton compiled there (a JAX upgrade changes them too).

    python -m pallas_kernels.fingerprints                                  # the record against this checkout
    python -m pallas_kernels.fingerprints --run "H100, 2026-12-10" KERNEL  # its gpu cases passed on that run
    python -m pallas_kernels.fingerprints --unrun "what changed" KERNEL    # changed since its run, not yet run
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import types
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

RECORD = Path(__file__).with_name("hardware_fingerprints.json")
sds = jax.ShapeDtypeStruct
BF16, F16, F32, I8, U8, I32 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8, jnp.uint8, jnp.int32


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One canonical call of a kernel: ``fn(*args)`` on ``jax.ShapeDtypeStruct``s; ``name`` is the Triton kernel's
    name (a call may launch others, e.g. the KV kernel's split merge, which are not this kernel's), or None for a
    path that is XLA's own fusion of our program (``llmeq_jax.subchannel``): its digest is of the jaxpr XLA gets."""

    label: str
    name: str | None
    fn: Callable
    args: tuple


def _weight_only() -> list[Lowering]:
    from pallas_kernels.weight_only import weight_only_matmul as wo

    k, n = 4096, 11008
    return [
        Lowering("int8 per channel, M=1, (K, N)", "weight_only_int8_matmul",
                 lambda x, w, s: wo(x, w, s, bits=8), (sds((1, k), BF16), sds((k, n), I8), sds((1, n), F32))),
        Lowering("int8 per channel, M=1, K-major (w8_nk)", "weight_only_int8_matmul",
                 lambda x, w, s: wo(x, w, s, bits=8, w_layout="nk"),
                 (sds((1, n), BF16), sds((k, n), I8), sds((1, k), F32))),
        Lowering("int4 g128 zero points, M=16, a stack's layer", "weight_only_int4_matmul",
                 lambda x, w, s, z, i: wo(x, w, s, bits=4, w_zero_point=z, group=128, layer=i),
                 (sds((16, k), BF16), sds((2, k // 2, n), U8), sds((2, k // 128, n), F32),
                  sds((2, k // 128, n), I8), sds((), I32))),
    ]


def _w8a8() -> list[Lowering]:
    from pallas_kernels.w8a8 import w8a8_matmul

    k, n = 4096, 11008
    nk = (sds((n, k), I8), sds((1, n), F32))
    return [
        Lowering(f"{'fp8' if fp8 else 'int8'} per token, M={m}, K-major", "w8a8_matmul",
                 lambda x, w, s, fp8=fp8: w8a8_matmul(x, w, s, fp8=fp8, w_layout="nk"), (sds((m, k), BF16), *nk))
        for m, fp8 in ((1, False), (2048, False), (16, True), (2048, True))
    ]


def _float_matmul() -> list[Lowering]:
    from pallas_kernels.float_matmul import float_matmul

    return [Lowering(f"bf16 M={m}, {k}x{n}, a stack's layer", "float_matmul",
                     lambda x, w, i: float_matmul(x, w, layer=i), (sds((m, k), BF16), sds((4, k, n), BF16), sds((), I32)))
            for m, k, n in ((1, 4096, 11008), (16, 11008, 4096))]


def _int4_words() -> list[Lowering]:
    from pallas_kernels import int4_words as iw

    k, n = 4096, 11008
    rows = iw.word_rows(k, 128)
    return [
        Lowering("g128 zero points, M=1", "int4_words_matmul",
                 lambda x, w, s, z: iw.int4_words_matmul(x, w, s, group=128, w_zero_point=z),
                 (sds((1, k), BF16), sds((rows, n), I32), sds((k // 128, n), BF16), sds((k // 128, n), I8))),
        Lowering("g128 symmetric, M=16, a stack's layer", "int4_words_matmul",
                 lambda x, w, s, i: iw.int4_words_matmul(x, w, s, group=128, layer=i),
                 (sds((16, k), BF16), sds((2, rows, n), I32), sds((2, k // 128, n), BF16), sds((), I32))),
    ]


def _store_decode_attention() -> list[Lowering]:
    from pallas_kernels.kv_cache import store_decode_attention

    b, h, g, t, d = 1, 8, 4, 4096, 128

    def case(bits: int, rope: bool, q_dtype) -> Lowering:
        cache = sds((b, h, t, d if bits == 8 else d // 2), I8 if bits == 8 else U8)
        tok, grid = sds((b, h, t, 1), F16), sds((1, h, 1, d), F32)

        def attend(q, kc, vc, ks, kl, vs, vl, n, allowed, pos, freq):
            extra = dict(slot_pos=pos, inv_freq=freq) if rope else {}
            return store_decode_attention(q, kc, vc, ks, kl, vs, vl, n, bits=bits, allowed=allowed, **extra)

        args = (sds((b, h * g, d), q_dtype), cache, cache, grid, grid, tok, tok, sds((b,), I32), sds((b, t), bool),
                sds((b, t), I32), sds((d // 2,), F32))
        label = f"int{bits} {'pre' if rope else 'post'}-RoPE keys, {jnp.dtype(q_dtype).name} queries"
        return Lowering(label, "decode_attention_int", attend, args)

    def with_sinks(bits: int) -> Lowering:  # a scanned decode's call: a stacked store's layer, four float sinks
        cache = sds((2, b, h, t, d if bits == 8 else d // 2), I8 if bits == 8 else U8)
        tok, grid, sink = sds((2, b, h, t, 1), F16), sds((2, 1, h, 1, d), F32), sds((2, b, h, 4, d), BF16)

        def attend(q, kc, vc, ks, kl, vs, vl, n, allowed, pos, freq, k_sink, v_sink, seen, layer):
            return store_decode_attention(q, kc, vc, ks, kl, vs, vl, n, bits=bits, allowed=allowed, slot_pos=pos,
                                          inv_freq=freq, sinks=(k_sink, v_sink, seen), layer=layer)

        args = (sds((b, h * g, d), BF16), cache, cache, grid, grid, tok, tok, sds((b,), I32), sds((b, t), bool),
                sds((b, t), I32), sds((d // 2,), F32), sink, sink, sds((b, 4), bool), sds((), I32))
        return Lowering(f"int{bits} pre-RoPE keys, a stack's layer, 4 float sinks", "decode_attention_int", attend, args)

    return [case(8, False, BF16), case(4, False, F32), case(8, True, BF16), case(4, True, BF16), with_sinks(8)]


def _int8_f16() -> list[Lowering]:
    from pallas_kernels.int8_f16 import int8_f16_matmul

    k, n = 4096, 11008
    return [
        Lowering(f"{jnp.dtype(dtype).name} x, M={m}, K-major{', zero points' if zp else ''}", "weight_only_int8_f16",
                 (lambda x, w, s, z: int8_f16_matmul(x, w, s, w_zero_point=z)) if zp
                 else (lambda x, w, s: int8_f16_matmul(x, w, s)),
                 (sds((m, k), dtype), sds((n, k), I8), sds((1, n), F32), *([sds((1, n), I8)] if zp else [])))
        for m, dtype, zp in ((1, BF16, False), (16, F16, True))
    ]


# The kernels not yet run on a GPU (hardware_checked.UNCHECKED), lowered as a decode step calls them, so that the run
# that passes their gpu cases can record them at once.


def _rms_norm() -> list[Lowering]:
    from pallas_kernels.rms_norm import rms_norm

    return [Lowering(f"bf16, {m} row(s) x 4096, a stack's scale", "rms_norm",
                     lambda x, s, i: rms_norm(x, s, 1e-5, layer=i), (sds((m, 4096), BF16), sds((4, 4096), F32), sds((), I32)))
            for m in (1, 16)]


def _norm_fold() -> list[Lowering]:
    from pallas_kernels.float_matmul import float_matmul
    from pallas_kernels.int4_words import int4_words_matmul
    from pallas_kernels.int8_f16 import int8_f16_matmul
    from pallas_kernels.norm_fold import NormFold

    k, n = 4096, 12288
    scale = sds((4, k), F32)
    return [
        Lowering("int4 words g128, bf16, M=1, a stack's layer, the norm folded", "int4_words_matmul",
                 lambda x, w, s, g, i: int4_words_matmul(x, w, s, group=128, layer=i, norm=NormFold(g, 1e-5)),
                 (sds((1, k), BF16), sds((4, k // 8, n), I32), sds((4, k // 128, n), F32), scale, sds((), I32))),
        Lowering("float bf16, M=1, a stack's layer, the norm folded", "float_matmul",
                 lambda x, w, g, i: float_matmul(x, w, layer=i, norm=NormFold(g, 1e-5)),
                 (sds((1, k), BF16), sds((4, k, 4096), BF16), scale, sds((), I32))),
        Lowering("int8 K-major float16 operands, bf16, M=1, a stack's layer, the norm folded",
                 "weight_only_int8_f16_matmul",
                 lambda x, w, s, g, i: int8_f16_matmul(x, w, s, layer=i, norm=NormFold(g, 1e-5)),
                 (sds((1, k), BF16), sds((4, n, k), I8), sds((4, 1, n), F32), scale, sds((), I32))),
    ]


def _split_fixup() -> list[Lowering]:
    from pallas_kernels import split_fixup
    from pallas_kernels.float_matmul import float_matmul
    from pallas_kernels.int4_words import int4_words_matmul
    from pallas_kernels.int8_f16 import int8_f16_matmul
    from pallas_kernels.norm_fold import NormFold
    from pallas_kernels.w8a8 import w8a8_matmul

    k = 4096

    def held(product):  # as a scan's layer calls it: the counters held, handed back
        def call(*args):
            with split_fixup.scope(split_fixup.zeros()) as counters:
                return product(*args), counters.value
        return call

    return [
        Lowering("int4 words g128, bf16, M=1, a stack's layer, the residual added", "int4_words_matmul",
                 held(lambda x, w, s, r, i: int4_words_matmul(x, w, s, group=128, layer=i, residual=r)),
                 (sds((1, k), BF16), sds((4, k // 8, k), I32), sds((4, k // 128, k), BF16), sds((1, k), BF16),
                  sds((), I32))),
        Lowering("int4 words g128, bf16, M=1, a stack's layer, the norm folded", "int4_words_matmul",
                 held(lambda x, w, s, g, i: int4_words_matmul(x, w, s, group=128, layer=i, norm=NormFold(g, 1e-5))),
                 (sds((1, k), BF16), sds((4, k // 8, 12288), I32), sds((4, k // 128, 12288), BF16),
                  sds((4, k), BF16), sds((), I32))),
        Lowering("int4 words g128, bf16, M=1, a stack's layer, the norm folded, SwiGLU pairs gated", "int4_words_matmul",
                 held(lambda x, w, s, g, i: int4_words_matmul(x, w, s, group=128, layer=i, norm=NormFold(g, 1e-5),
                                                              act="swiglu")),
                 (sds((1, k), BF16), sds((4, k // 8, 22016), I32), sds((4, k // 128, 22016), BF16),
                  sds((4, k), BF16), sds((), I32))),
        Lowering("int8 K-major float16 operands, bf16, M=1, a stack's layer, the norm folded, SwiGLU pairs gated",
                 "weight_only_int8_f16_matmul",
                 held(lambda x, w, s, g, i: int8_f16_matmul(x, w, s, layer=i, norm=NormFold(g, 1e-5), act="swiglu")),
                 (sds((1, k), BF16), sds((4, 22016, k), I8), sds((4, 1, 22016), F32), sds((4, k), BF16),
                  sds((), I32))),
        Lowering("W8A8 int8 K-major, bf16, M=1, a stack's layer, SwiGLU pairs gated", "w8a8_matmul",
                 held(lambda x, w, s, i: w8a8_matmul(x, w, s, layer=i, w_layout="nk", act="swiglu")),
                 (sds((1, k), BF16), sds((4, 22016, k), I8), sds((4, 1, 22016), F32), sds((), I32))),
        Lowering("float bf16, M=1, a stack's layer, the residual added", "float_matmul",
                 held(lambda x, w, r, i: float_matmul(x, w, layer=i, residual=r)),
                 (sds((1, k), BF16), sds((4, k, k), BF16), sds((1, k), BF16), sds((), I32))),
    ]


def _token_codes() -> list[Lowering]:
    from pallas_kernels.norm_fold import NormFold
    from pallas_kernels.token_codes import token_codes

    return [
        Lowering("bf16, 1 row x 4096, a stack's norm folded", "token_codes",
                 lambda x, s, i: token_codes(x, norm=NormFold(s, 1e-5), layer=i),
                 (sds((1, 4096), BF16), sds((4, 4096), BF16), sds((), I32))),
        Lowering("bf16, 16 rows x 11008", "token_codes", token_codes, (sds((16, 11008), BF16),)),
        Lowering("bf16, 2 rows x 4096, E4M3 codes", "token_codes", lambda x: token_codes(x, fp8=True),
                 (sds((2, 4096), BF16),)),
    ]


def _xla_subchannel() -> list[Lowering]:
    from llmeq_jax import subchannel
    from llmeq_jax.core.quantize import Spec, quantize

    def weight(k, n, symmetric):
        spec = Spec(bits=4, granularity="group", group_size=128, symmetric=symmetric)
        return jax.eval_shape(lambda: quantize(jnp.zeros((k, n), F32), spec))

    return [
        Lowering("bf16, 2048 rows, 4096 x 4096 int4 g128, symmetric", None, subchannel.matmul,
                 (sds((2048, 4096), BF16), weight(4096, 4096, True))),
        Lowering("bf16, 1 x 512 rows, 4096 x 11008 int4 g128, zero points", None, subchannel.matmul,
                 (sds((1, 512, 4096), BF16), weight(4096, 11008, False))),
    ]


def _append_decode_attention() -> list[Lowering]:
    from pallas_kernels.decode_attention import append_decode_attention

    def case(heads: int, kv_heads: int) -> Lowering:
        cache = sds((2, 1, kv_heads, 2048, 128), BF16)
        return Lowering(f"bf16, {heads} heads over {kv_heads}, 2048 slots, a stack's layer", "append_decode_attention",
                        lambda q, k, v, kc, vc, slot, allowed, i: append_decode_attention(q, k, v, kc, vc, slot, allowed,
                                                                                         layer=i),
                        (sds((1, heads, 128), BF16), sds((1, kv_heads, 128), BF16), sds((1, kv_heads, 128), BF16), cache,
                         cache, sds((), I32), sds((1, 2048), bool), sds((), I32)))

    cache = sds((2, 1, 32, 2048, 128), BF16)
    rope = Lowering("bf16, 32 heads, 2048 slots, a stack's layer, RoPE in the kernel", "append_decode_attention",
                    lambda q, k, v, kc, vc, slot, allowed, i, cos, sin: append_decode_attention(
                        q, k, v, kc, vc, slot, allowed, layer=i, rope=(cos, sin)),
                    (*(sds((1, 32, 128), BF16),) * 3, cache, cache, sds((), I32), sds((1, 2048), bool), sds((), I32),
                     sds((1, 64), F32), sds((1, 64), F32)))
    return [case(32, 32), case(32, 8), rope]


def _store_append() -> list[Lowering]:
    from pallas_kernels.kv_store_append import store_append

    def case(bits: int) -> Lowering:
        codes = sds((2, 1, 8, 2048, 128 if bits == 8 else 64), I8 if bits == 8 else U8)
        grid, new, key_grid = sds((2, 1, 8, 2048, 1), F16), sds((1, 8, 128), BF16), sds((1, 8, 128), F32)
        return Lowering(f"int{bits}, bf16 step, 8 KV heads, a stack's layer", f"kv_store_append_int{bits}",
                        lambda kc, vc, vs, vl, k, v, s, lo, slot, i: store_append(kc, vc, vs, vl, k, v, s, lo, slot,
                                                                                  bits=bits, layer=i),
                        (codes, codes, grid, grid, new, new, key_grid, key_grid, sds((), I32), sds((), I32)))

    return [case(8), case(4)]


def _merge_splits() -> list[Lowering]:
    from pallas_kernels.split_merge import merge_splits

    b, h, s, r, d = 1, 8, 16, 4, 128
    parts = (sds((b, h, s, r, d), F32), sds((b, h, s, r), F32))
    sinks = (sds((b, h, r, d), BF16), sds((2, b, h, 4, d), BF16), sds((2, b, h, 4, d), BF16), sds((b, 4), bool))
    return [
        Lowering("16 splits, 4 query rows a KV head, bf16 out", "merge_splits",
                 lambda o, lse: merge_splits(o, lse, r, out_dtype=BF16), parts),
        Lowering("16 splits with 4 float sinks, a stack's layer", "merge_splits",
                 lambda o, lse, q, k, v, seen, i: merge_splits(o, lse, r, sinks=(q, k, v, seen), layer=i,
                                                               out_dtype=BF16), (*parts, *sinks, sds((), I32))),
    ]


_CASES = {"weight_only": _weight_only, "w8a8": _w8a8, "float_matmul": _float_matmul, "int4_words": _int4_words,
          "store_decode_attention": _store_decode_attention, "int8_f16": _int8_f16, "rms_norm": _rms_norm,
          "append_decode_attention": _append_decode_attention, "store_append": _store_append,
          "merge_splits": _merge_splits, "norm_fold": _norm_fold, "split_fixup": _split_fixup,
          "token_codes": _token_codes,
          # cuDNN's own kernel: nothing of ours lowers to Triton, its record is the run
          "cudnn_attention": lambda: [], "xla_subchannel": _xla_subchannel}

# What the lowerings are traced for: a GPU, so that what a GPU decides by itself (hardware_checked's switches, the
# int8 kernel's x conversion) is decided as there; kernels are called directly, no dispatch table is read.
GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def cases(kernel: str) -> list[Lowering]:
    """The canonical lowerings of ``kernel`` (a kernel of the record, ``hardware_checked.CHECKED``)."""
    if kernel not in _CASES:
        raise ValueError(f"fingerprints: no canonical lowerings for {kernel!r}; expected one of {', '.join(_CASES)} "
                         "(a kernel joins the record with its lowerings written here)")
    return _CASES[kernel]()


def digest(lowering: Lowering) -> str:
    """A digest of the Triton IR and launch parameters of ``lowering``'s kernel (its other launches left out),
    traced for :data:`GPU` -- or, for an XLA path (``name`` None), of the jaxpr handed to XLA."""
    from pallas_kernels import config
    from pallas_kernels.ttir import triton_modules

    if lowering.name is None:
        with config.compiling_for(GPU):
            text = str(jax.make_jaxpr(lowering.fn)(*lowering.args))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    with config.compiling_for(GPU):
        modules = triton_modules(lowering.fn, *lowering.args)
    mine = [m for m in modules if m.name.startswith(lowering.name)]
    if not mine:
        raise RuntimeError(f"fingerprints: {lowering.label!r} launched no kernel named {lowering.name}*")
    text = "\n".join(f"{m.name} grid={m.grid} warps={m.num_warps} stages={m.num_stages}\n{m.ttir}" for m in mine)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def current(kernel: str) -> dict[str, str]:
    """label -> digest of every canonical lowering of ``kernel`` as this checkout lowers it."""
    return {c.label: digest(c) for c in cases(kernel)}


def read(path: Path = RECORD, missing_ok: bool = False) -> dict:
    """The record: kernel -> {"run": the GPU run its gpu cases passed on, "digests": label -> digest of what ran,
    "unrun": label -> {"digest", "why"} for lowerings changed since that run and not yet run on a GPU}. A missing
    record is an error (an install without it would gate every kernel on a GPU) unless ``missing_ok``."""
    if not path.is_file():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"pallas_kernels: the record of kernels checked on a GPU is missing ({path}); expected "
                                "it installed with the package (pyproject's package-data)")
    return json.loads(path.read_text())


def unexpected(kernel: str, record: dict) -> dict[str, str]:
    """label -> digest now, for each lowering of ``kernel`` the record knows neither as run nor as unrun."""
    entry = record.get(kernel, {})
    known = lambda label: {entry.get("digests", {}).get(label), entry.get("unrun", {}).get(label, {}).get("digest")}  # noqa: E731
    return {label: now for label, now in current(kernel).items() if now not in known(label)}


def record_run(kernels: list[str], run: str, path: Path = RECORD) -> dict:
    """Record this checkout's lowerings of ``kernels`` as those whose gpu cases passed on ``run`` (no unrun left)."""
    out = read(path, missing_ok=True)
    for kernel in kernels:
        out[kernel] = {"run": run, "digests": current(kernel), "unrun": {}}
    _write(out, path)
    return out


def record_unrun(kernels: list[str], why: str, path: Path = RECORD) -> dict:
    """Record this checkout's lowerings of ``kernels`` that differ from their run as changed and not yet run on a
    GPU, with ``why`` (what changed): a checked kernel keeps its place, and its gpu cases go first in the next GPU
    session (``hardware_checked.unrun_cases``)."""
    out = read(path)
    for kernel in kernels:
        if kernel not in out:
            raise ValueError(f"fingerprints: {kernel!r} has no GPU run recorded; --unrun is for a checked kernel "
                             f"changed since its run (checked: {', '.join(out)})")
        entry = out[kernel]
        before = entry.get("unrun", {})
        entry["unrun"] = {label: {"digest": now, "why": before[label]["why"] if before.get(label, {}).get("digest") == now
                                  else why}
                          for label, now in current(kernel).items() if now != entry["digests"].get(label)}
    _write(out, path)
    return out


def _write(record: dict, path: Path) -> None:
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.fingerprints", description=__doc__.split("\n")[0])
    parser.add_argument("--run", metavar="RUN", help="record KERNELs as run: their gpu cases passed on RUN "
                        "(e.g. 'H100, 2026-12-10') at this checkout")
    parser.add_argument("--unrun", metavar="WHY", help="record KERNELs' lowerings changed since their run as not yet "
                        "run on a GPU, WHY being what changed")
    parser.add_argument("kernels", nargs="*", metavar="KERNEL")
    args = parser.parse_args(argv)
    if (args.run or args.unrun) and not args.kernels:
        parser.error("--run / --unrun need the KERNELs to record")
    if args.run:
        record_run(args.kernels, args.run)
    elif args.unrun:
        record_unrun(args.kernels, args.unrun)
    record, stale = read(), 0
    for kernel, entry in record.items():
        odd = unexpected(kernel, record)
        stale += bool(odd)
        unrun = "; ".join(f"{label} ({item['why']})" for label, item in entry.get("unrun", {}).items())
        print(f"{kernel}: gpu cases passed on {entry['run']}"
              + (f"; changed since, not yet run on a GPU: {unrun}" if unrun else "")
              + (f"; NOT RECORDED: {', '.join(odd)}" if odd else ""))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
