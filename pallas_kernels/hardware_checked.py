"""Which kernels have passed their gpu test cases on a real GPU, and the switch for those that have not.

Every kernel is checked on a CPU -- in Pallas interpret mode against its reference, lowered for CUDA, compiled
deviceless for an H100 / H200 (``scripts/gpu_aot.py``) -- but interpret mode runs neither Triton's nor Mosaic's
compiler, and hardware found what the CPU could not: an illegal address past 2**31 bytes in the int8 kernels
(H200, 2026-11-28) and wrong float32 queries over int4 keys in the KV kernel (H200, 2026-11-27). So a kernel a model
takes on a GPU by itself, where no dispatch table measured it, is one whose gpu cases
(``tests/pallas_kernels/test_gpu_kernels.py``, ``pytest -m gpu``) passed on a GPU: :data:`CHECKED`. The kernels of
:data:`UNCHECKED` run on a GPU only where a dispatch table measured them faster (``scripts/bench_kernels.py`` writes
such an entry only for output it checked against XLA's), where ``LLMEQ_UNCHECKED_KERNELS`` names them
(comma-separated, or ``all``: ``scripts/gpu_session.sh`` names those whose gpu cases passed in the same session), or
where a caller forces one (``force=True``, ``backend="pallas"``). The Mosaic GPU kernels and the prompt kernel over
int4 words are not listed: they run only where a table measured them, checked or not.

Interpret mode (no GPU: the CPU tests) is not gated. :data:`CHECKED` is the kernels of the record
(``pallas_kernels/hardware_fingerprints.json``): a kernel joins it when a GPU session's gpu cases pass, recorded with
the run and digests of its lowerings as they ran (``python -m pallas_kernels.fingerprints --run RUN KERNEL``), so a
later change to it shows (``pallas_kernels.fingerprints``; docs/kernels.md has each run).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from pallas_kernels import config, fingerprints

ENV = "LLMEQ_UNCHECKED_KERNELS"

# kernel -> the gpu case ids (substrings of ``test_kernel_matches_reference[...]``) that check it
GPU_CASES = {
    "weight_only": ("weight_only",),
    "w8a8": ("w8a8", "fp8"),
    "float_matmul": ("float_stack",),
    "int4_words": ("int4_words",),
    "store_decode_attention": ("store_decode", "quantized_cache_decode"),
    "int8_f16": ("int8_f16",),
    "rms_norm": ("rms_norm",),  # pallas_kernels.rms_norm: a decode step's norms
    "append_decode_attention": ("float_decode_attention",),  # pallas_kernels.decode_attention: a float cache's step
    "store_append": ("kv_store_append",),  # pallas_kernels.kv_store_append: a quantized cache's write
    "merge_splits": ("store_decode",),  # pallas_kernels.split_merge: the KV kernel's splits merged (else XLA's merge)
    "cudnn_attention": ("prompt_attention",),  # llmeq_jax.kv.attention.attention_flash: a prompt's attention
    "norm_fold": ("norm_fold",),  # pallas_kernels.norm_fold: a decode step's norms folded into their products
    "split_fixup": ("split_fixup",),  # pallas_kernels.split_fixup: split products' partials added by the kernel
    "token_codes": ("token_codes",),  # pallas_kernels.token_codes: a W8A8 decode step's activation codes, its norm
    # llmeq_jax.subchannel: a prompt's int4 product as XLA's GEMM with the dequantization fused in (not a Pallas
    # kernel: an experimental XLA flag, which has crashed XLA's compile on another form of int4 codes)
    "xla_subchannel": ("xla_subchannel",),
}

# kernel -> the GPU run its gpu cases passed on: the kernels of the record (pallas_kernels.fingerprints, which also
# says which of their lowerings changed since and have not run on a GPU)
RECORD = fingerprints.read()
CHECKED = {kernel: entry["run"] for kernel, entry in RECORD.items()}

# kernel -> its gpu case ids, for the kernels a GPU decode or prompt would take by themselves where no table
# measured them and whose gpu cases have not passed on a GPU yet
UNCHECKED = {kernel: cases for kernel, cases in GPU_CASES.items() if kernel not in CHECKED}


def unrun_cases() -> str:
    """A pytest ``-k`` expression for the gpu cases of the checked kernels whose lowerings changed since their run
    (the record's ``unrun``), or "" where none did."""
    return " or ".join(case for kernel, entry in RECORD.items() if entry.get("unrun") for case in GPU_CASES[kernel])


def named() -> frozenset[str]:
    """The kernels of :data:`UNCHECKED` that ``LLMEQ_UNCHECKED_KERNELS`` turns on (``all``: every one)."""
    raw = os.environ.get(ENV, "")
    names = {name.strip() for name in raw.split(",") if name.strip()}
    if "all" in names:
        return frozenset(UNCHECKED)
    unknown = names - set(UNCHECKED) - set(CHECKED)
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: no unchecked kernel named {', '.join(sorted(unknown))}; expected "
                         f"comma-separated names of {', '.join(UNCHECKED)}, or 'all'")
    return frozenset(names & set(UNCHECKED))


def allowed(kernel: str) -> bool:
    """Whether ``kernel`` (a key of :data:`CHECKED` or :data:`UNCHECKED`) may run where no dispatch table measured
    it: checked on a GPU, named by ``LLMEQ_UNCHECKED_KERNELS``, or traced for no GPU (interpret mode)."""
    if kernel not in CHECKED and kernel not in UNCHECKED:
        raise ValueError(f"hardware_checked.allowed: unknown kernel {kernel!r}; expected one of "
                         f"{', '.join([*CHECKED, *UNCHECKED])}")
    return kernel in CHECKED or not config.on_gpu() or kernel in named()


_VERDICT = re.compile(r"\b(PASSED|FAILED|ERROR)\b")
_CASE = re.compile(r"test_kernel_matches_reference\[(.*?)\](?:\s|$)")


def passed_in(log: str) -> list[str]:
    """The kernels of :data:`UNCHECKED` whose gpu cases passed in ``log`` (``pytest -v`` verdict lines of
    ``tests/pallas_kernels/test_gpu_kernels.py``, from one process or from xdist's) and none failed or erred: a
    kernel none of whose cases ran is not among them."""
    verdicts: dict[str, set[str]] = {}
    for line in log.splitlines():
        verdict, case = _VERDICT.search(line), _CASE.search(line)
        if verdict and case:
            verdicts.setdefault(case.group(1), set()).add(verdict.group(1))
    passed = []
    for kernel, cases in UNCHECKED.items():
        seen = [v for case, v in verdicts.items() if any(name in case for name in cases)]
        if seen and all(v == {"PASSED"} for v in seen):
            passed.append(kernel)
    return passed


def main(argv=None) -> None:
    """``python -m pallas_kernels.hardware_checked LOG...``: print, comma-separated, the unchecked kernels whose gpu
    cases passed in these logs (read together; a missing one is skipped) and none failed -- what
    ``scripts/gpu_session.sh`` sets ``LLMEQ_UNCHECKED_KERNELS`` to for the steps after its gpu cases.
    ``--unrun-cases``: print :func:`unrun_cases` instead."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--unrun-cases"]:
        print(unrun_cases())
        return
    paths = [Path(p) for p in args]
    print(",".join(passed_in("\n".join(p.read_text(errors="replace") for p in paths if p.is_file()))))


if __name__ == "__main__":
    main()
