"""What the Pallas kernels compile to on a Hopper GPU, read on a CPU: registers, shared memory,
spills and the hottest loop's instructions in SASS.

A CPU-only session cannot time a kernel, but it can compile one: Pallas lowers each kernel to
Triton IR here (``pallas_kernels.ttir``), and the ``triton`` wheel (``pip install -e '.[sass]'``)
carries the whole Triton -> PTX -> ``ptxas`` chain and ``cuobjdump``, none of which needs a GPU.
The SASS shows what the GPU would execute: which tensor-core instruction a dot became (Hopper's
wgmma ``IGMMA``/``QGMMA``/``HGMMA``, or the older ``IMMA``/``HMMA`` of mma.sync), whether operands
were converted element by element (``F2FP``, ``I2F``), gathered from shared memory a byte at a
time (``LDS.U8``), spilled to local memory (``LDL``/``STL``), and how many instructions the
hottest loop issues per weight it reads (each thread's share of the K step's weights) -- a
decode kernel that issues more than a few per weight cannot stream weights at memory speed.

Triton here is the wheel's (pinned in the ``sass`` extra), not the one inside XLA: the TTIR passes
(``make_ttir``: canonicalize, combine, ...) are run first as XLA's pipeline runs them, but the
code may differ in detail from what a GPU's jaxlib builds. Read it as a static check before a GPU
run, not as a timing.

    PYTHONPATH=. python scripts/kernel_sass.py [--cases wo_int4_m1 w8a8_int8_m4096 ...] [--arch 90]
        [--keep DIR]   # also write each kernel's TTIR, TTGIR, PTX and SASS there
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.ttir import TritonKernel, triton_modules  # noqa: E402

K, N, GROUP = 4096, 11008, 128
SDS = jax.ShapeDtypeStruct
TENSOR_CORE = ("GMMA", "IMMA", "HMMA", "QMMA")  # wgmma (IGMMA/HGMMA/QGMMA) and mma.sync forms
CONVERSIONS = ("F2FP", "I2F", "F2I", "I2FP", "F2F")
SPILLS = ("LDL", "STL")


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call to compile: ``build()`` -> (fn, args); ``weights_per_step(kernel, unrolled)``: the
    weights one program reads per iteration of its hottest loop, or in all when ptxas unrolled the loop
    (None where that is not the point)."""

    build: Callable[[], tuple]
    weights_per_step: Callable[[TritonKernel, bool], int] | None = None


