"""What a GPU would run for one decode loop, compiled on a CPU: XLA's deviceless AOT compilation.

A CPU-only session cannot time the GPU, but with JAX's CUDA plugin installed it can run XLA's whole
GPU pipeline against a *described* GPU (``jax.experimental.topologies`` with a GPU target config):
fusion, scheduling, buffer assignment, the thunks the executable would launch, PTX and cubin. This
script traces ``generate``'s decode loop for that GPU (``pallas_kernels.config.compiling_for``: the
kernels, layouts and dispatch-table choices a GPU makes), compiles it, and reads from XLA's dumps,
for the loop over the stacked decoder blocks (one decoder layer, one token):

* every launch: the Pallas kernels (name and grid) and cuDNN's, XLA's GEMMs (Triton fusions or cuBLAS calls),
  the other fusions -- a count to compare variants by (XLA wraps them in command buffers);
* every copy of 1 MiB or more (a ``copy`` or a dynamic-slice fusion): bytes a decode step moves for
  nothing. XLA copies a layer's slice out of a stacked array before a GEMM or a custom call that
  takes it (seen: bf16 Llama-2-7B shapes, 404 MB per layer and token before the float kernel took
  the stack in place).

``--sass``: each Pallas kernel of the loop as XLA's own Triton compiled it (the PTX in XLA's dump, through
``ptxas`` and ``cuobjdump``): registers and the hottest loop (``kernel_sass.summarize``) -- the Triton the
GPU machine's jaxlib carries, where ``kernel_sass.py`` uses the ``triton`` wheel's.

Deviceless compiles do not autotune: XLA's GEMMs show its default (Triton) choice, where a real GPU
may pick cuBLAS. Read it as a static check before a GPU run, like ``kernel_sass.py``, not as a timing.

Setup -- a venv of its own (the CUDA plugin does not belong in the CPU test venv), with the GPU
machine's JAX (0.11.x needs Python >= 3.12; 0.10.2 with Python 3.11 works the same way):

    python3.12 -m venv .venv-aot && .venv-aot/bin/pip install "jax==0.11.2" "jaxlib==0.11.2"
    .venv-aot/bin/pip install --no-deps "jax-cuda12-plugin==0.11.2" "jax-cuda12-pjrt==0.11.2" \\
        "nvidia-cuda-nvcc-cu12==12.9.86"          # ptxas + libdevice: no CUDA toolkit needed
    .venv-aot/bin/pip install flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 pyyaml tqdm \\
        safetensors==0.8.0 gguf==0.19.0 transformers==5.23.0 sentencepiece
    .venv-aot/bin/pip install --no-deps triton==3.9.0   # only for --sass: its cuobjdump
    PYTHONPATH=. .venv-aot/bin/python scripts/gpu_aot.py --shapes llama-2-7b --layers 2 \\
        --recipes bf16 rtn-w4-g128 rtn-w8 rtn-w8a8 [--kv-bits 8 [--kv-post-rope] [--kv-static] [--kv-sinks N]
        --context 8192]
        [--device h200] [--xla] [--sass] [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never initialise a GPU backend: the topology describes one

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_sass (--sass)

# GpuTargetConfig text protos of GPUs: the two the device tool lends, and two it does not (an A100; an L40, which
# stands for the sm_89 cards, L40S and RTX 4090 alike, whose names JAX's deviceless Pallas lowering does not know)
# that users run, with less shared memory per block than Hopper: a kernel sized for an H100 that does not fit fails
# their compile (device_description_str is the device_kind the dispatch tables are keyed by).
_DEVICE_INFO = ("threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
                "shared_memory_per_core: {smem_core} threads_per_core_limit: {threads} core_count: {cores} "
                "fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
                "l2_cache_size: {l2} clock_rate_ghz: {clock} shared_memory_per_block_optin: {smem_block} "
                "cuda_compute_capability {{ major: {major} minor: {minor} }} registers_per_core_limit: 65536 "
                "registers_per_block_limit: 65536 memory_bandwidth: {bandwidth} device_memory_size: {memory}")
_HOPPER = dict(major=9, minor=0, cores=132, smem_block=232448, smem_core=233472, threads=2048, l2=52428800,
               clock=1.98)
TARGETS = {
    "h100": dict(_HOPPER, kind="NVIDIA H100 80GB HBM3", bandwidth=3352320000000, memory=84929347584),
    "h200": dict(_HOPPER, kind="NVIDIA H200", bandwidth=4800000000000, memory=150754820096),
    "a100": dict(kind="NVIDIA A100-SXM4-80GB", major=8, minor=0, cores=108, smem_block=166912, smem_core=167936,
                 threads=2048, l2=41943040, clock=1.41, bandwidth=2039000000000, memory=85100000000),
    "l40": dict(kind="NVIDIA L40", major=8, minor=9, cores=142, smem_block=101376, smem_core=102400,
                threads=1536, l2=100663296, clock=2.52, bandwidth=864000000000, memory=48305799168),
}
COPY_MIN_BYTES = 1 << 20
COPY_OPS = "copy|copy-start|dynamic-slice|fusion|fusion-start|async-start"  # HLO ops that may copy (big_copies)
BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}  # s4: XLA packs two a byte


def target_config(device: str) -> str:
    target = TARGETS[device]
    info = _DEVICE_INFO.format(**target)
    return (f"gpu_device_info {{ {info} }}\nplatform_name: \"CUDA\"\ndnn_version_info {{ major: 9 minor: 7 }}\n"
            f"runtime_version {{ major: 12 minor: 8 patch: 0 }}\ndevice_description_str: \"{target['kind']}\"\n")


# --------------------------------------------------------------------------- reading XLA's dumps


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in an HLO type string (a tuple's elements summed)."""
    return int(sum(BYTES.get(dtype, 0) * _prod(dims)
                   for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", text)))


def _prod(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def innermost_loop_body(thunks: str) -> list[str]:
    """The thunk lines of the body of the most deeply nested ``kWhile`` (the scan over the blocks, inside
    the loop over tokens); of several as deep, the longest (a tied LM head over a quantized table is a loop over
    the table's row chunks beside the layers' loop)."""
    lines = thunks.splitlines()
    whiles = [(len(line) - len(line.lstrip()), i) for i, line in enumerate(lines) if "kWhile" in line]
    if not whiles:
        return []
    deepest = max(indent for indent, _ in whiles)
    return max((_loop_body(lines, start, indent) for indent, start in whiles if indent == deepest), key=len)


def _loop_body(lines: list[str], start: int, indent: int) -> list[str]:
    """The thunk lines of the body of the ``kWhile`` at line ``start`` (indented by ``indent``)."""
    body, inside = [], False
    for line in lines[start + 1:]:
        depth = len(line) - len(line.lstrip())
        if line.strip() and depth <= indent and not line.strip().endswith(":"):
            break
        if line.strip() == "body:":
            inside = True
        elif inside:
            body.append(line.strip())
    return body


def launches(body: list[str]) -> dict:
    """Kernels launched by a loop body's thunks: Pallas kernels (name, grid), GEMMs, other fusions, copies."""
    out = {"pallas": [], "gemm": 0, "fusion": 0, "copy": 0}
    for line in body:
        m = re.match(r"\d+: (k\w+)\s+\[[^]]*\]\s*(\S+)?(?: grid: (\[[^]]*\]))?", line)
        if not m:
            continue
        kind, name, grid = m.groups()
        if kind == "kCopy":
            out["copy"] += 1
        elif kind in ("kCublasLtMatmul", "kGemm") or (name or "").startswith(("gemm_fusion", "cublas")):
            out["gemm"] += 1
        elif kind == "kCustomKernel" and name and is_pallas(name):
            out["pallas"].append(f"{name} {grid}")
        elif kind == "kCuDnn":  # cuDNN's flash attention (a prompt's, kv.attention.attention_flash)
            out["pallas"].append("cuDNN")
        elif kind == "kCustomCall":  # an FFI custom call: here Mosaic GPU's kernels (pallas_kernels.w8a8_hopper)
            out["pallas"].append("custom call")
        elif kind == "kCustomKernel":
            out["fusion"] += 1
    return out


def computations(hlo: str) -> dict[str, list[str]]:
    """The HLO module's computations: name -> instruction lines."""
    out, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if header:
            current = out.setdefault(header.group(1), [])
        elif current is not None and line.startswith("  "):
            current.append(line)
    return out


def innermost_body(comps: dict[str, list[str]]) -> str:
    """The largest while body that holds no while itself (the scan over the blocks)."""
    bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"body=%([\w.\-]+)", line)}
    inner = [b for b in bodies if not any(" while(" in line for line in comps.get(b, []))]
    if not inner:
        raise SystemExit("no while loop in the compiled module: were the blocks stacked?")
    return max(inner, key=lambda b: len(comps[b]))


def big_copies(hlo: str) -> list[tuple[str, int]]:
    """(instruction, bytes) of every copy or dynamic-slice fusion of at least COPY_MIN_BYTES in the innermost
    loop's body (what runs there as a copy of its own, not what a fusion reads in place). An asynchronous one
    (``copy-start``, or an ``async-start`` / ``fusion-start`` of a dynamic-slice fusion, which XLA 0.11 schedules
    on another stream: a prompt's stacked bf16 weights) counts its result, not the operands its tuple also holds."""
    out, comps = [], computations(hlo)
    for line in comps[innermost_body(comps)]:
        m = re.match(rf"\s+(?:ROOT )?%([\w.\-]+) = (.+?) ({COPY_OPS})\(", line)
        if not m:
            continue
        name, result, op = m.groups()
        if op in ("fusion", "fusion-start", "async-start") and not _slices(line, comps):
            continue
        if op.endswith("-start"):  # ((operands) or operand, result, context)
            result = tuple_elements(result)[1]
        nbytes = shape_bytes(result.split(" ")[0] if op in ("copy", "dynamic-slice") else result)
        if nbytes >= COPY_MIN_BYTES:
            out.append((name, nbytes))
    return out


def fusion_writes(hlo: str) -> tuple[int, int]:
    """(bytes the GEMM fusions write, bytes every other fusion writes) in the innermost loop's body: at a prompt's rows,
    where the layer is compute-bound and launches matter little, the second is the traffic a path adds around its
    GEMMs (a dequantized weight copy, unpacked codes, an activation's conversion)."""
    comps = computations(hlo)
    gemm = other = 0
    for line in comps[innermost_body(comps)]:
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (.+?) fusion\(", line)
        if m:
            nbytes = shape_bytes(m.group(2))
            if m.group(1).startswith("gemm_fusion"):
                gemm += nbytes
            else:
                other += nbytes
    return gemm, other


def _slices(line: str, comps: dict[str, list[str]]) -> bool:
    """Whether a fusion (or an asynchronous start of one) is a dynamic-slice fusion: by its name, the fused
    computation it calls, or, for an ``async-start``, the fusion its called computation holds (a fusion's own
    computation is not searched: slicing inside it reads in place)."""
    name = line.split("=", 1)[0]
    called = re.search(r"calls=%([\w.\-]+)", line)
    inner = comps.get(called.group(1), []) if called and " async-start(" in line else []
    return any("dynamic_slice" in s or "dynamic-slice" in s
               for s in (name, called.group(1) if called else "", *(x.split("=", 1)[0] for x in inner)))


def tuple_elements(text: str) -> list[str]:
    """The top-level elements of an HLO tuple type ``(a, (b, c), d)``; a non-tuple type as its only element."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(text[start:i].strip())
        elif ch == "," and depth == 1:
            out.append(text[start:i].strip())
            start = i + 1
    return out


def is_pallas(name: str) -> bool:
    """A kernel Pallas named (XLA names its own fusions loop_/input_/wrapped_/gemm_fusion_/fusion...)."""
    return not re.match(r"(loop|input|wrapped|fusion|gemm_fusion|triton_|cutlass|cublas)", name)


# The newest PTX ISA the ptxas of nvidia-cuda-nvcc-cu12 12.9 (this script's setup) reads.
PTXAS_ISA = "8.8"


def ptx_for_ptxas(ptx: str, isa: str = PTXAS_ISA) -> str:
    """``ptx`` with a newer ``.version`` lowered to ``isa``: Mosaic GPU (jaxlib 0.11.2) writes PTX ISA 9.0 for
    kernels that use no 9.0 instruction; one that did would fail in ptxas, loudly, not compile to something else."""
    def lower(m):
        return m.group(0) if tuple(map(int, m.group(1).split("."))) <= tuple(map(int, isa.split("."))) \
            else f".version {isa}"
    return re.sub(r"^\.version (\d+\.\d+)", lower, ptx, count=1, flags=re.M)


def pallas_sass(folder: Path, arch: str = "sm_90a", extra: list[Path] = ()) -> list[dict]:
    """Each Pallas kernel in XLA's PTX dump of ``folder`` (and the Mosaic GPU kernels' PTX files ``extra``)
    compiled by ``ptxas`` and read as SASS: name, registers, spill bytes and ``kernel_sass.summarize``'s hottest
    loop."""
    import subprocess

    import kernel_sass  # scripts/ is on sys.path when this runs as a script

    ptxas = _tool("nvidia/cuda_nvcc/bin/ptxas")
    cuobjdump = _tool("triton/backends/nvidia/bin/cuobjdump")
    rows, seen = [], set()
    for ptx in [*sorted(folder.glob("*.ptx")), *extra]:
        text = ptx.read_text()
        entries = re.findall(r"\.entry (\w+)", text)
        if not entries:
            continue
        # Mosaic GPU names every kernel alike (anonymous_mosaic_gpu_kernel): its dump's file tells them apart
        name = entries[0] if ptx.parent == folder else f"{entries[0]} ({ptx.stem})"
        if not is_pallas(name) or name in seen:
            continue
        seen.add(name)
        cubin = folder / (re.sub(r"\W+", "_", name).strip("_") + ".cubin")
        source = cubin.with_suffix(".for_ptxas.ptx")
        source.write_text(ptx_for_ptxas(text))
        subprocess.run([str(ptxas), f"-arch={arch}", str(source), "-o", str(cubin)], check=True, capture_output=True)
        run = lambda *flags: subprocess.run([str(cuobjdump), *flags, str(cubin)], capture_output=True, text=True,  # noqa: E731
                                            check=True).stdout
        rows.append({"kernel": name, **kernel_sass.resources(run("--dump-resource-usage")),
                     **kernel_sass.summarize(run("-sass"))})
    return rows


def _tool(relative: str) -> Path:
    """A binary shipped inside an installed wheel (site-packages/``relative``)."""
    for root in map(Path, sys.path):
        if (root / relative).is_file():
            return root / relative
    raise SystemExit(f"--sass needs {relative} (see this script's docstring for the wheels that carry it)")


def read_dump(folder: Path, module: str = "_decode_loop") -> tuple[str, str]:
    """(optimized HLO, thunk sequence) of the decode loop's module (or ``module``'s) in an ``xla_dump_to``
    folder."""
    def one(pattern):
        files = sorted(folder.glob(pattern))
        if not files:
            raise SystemExit(f"no {pattern} in {folder}: did XLA dump the module?")
        return files[-1].read_text()

    return one(f"*{module}*gpu_after_optimizations.txt"), one(f"*{module}*thunk_sequence.txt")


# --------------------------------------------------------------------------- compiling the decode loop


def abstract_model(args, recipe: str):
    """(config, params as shapes, one block per layer): bf16 traced abstractly; recipes quantize real random
    weights on this CPU (quantization is not traceable), then only their shapes go on."""
    import jax
    import jax.numpy as jnp

    from llmeq_jax import pipeline
    from llmeq_jax.models import shapes

    config = shapes.shape_config(args.shapes, args.layers)

    def build():
        params = shapes.random_params(config, jnp.bfloat16)
        if recipe != "bf16":
            params = pipeline.run_recipe(config, params, None, pipeline.read_recipe(recipe), None, 16,
                                         progress=False).params
        return params

    return config, (jax.eval_shape(build) if recipe == "bf16" else jax.eval_shape(lambda p: p, build()))


def kv_quantizer(args, config):
    """The quantized KV cache's setting the flags ask for: key ranges online (from the prompt) or calibrated
    (``--kv-static``: placeholder ranges, the same code), ``--kv-sinks`` float sink tokens."""
    import jax.numpy as jnp

    from llmeq_jax.kv import spec as kvspec

    ranges = None
    if args.kv_static:
        shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        ranges = kvspec.KeyRanges(jnp.full(shape, -1.0), jnp.ones(shape))
    spec = kvspec.KVSpec(bits=args.kv_bits, key_range="static" if args.kv_static else "online", prompt_tokens=16,
                         pre_rope=not args.kv_post_rope, sink_tokens=args.kv_sinks)
    return kvspec.KVQuantizer(ranges, spec)


def compile_decode(args, recipe: str, topo, folder: Path):
    """Compile generate's decode loop (batch ``args.batch``, a cache of ``args.context`` slots) -- or with
    ``args.prefill``, its prefill of that many prompt tokens -- for the topology's GPU into ``folder`` (XLA's
    dump)."""
    import jax
    import jax.numpy as jnp

    from llmeq_jax import generate as gen, pipeline, subchannel
    from llmeq_jax.models import init_cache, stacked
    from pallas_kernels import config as kernel_config
    from jax.experimental import topologies

    device = topo.devices[0]
    on = jax.sharding.SingleDeviceSharding(device)
    put = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), tree)  # noqa: E731
    config, params = abstract_model(args, recipe)
    kv = None if args.kv_bits is None else kv_quantizer(args, config)
    off = kernel_config.disabled() if args.xla else contextlib.nullcontext()
    with kernel_config.compiling_for(device), off, launch_settings(args.settings):
        # the blocks stacked for one scan: a prompt in the layout llmeq eval and bench_e2e's prefill run it
        # (pipeline.run_layout: W8A8 weights K-major for a GPU), the decode loop over the checkpoint's layout
        # (generate lays it out for decode inside)
        params = jax.eval_shape(lambda p: pipeline.run_layout(config, p, scan_layers=True) if args.prefill
                                else stacked.stack_blocks(config, p), params)
        cache = jax.eval_shape(lambda: init_cache(config, args.batch, args.context, jnp.bfloat16, kv=kv))
        if not args.prefill and hasattr(cache, "written"):  # the decode loop runs on a prefilled cache
            cache = dataclasses.replace(cache, written=True)
        logits = jax.ShapeDtypeStruct((args.batch, config.vocab_size), jnp.float32)
        key = jax.eval_shape(lambda: jax.random.key(0))
        steps = jax.ShapeDtypeStruct((), jnp.int32)
        mesh = topologies.make_mesh(topo, (1,), ("x",))
        # jax >= 0.11 asks the abstract mesh which GPU the Pallas kernels lower for
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            if args.prefill:
                tokens = jax.ShapeDtypeStruct((args.batch, args.prefill), jnp.int32)
                prefill = jax.jit(gen.prefill.__wrapped__, static_argnames=("config", "kernels"))
                lowered = prefill.trace(config, put(params), put(tokens), put(tokens), put(cache),
                                        kernels=gen.kernel_state()).lower()
                options = subchannel.compiler_options() or {}  # as generate.prefill compiles for this GPU
            else:
                options = {}
                lowered = gen._decode_loop.trace(
                    config, put(params), put(logits), put(cache), put(key), put(steps), max_new_tokens=args.new_tokens,
                    greedy=True, temperature=1.0, top_k=0, top_p=1.0, kernels=gen.kernel_state()).lower()
    dumps = {"xla_dump_to": str(folder), **options}
    if args.sass:  # jax >= 0.11 writes the PTX only when asked for the LLVM IR of every emitter
        dumps.update(xla_gpu_dump_llvmir=True, xla_dump_emitter_re=".*")
    lowered.compile(compiler_options=dumps)


@contextlib.contextmanager
def launch_settings(texts: list[str]):
    """Every setting of ``texts`` in force for the block: ``kernel:fields`` (``pallas_kernels.settings.parse``) or
    ``prefetch:mb=N,stream=S`` (``pallas_kernels.prefetch``)."""
    from pallas_kernels import settings

    with contextlib.ExitStack() as stack:
        for text in texts:
            stack.enter_context(settings.scope(text))
        yield


def report(name: str, hlo: str, thunks: str) -> str:
    body = innermost_loop_body(thunks)
    seen = launches(body)
    copies = big_copies(hlo)
    kernels = collections.Counter(seen["pallas"])
    pallas = ", ".join(f"{k}" + (f" x{c}" if c > 1 else "") for k, c in kernels.items()) or "none"
    copied = sum(b for _, b in copies)
    listed = ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in copies[:4]) + (" ..." if len(copies) > 4 else "")
    written = fusion_writes(hlo)[1]
    return (f"| {name} | {len(body)} | {len(seen['pallas'])} | {seen['gemm']} | {seen['fusion']} | {seen['copy']} | "
            f"{copied / 2**20:.0f} MiB{' (' + listed + ')' if copies else ''} | {written / 2**20:.0f} MiB | {pallas} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-2-7b", help="published shapes (models.shapes), random weights")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (the scan body is the same for any)")
    parser.add_argument("--recipes", nargs="+", default=["bf16", "rtn-w4-g128", "rtn-w8", "rtn-w8a8"],
                        help="bf16, or round-to-nearest recipes (no calibration text here)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048, help="cache slots")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, metavar="N", help="compile the prefill of an N-token prompt instead "
                        "(per decoder layer of the prompt; --context must hold it)")
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), help="a quantized KV cache (online key ranges)")
    parser.add_argument("--kv-post-rope", action="store_true", help="the quantized cache stores keys after RoPE")
    parser.add_argument("--kv-static", action="store_true",
                        help="the quantized cache's key ranges calibrated (the default KV spec), not online")
    parser.add_argument("--kv-sinks", type=int, default=4, help="the quantized cache's float sink tokens")
    parser.add_argument("--device", choices=sorted(TARGETS), default="h100")
    parser.add_argument("--xla", action="store_true", help="no Pallas kernel (pallas_kernels.config.disabled): XLA's paths")
    parser.add_argument("--unchecked", action="store_true",
                        help="with the kernels not yet run on a GPU (pallas_kernels.hardware_checked), as a GPU "
                             "session's e2e step runs them once their gpu cases pass (LLMEQ_UNCHECKED_KERNELS=all)")
    parser.add_argument("--settings", nargs="+", default=[], metavar="KERNEL:FIELDS",
                        help="kernel launch settings at decode rows (pallas_kernels.settings, as sweep_decode.py takes "
                             "them), e.g. int4_words:bn=256,stages=4, or the read-ahead prefetch:mb=16,stream=side")
    parser.add_argument("--keep", type=Path, help="keep XLA's dumps here (one folder per recipe)")
    parser.add_argument("--sass", action="store_true",
                        help="each Pallas kernel's SASS as XLA's Triton (or Mosaic GPU) compiled it")
    args = parser.parse_args(argv)
    if args.unchecked:
        os.environ["LLMEQ_UNCHECKED_KERNELS"] = "all"
    mosaic = None
    if args.sass:  # Mosaic GPU compiles its kernels itself: it writes their PTX where these ask (read once)
        mosaic = Path(tempfile.mkdtemp(prefix="gpu_aot_mosaic_"))
        os.environ.update(MOSAIC_GPU_DUMP_TO=str(mosaic), MOSAIC_GPU_DUMP_PTX="1")
        # and tries nvdisasm for their SASS: Triton's wheel carries one
        os.environ["PATH"] = f"{_tool('triton/backends/nvidia/bin/nvdisasm').parent}{os.pathsep}{os.environ['PATH']}"

    import jax
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(args.device), topology="1x1x1")
    except Exception as e:  # noqa: BLE001 -- the plugin's own message says what is missing
        raise SystemExit(f"no deviceless CUDA compiler here ({e}); see this script's docstring for the setup") from e
    print(f"jax {jax.__version__}, compiled for {topo.devices[0].device_kind} (deviceless, no autotuning); "
          f"{args.shapes} shapes, {args.layers} layers stacked, batch {args.batch}, {args.context} cache slots"
          + (f", int{args.kv_bits} KV cache ({'post' if args.kv_post_rope else 'pre'}-RoPE keys, "
             f"{'calibrated' if args.kv_static else 'online'} ranges, {args.kv_sinks} sinks)" if args.kv_bits else "")
          + (", Pallas kernels off" if args.xla else "")
          + (f", settings {' '.join(args.settings)}" if args.settings else "")
          + (", the kernels not yet run on a GPU on" if os.environ.get("LLMEQ_UNCHECKED_KERNELS") else "")
          + "; per decoder layer and token:")
    print("| recipe | thunks | Pallas / cuDNN kernels | XLA GEMMs | other fusions | copies | copied (>= 1 MiB) "
          "| written by fusions other than GEMMs | kernels |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    sass, read = {}, set()
    for recipe in args.recipes:
        folder = (args.keep / recipe) if args.keep else Path(tempfile.mkdtemp(prefix=f"gpu_aot_{recipe}_"))
        folder.mkdir(parents=True, exist_ok=True)
        compile_decode(args, recipe, topo, folder)
        print(report(recipe, *read_dump(folder, "jit_prefill" if args.prefill else "_decode_loop")), flush=True)
        if args.sass:
            new = sorted(set(mosaic.glob("*.ptx")) - read)  # this recipe's Mosaic kernels
            read.update(new)
            sass[recipe] = pallas_sass(folder, extra=new)
    for recipe, rows in sass.items():
        print(f"\n{recipe}: the Pallas kernels' SASS (sm_90a; XLA's Triton, Mosaic GPU's PTX); loop = the hottest "
              "loop's instructions")
        print("| kernel | regs | spill B | loop | tensor core | top ops |\n| --- | ---: | ---: | ---: | --- | --- |")
        for r in rows:
            tc = ", ".join(f"{op} x{c}" for op, c in r["tensor_core"].items()) or "none"
            loop = f"{r['loop']} (all)" if r["unrolled"] else str(r["loop"])
            top = ", ".join(f"{op} {c}" for op, c in r["top"])
            print(f"| {r['kernel']} | {r['regs']} | {r['local']} | {loop} | {tc} | {top} |")


if __name__ == "__main__":
    main()
