"""Tune the weight-only kernels' options on a GPU: dequantization, x loads, blocks, K splits.

For each weight shape and row count, in stages so the run fits a short lease:
  A. int4: the ways codes become floats (``dequant`` convert / magic / fold) crossed with
     ``strided_x``, ``asm`` (fold's values by inline PTX), at the default blocks, and ``scaled`` (weights dequantized with their scales; its
     own 256-row blocks from M >= 1024); at M <= 4 (int4 and int8) also the multiply-and-sum
     GEMV formulation (``gemv=True``, pallas_kernels/gemv.py);
  B. blocks (bn, bk, warps, stages) with the best of A (int4) or the default (int8);
  C. K splits at half and twice the automatic count, with the best of B.
Every candidate is checked against the reference before it is timed (a wrong kernel is
reported and dropped). Times are device seconds per call as in ``bench_kernels.py`` (inputs
rotated through more than 3x the L2 cache), printed as ratios to a bf16 dot in the same run,
and written one JSON object per line to ``--out``. Stops starting new stages after ``--budget-s``.

    PYTHONPATH=. python scripts/tune_weight_only.py --out tune.jsonl [--shapes 4096x11008 11008x4096] [--rows 1 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import _copies, copies_for, timed  # noqa: E402
from pallas_kernels.gemv import GEMV_MAX_ROWS  # noqa: E402

GROUP = 128
DEQUANT_OPTIONS = [(d, s) for d in ("convert", "magic", "fold") for s in (False, True)] + [("asm", False)]
DECODE_BLOCKS = [(64, 128, 4, 3), (128, 128, 4, 4), (128, 256, 4, 3), (128, 256, 4, 4), (256, 128, 4, 3),
                 (256, 256, 8, 3), (64, 256, 4, 4), (128, 512, 4, 3), (32, 256, 4, 4)]  # (bn, bk, warps, stages)
PREFILL_BLOCKS = [(128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4)]  # with bm 128 (64 for 256)


def candidates_b(m: int, bits: int):
    from pallas_kernels.blocks import Blocks

    if m <= 16:
        out = [Blocks(16, bn, bk, w, s) for bn, bk, w, s in DECODE_BLOCKS]
        if bits == 8:
            out += [Blocks(16, 64, 512, 4, 3), Blocks(16, 128, 512, 4, 3), Blocks(16, 64, 1024, 4, 3)]
        return out
    bm = 128 if m > 256 else 64
    return [Blocks(bm, bn, bk, w, s) for bn, bk, w, s in PREFILL_BLOCKS]


def device_us(fn, inputs) -> dict:
    """GPU kernel time per call of ``fn`` by kernel name, from a profiler trace of one pass over
    ``inputs`` (what the wall-clock timing cannot split: kernel vs launch gaps vs host dispatch)."""
    import collections
    import glob
    import tempfile

    from jax.profiler import ProfileData

    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(many(inputs))
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        jax.block_until_ready(many(inputs))
    total = collections.defaultdict(float)
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if line.name.startswith("Stream"):  # kernels as the GPU ran them (other lines repeat them)
                    for ev in line.events:
                        total[ev.name[:60]] += ev.duration_ns / 1e3 / len(inputs)
    return dict(total)


def profile(args):
    """Per-kernel GPU time vs wall-clock time per call: bf16 dot, XLA's int4 path, the int4 kernel."""
    from llmeq_jax import ops
    from llmeq_jax.core.quantize import Spec, quantize
    from pallas_kernels.weight_only import weight_only_matmul

    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
        q = quantize(w, Spec(bits=4, granularity="group", group_size=GROUP, symmetric=False))
        r = copies_for(q.qvalue.nbytes)
        wbs, wqs, ss, zps = (_copies(a, r) for a in (w.astype(jnp.bfloat16), q.qvalue, q.scale, q.zero_point))
        for m in args.rows:
            xs = _copies(jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16), r)
            fns = {
                "bf16": (lambda x, w: x @ w, list(zip(xs, wbs))),
                "int4 XLA": (lambda x, w, s, z: ops.linear(x, dataclasses.replace(q, qvalue=w, scale=s, zero_point=z),
                                                           backend="xla"), list(zip(xs, wqs, ss, zps))),
                "int4 kernel": (lambda x, w, s, z: weight_only_matmul(x, w, s, bits=4, w_zero_point=z, group=GROUP),
                                list(zip(xs, wqs, ss, zps))),
            }
            for name, (fn, inputs) in fns.items():
                wall = timed(fn, inputs, reps=args.reps)
                kernels = device_us(fn, inputs)
                parts = ", ".join(f"{kn} {us:.1f}" for kn, us in sorted(kernels.items(), key=lambda i: -i[1])[:4])
                print(f"profile {shape} M={m} {name}: wall {wall * 1e6:.1f} us/call, GPU kernels "
                      f"{sum(kernels.values()):.1f} us/call ({parts})", flush=True)