def _weight_only(m: int, bits: int, gemv: bool = False, w_layout: str = "kn", dequant: str | None = None) -> Case:
    from pallas_kernels.blocks import Blocks, matmul_blocks
    from pallas_kernels.gemv import gemv_blocks
    from pallas_kernels.weight_only import SCALED_WIDE_M, weight_only_matmul

    def build():
        rows, dtype = (K // 2, jnp.uint8) if bits == 4 else (K, jnp.int8)
        stored = (N, rows) if w_layout == "nk" else (rows, N)
        args = (SDS((m, K), jnp.bfloat16), SDS(stored, dtype), SDS((K // GROUP, N), jnp.bfloat16),
                SDS((K // GROUP, N), jnp.int8))
        return (lambda x, w, s, z: weight_only_matmul(x, w, s, bits=bits, w_zero_point=z, group=GROUP, gemv=gemv,
                                                      w_layout=w_layout, dequant=dequant)), args

    def per_step(kernel, unrolled):
        b = gemv_blocks(K, N, GROUP) if gemv else matmul_blocks(m, N, K, GROUP, min_bk=32 if bits == 4 else 16)
        if dequant == "scaled" and m >= SCALED_WIDE_M:
            b = Blocks(256, 128, GROUP)  # weight_only_matmul's own prefill blocks for it
        return b.bn * (K // kernel.grid[-1] if unrolled else b.bk)  # the last grid axis splits K

    return Case(build, per_step)


def _int8_f16(m: int, bn: int | None = None, bk: int | None = None) -> Case:
    """int8 K-major with float16 operands (pallas_kernels/int8_f16.py): per-channel scales, zero points."""
    from pallas_kernels.blocks import Blocks
    from pallas_kernels.int8_f16 import DEFAULT_BLOCKS
    from pallas_kernels.weight_only import weight_only_matmul

    bm, bn0, bk0, warps, stages = DEFAULT_BLOCKS
    blocks = Blocks(bm, bn or bn0, bk or bk0, warps, stages)

    def build():
        args = (SDS((m, K), jnp.bfloat16), SDS((N, K), jnp.int8), SDS((1, N), jnp.float32), SDS((1, N), jnp.int8))
        return (lambda x, w, s, z: weight_only_matmul(x, w, s, bits=8, w_zero_point=z, w_layout="nk", dequant="f16",
                                                      blocks=blocks)), args

    return Case(build, lambda kernel, unrolled: blocks.bn * (K // kernel.grid[-1] if unrolled else blocks.bk))


def _int4_words(m: int, bn: int | None = None, bk: int | None = None, stages: int | None = None,
                epilogue: str = "rows") -> Case:
    from pallas_kernels import int4_words
    from pallas_kernels.blocks import Blocks

    blocks = int4_words.default_blocks(m, N, GROUP)
    blocks = Blocks(blocks.bm, bn or blocks.bn, bk or blocks.bk, blocks.num_warps, stages or blocks.num_stages)

    def build():
        args = (SDS((m, K), jnp.bfloat16), SDS((int4_words.word_rows(K, GROUP), N), jnp.int32),
                SDS((K // GROUP, N), jnp.bfloat16), SDS((K // GROUP, N), jnp.int8))
        return (lambda x, w, s, z: int4_words.int4_words_matmul(x, w, s, group=GROUP, w_zero_point=z,
                                                                blocks=blocks, epilogue=epilogue)), args

    def per_step(kernel, unrolled):
        return blocks.bn * (K // kernel.grid[-1] if unrolled else blocks.bk)

    return Case(build, per_step)


def _int4_words_prefill(m: int, bm: int | None = None, warps: int | None = None, stages: int | None = None) -> Case:
    from pallas_kernels import int4_words, int4_words_prefill
    from pallas_kernels.blocks import Blocks

    blocks = int4_words_prefill.default_blocks(m, N)
    blocks = Blocks(bm or blocks.bm, blocks.bn, blocks.bk, warps or blocks.num_warps, stages or blocks.num_stages)

    def build():
        args = (SDS((m, K), jnp.bfloat16), SDS((int4_words.word_rows(K, GROUP), N), jnp.int32),
                SDS((K // GROUP, N), jnp.bfloat16), SDS((K // GROUP, N), jnp.int8))
        return (lambda x, w, s, z: int4_words_prefill.int4_words_prefill(x, w, s, group=GROUP, w_zero_point=z,
                                                                         blocks=blocks)), args

    def per_step(kernel, unrolled):
        return blocks.bn * (K if unrolled else blocks.bk)

    return Case(build, per_step)


def _w8a8(m: int, fp8: bool, w_layout: str = "kn") -> Case:
    from pallas_kernels.blocks import matmul_blocks
    from pallas_kernels.w8a8 import w8a8_matmul

    def build():
        stored = (N, K) if w_layout == "nk" else (K, N)
        args = (SDS((m, K), jnp.bfloat16), SDS(stored, jnp.int8), SDS((1, N), jnp.float32))
        return (lambda x, w, s: w8a8_matmul(x, w, s, fp8=fp8, w_layout=w_layout)), args

    def per_step(kernel, unrolled):
        b = matmul_blocks(m, N, K, None, int8=True)
        return b.bn * (K // kernel.grid[-1] if unrolled else b.bk)  # the last grid axis splits K

    return Case(build, per_step)


def _kv_attention(bits: int, t: int = 32768, rope: bool = False, stages: int = 2, warps: int = 4,
                  block_t: int = 128, sinks: int = 0) -> Case:
    from pallas_kernels.kv_cache import store_decode_attention

    def build():
        b, h, hq, d = 1, 8, 32, 128
        per_byte = 8 // bits
        codes = SDS((b, h, t, d // per_byte), jnp.int8 if bits == 8 else jnp.uint8)
        args = (SDS((b, hq, d), jnp.bfloat16), codes, codes, SDS((1, h, 1, d), jnp.float32),
                SDS((1, h, 1, d), jnp.float32), SDS((b, h, t, 1), jnp.float16), SDS((b, h, t, 1), jnp.float16),
                SDS((b,), jnp.int32), SDS((b, t), jnp.int32), SDS((d // 2,), jnp.float32))

        def attend(q, kc, vc, ks, kl, vs, vl, n, pos, freq):
            extra = dict(slot_pos=pos, inv_freq=freq) if rope else {}
            if sinks:  # the cache's float attention sinks (bf16), read in the same softmax
                float_tokens = jnp.zeros((b, h, sinks, d), jnp.bfloat16)
                extra["sinks"] = (float_tokens, float_tokens, jnp.ones((b, sinks), bool))
            return store_decode_attention(q, kc, vc, ks, kl, vs, vl, n, bits=bits, num_stages=stages, num_warps=warps,
                                          block_t=block_t, **extra)

        return attend, args

    return Case(build)


def _float_attention(t: int, splits: int | None = None, block_t: int = 64) -> Case:
    from pallas_kernels.decode_attention import append_decode_attention

    def build():  # Llama-2-7B's heads, one layer of a 2-layer bf16 stack
        b, h, d = 1, 32, 128
        cache = SDS((2, b, h, t, d), jnp.bfloat16)
        args = (SDS((b, h, d), jnp.bfloat16), SDS((b, h, d), jnp.bfloat16), SDS((b, h, d), jnp.bfloat16), cache, cache,
                SDS((), jnp.int32), SDS((b, t), jnp.bool_), SDS((), jnp.int32))

        def attend(q, kn, vn, kc, vc, slot, allowed, layer):
            return append_decode_attention(q, kn, vn, kc, vc, slot, allowed, layer=layer, num_splits=splits,
                                           block_t=block_t)

        return attend, args

    return Case(build)


def _store_append(bits: int) -> Case:
    from pallas_kernels.kv_store_append import store_append

    def build():  # Llama-2-7B's heads, 2048 slots, one layer of a 2-layer store, a bf16 step
        b, h, d, t = 1, 32, 128, 2048
        codes = SDS((2, b, h, t, d if bits == 8 else d // 2), jnp.int8 if bits == 8 else jnp.uint8)
        grid = SDS((2, b, h, t, 1), jnp.float16)
        new, key_grid = SDS((b, h, d), jnp.bfloat16), SDS((1, h, d), jnp.float32)
        args = (codes, codes, grid, grid, new, new, key_grid, key_grid, SDS((), jnp.int32), SDS((), jnp.int32))

        def append(kc, vc, vs, vl, k, v, ks, kl, slot, layer):
            return store_append(kc, vc, vs, vl, k, v, ks, kl, slot, bits=bits, layer=layer)

        return append, args

    return Case(build)


CASES: dict[str, Case] = {
    "wo_int4_m1": _weight_only(1, 4),
    "wo_int4_m16": _weight_only(16, 4),
    "wo_int4_m16_asm": _weight_only(16, 4, dequant="asm"),
    "wo_int4_m2048": _weight_only(2048, 4),
    "wo_int4_m2048_scaled": _weight_only(2048, 4, dequant="scaled"),
    "wo_int4_m1_words": _int4_words(1),
    "wo_int4_m16_words": _int4_words(16),
    "wo_int4_m16_words_bn128": _int4_words(16, bn=128),
    "wo_int4_m1_words_bk256": _int4_words(1, bk=256),  # two word blocks an iteration
    "wo_int4_m1_words_bn128_bk256": _int4_words(1, bn=128, bk=256),
    "wo_int4_m1_words_bn128_bk512": _int4_words(1, bn=128, bk=512),
    "wo_int4_m1_words_bn128_4stages": _int4_words(1, bn=128, stages=4),
    "wo_int4_m1_words_mma": _int4_words(1, epilogue="mma"),  # scale / zero point through dots: no conversions
    "wo_int4_m1_words_bn128_mma": _int4_words(1, bn=128, epilogue="mma"),
    # prompts over the decode words, the weights as wgmma's A operand from registers (256 / 128 token rows)
    "wo_int4_m2048_words": _int4_words_prefill(2048),
    "wo_int4_m2048_words_bm128": _int4_words_prefill(2048, bm=128),
    "wo_int4_m512_words": _int4_words_prefill(512),
    "wo_int8_m1": _weight_only(1, 8),
    "wo_int8_m1_kmajor": _weight_only(1, 8, w_layout="nk"),
    "wo_int8_m1_kmajor_f16": _int8_f16(1),  # float16 operands: one prmt per two weights
    "wo_int8_m16_kmajor_f16": _int8_f16(16),
    "wo_int8_m1_kmajor_f16_bk256": _int8_f16(1, bk=256),
    "wo_int8_m1_kmajor_f16_bn512": _int8_f16(1, bn=512),
    "gemv_int4_m1": _weight_only(1, 4, gemv=True),
    "w8a8_int8_m16": _w8a8(16, False),
    "w8a8_int8_m16_kmajor": _w8a8(16, False, "nk"),
    "w8a8_int8_m4096": _w8a8(4096, False),
    "w8a8_fp8_m16": _w8a8(16, True),
    "w8a8_fp8_m16_kmajor": _w8a8(16, True, "nk"),
    "w8a8_fp8_m4096": _w8a8(4096, True),
    "kv_int8_32k": _kv_attention(8),
    "kv_int8_32k_3stages": _kv_attention(8, stages=3),  # the codes' cp.async pipeline one block deeper
    # 8 warps over 256-token blocks: the loop's barriers (cross-warp softmax, the weights' layout) per 256 tokens
    "kv_int8_32k_8warps_256": _kv_attention(8, warps=8, block_t=256),
    "kv_int4_32k": _kv_attention(4),
    "kv_int8_32k_rope": _kv_attention(8, rope=True),  # keys stored before RoPE (the default KV spec)
    "kv_int8_32k_rope_sinks": _kv_attention(8, rope=True, sinks=4),  # ... with its 4 float sinks in the kernel
    "float_attention_160": _float_attention(160),  # the float cache's decode step: written and read by one kernel
    "float_attention_4k": _float_attention(4096),
    "kv_append_int8": _store_append(8),  # the quantized store's write of a decode step
    "kv_append_int4": _store_append(4),
}


# --------------------------------------------------------------------------- SASS reading


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in ``cuobjdump -sass`` output."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    """The opcode of one instruction, its predicate (``@P0``, ``@!PT``) dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def hottest_loop(ins: list[tuple[int, str]]) -> list[str] | None:
    """The instructions of the widest loop (a backward branch and its target), or None (no loop:
    ptxas unrolled it, or there was none)."""
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and opcode(text) == "BRA":
            loops.append((int(m.group(1), 16), addr))
    if not loops:
        return None
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return [t for a, t in ins if lo <= a <= hi]


def summarize(sass: str) -> dict:
    """Counts of what matters in the hottest loop (the whole kernel where it has none: ``unrolled``):
    all instructions, tensor-core ops by name, conversions, byte accesses to shared memory, spills,
    shuffles, float adds/FMAs."""
    ins = instructions(sass)
    loop = hottest_loop(ins)
    unrolled = loop is None
    if unrolled:
        loop = [t for _, t in ins]
    ops = collections.Counter(opcode(t) for t in loop)

    def count(pred) -> int:
        return sum(c for op, c in ops.items() if pred(op))

    return {
        "loop": len(loop),
        "unrolled": unrolled,
        "tensor_core": {op: c for op, c in ops.items() if any(k in op for k in TENSOR_CORE)},
        "conversions": count(lambda op: op.startswith(CONVERSIONS)),
        "shared_bytes": count(lambda op: op.startswith(("LDS.U8", "LDS.S8", "STS.U8", "STS.S8"))),
        "spills": count(lambda op: op.startswith(SPILLS)),
        "shuffles": count(lambda op: op.startswith("SHFL")),
        "float": count(lambda op: op.startswith(("FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2"))),
        "top": ops.most_common(6),
    }


# --------------------------------------------------------------------------- compiling


def _triton():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise SystemExit("kernel_sass.py needs the triton wheel: pip install -e '.[sass]'") from e
    return triton


def compile_kernel(kernel: TritonKernel, arch: int, folder: Path) -> tuple[str, str, int]:
    """(SASS text, cuobjdump resource usage, dynamic shared memory in bytes) of ``kernel`` compiled for
    sm_``arch`` (the launch needs that much: at most 227 KB a block on Hopper)."""
    triton = _triton()
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", arch, 32)
    source = folder / f"{kernel.name}.ttir"
    source.write_text(kernel.ttir)
    # triton.compile skips the TTIR passes for IR sources; XLA runs them, so run them first.
    context = ir.context()
    ir.load_dialects(context)
    CUDABackend(target).load_dialects(context)
    module = ir.parse_mlir_module(str(source), context)
    module.context = context  # what make_ttir's pass manager is built on
    module = CUDABackend.make_ttir(module, {}, None, arch)
    optimized = folder / f"{kernel.name}.opt.ttir"
    optimized.write_text(str(module))
    compiled = triton.compile(str(optimized), target=target,
                              options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    cubin = folder / f"{kernel.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    for stage in ("ttgir", "ptx"):
        (folder / f"{kernel.name}.{stage}").write_text(compiled.asm[stage])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    run = lambda *flags: subprocess.run([str(tool), *flags, str(cubin)], capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout
    sass = run("-sass")
    (folder / f"{kernel.name}.sass").write_text(sass)
    return sass, run("--dump-resource-usage"), compiled.metadata.shared


def resources(usage: str) -> dict:
    """Registers, shared memory (bytes) and local memory (spill bytes) from cuobjdump's resource usage."""
    field = lambda key: int(re.search(rf"{key}:(\d+)", usage).group(1))  # noqa: E731
    return {"regs": field("REG"), "local": field("LOCAL")}


def report(name: str, case: Case, arch: int, folder: Path) -> dict:
    fn, args = case.build()
    rows = []
    for kernel in triton_modules(fn, *args):
        sass, usage, shared = compile_kernel(kernel, arch, folder)
        row = {"case": name, "kernel": kernel.name, "warps": kernel.num_warps, "grid": kernel.grid,
               **resources(usage), "smem_kb": shared / 1024, **summarize(sass)}
        if case.weights_per_step is not None:
            row["per_weight"] = row["loop"] / (case.weights_per_step(kernel, row["unrolled"]) / (32 * kernel.num_warps))
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    parser.add_argument("--keep", type=Path, help="write TTIR/TTGIR/PTX/SASS of each kernel here")
    args = parser.parse_args(argv)
    _triton()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="kernel_sass_"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"sm_{args.arch}, K x N = {K} x {N}, group {GROUP}; loop = the hottest loop's instructions "
          "(per thread; '(all)': no loop left, the whole kernel); per weight = loop / weights each thread "
          "reads per iteration (in all, for '(all)')")
    print("| case | kernel | warps | regs | spill B | shared KB | loop | per weight | tensor core | conversions | "
          "LDS/STS bytes | shuffles | top ops |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for name in args.cases:
        for r in report(name, CASES[name], args.arch, folder):
            per = f"{r['per_weight']:.2f}" if "per_weight" in r else ""
            loop = f"{r['loop']} (all)" if r["unrolled"] else str(r["loop"])
            tc = ", ".join(f"{op} x{c}" for op, c in r["tensor_core"].items()) or "none"
            top = ", ".join(f"{op} {c}" for op, c in r["top"])
            print(f"| {name} | {r['kernel']} | {r['warps']} | {r['regs']} | {r['local']} | {r['smem_kb']:.0f} | "
                  f"{loop} | {per} | {tc} | "
                  f"{r['conversions']} | {r['shared_bytes']} | {r['shuffles']} | {top} |", flush=True)
    print(f"(files in {folder})")


if __name__ == "__main__":
    main()