def run(args):
    from llmeq_jax import ops
    from llmeq_jax.core.quantize import Spec, quantize
    from pallas_kernels.blocks import matmul_blocks
    from pallas_kernels.common import cdiv, fit_splits, splits_for
    from pallas_kernels.weight_only import weight_only_matmul, weight_only_reference

    start = time.perf_counter()
    out = open(args.out, "a") if args.out else None
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

    def over_budget():
        return time.perf_counter() - start > args.budget_s

    for bits in args.bits:  # int4 first: its targets are the ones to tune for
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
            group = GROUP if bits == 4 else None
            spec = Spec(bits=bits, granularity="group" if group else "channel", group_size=group, symmetric=bits == 8)
            q, wb = quantize(w, spec), w.astype(jnp.bfloat16)
            del w
            r = copies_for(q.qvalue.nbytes)
            wqs, ss = _copies(q.qvalue, r), _copies(q.scale, r)
            zps = _copies(q.zero_point, r) if q.zero_point is not None else [None] * r
            wbs = _copies(wb, r)
            for m in args.rows:
                if over_budget():
                    print(f"budget of {args.budget_s} s spent; stopping", flush=True)
                    return
                xs = _copies(jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16), r)
                base = timed(lambda x, w: x @ w, list(zip(xs, wbs)), reps=args.reps)
                ref = np.asarray(weight_only_reference(xs[0], wqs[0], ss[0], bits=bits, w_zero_point=zps[0],
                                                       group=group), np.float32)
                tol = 8e-3 * float(np.max(np.abs(ref)))
                label = f"int{bits} {k}x{n} M={m}"
                xla = timed(lambda x, w, s, z: ops.linear(x, dataclasses.replace(q, qvalue=w, scale=s, zero_point=z),
                                                          backend="xla"), list(zip(xs, wqs, ss, zps)), reps=args.reps)
                print(f"== {label}: bf16 {base * 1e6:.1f} us; XLA's quantized path {xla * 1e6:.1f} us "
                      f"({base / xla:.2f}x)", flush=True)
                results = []

                def trial(stage, **opts):
                    fn = lambda x, w, s, z: weight_only_matmul(x, w, s, bits=bits, w_zero_point=z, group=group,
                                                               **opts)
                    desc = {kk: (vars(v) if hasattr(v, "__dataclass_fields__") else v) for kk, v in opts.items()}
                    try:
                        y = np.asarray(jax.jit(fn)(xs[0], wqs[0], ss[0], zps[0]), np.float32)
                        err = float(np.max(np.abs(y - ref))) if np.all(np.isfinite(y)) else float("nan")
                        if not err <= tol:
                            print(f"   {stage} {desc}: WRONG (max err {err:.3g} > {tol:.3g})", flush=True)
                            return None
                        t = timed(fn, list(zip(xs, wqs, ss, zps)), reps=args.reps)
                    except Exception as e:  # a config Triton rejects (shared memory, registers)
                        print(f"   {stage} {desc}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        return None
                    row = dict(kind=f"int{bits}", k=k, n=n, m=m, stage=stage, opts=desc, us=t * 1e6,
                               bf16_us=base * 1e6, speedup=base / t)
                    print(f"   {stage} {desc}: {t * 1e6:.1f} us, {base / t:.2f}x bf16", flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                    results.append((t, opts))
                    return t

                best_opts = {}
                if bits == 4:
                    for dequant, strided in DEQUANT_OPTIONS:
                        trial("A", dequant=dequant, strided_x=strided)
                    if group is not None:  # the weights dequantized with their scales (its own prefill blocks)
                        trial("A", dequant="scaled")
                if m <= GEMV_MAX_ROWS:
                    if bits == 8:
                        trial("A")  # the dot kernel at its defaults, to compare with
                    trial("A", gemv=True)
                if results:
                    best_opts = dict(min(results, key=lambda r: r[0])[1])
                for blocks in candidates_b(m, bits):
                    if over_budget():
                        break
                    if group is not None and blocks.bk % group:
                        continue
                    trial("B", **best_opts, blocks=blocks)
                if not results:
                    continue
                t_best, opts = min(results, key=lambda r: r[0])
                blocks = opts.get("blocks") or matmul_blocks(m, n, k, group, min_bk=32 if bits == 4 else 16)
                auto = fit_splits(cdiv(k, blocks.bk), splits_for(cdiv(m, blocks.bm) * cdiv(n, blocks.bn),
                                                                 cdiv(k, blocks.bk)))[0]
                for splits in sorted({max(1, auto // 2), auto * 2} - {auto}):
                    if not over_budget():
                        trial("C", **{**opts, "k_splits": splits})
                t_best, opts = min(results, key=lambda r: r[0])
                desc = {kk: (vars(v) if hasattr(v, "__dataclass_fields__") else v) for kk, v in opts.items()}
                print(f"** best {label}: {t_best * 1e6:.1f} us, {base / t_best:.2f}x bf16, {desc} "
                      f"(auto splits {auto})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4096x11008", "11008x4096"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    p.add_argument("--bits", nargs="+", type=int, default=[4, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--out", help="append one JSON object per timed candidate here")
    p.add_argument("--interpret", action="store_true", help="run in Pallas interpret mode (checks this script "
                   "on a CPU with small --shapes; its times mean nothing)")
    p.add_argument("--profile", action="store_true", help="instead: per-kernel GPU time from a profiler trace "
                   "beside the wall-clock time per call (bf16, XLA's int4 path, the int4 kernel)")
    args = p.parse_args()
    if args.interpret:
        from pallas_kernels import config

        with config.interpret(True):
            return profile(args) if args.profile else run(args)
    if args.profile:
        return profile(args)
    if jax.default_backend() != "gpu":
        raise SystemExit(f"tune_weight_only needs a GPU (JAX backend here: {jax.default_backend()})")
    run(args)


if __name__ == "__main__":
    main()
