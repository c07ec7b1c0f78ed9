"""Native CPU kernels vs XLA on SmolLM2-135M's matmul shapes: the numbers behind ops.NATIVE_MAX_ROWS.

Per shape (K, N) and rows M, times in one process, interleaved round by round
(the machine is shared: medians of ratios measured side by side):

  fp32      XLA  x @ w                         (the float model's matmul)
  xla-w8    XLA  ops.linear(..., backend="xla") on an int8 per-channel QArray
  nat-w8    native weight-only int8
  xla-w4    XLA  on int4 groups of 128
  nat-w4    native weight-only int4
  xla-w8a8  XLA  W8A8 (per-token activations, int8 per-channel weights)
  nat-w8a8  native W8A8

Each variant cycles through enough copies of its weights (>= --cache-mb of fp32)
that they come from DRAM, as in a model's decode step, not from the 8 MB L3
where a single reused matrix would sit.

The head (tied embedding, 49152 x 576 stored (N, K)) is timed through
ops.linear_nk (fp32: x @ E.T). Prints a table (microseconds, and speed vs fp32
as fp32_time / time) and writes JSON.

    PYTHONPATH=. python scripts/bench_native.py --rows 1 8 64 512 --json runs/bench_native.json

``--float`` times float kernels instead (the numbers behind NATIVE_MAX_ROWS["float_layer"] and
["bfloat16"]), on SmolLM2's and Llama-2-7B's shapes by default; the copies are one stack
[copies, K, N], each call reads the next layer:

  fp32        XLA  x @ w[l], w[l] an array of its own (an unrolled model)
  fp32-layer  XLA  x @ w[l] of the stack, l traced (what the scan over stacked blocks ran: a copy, then the dot)
  nat-fp32-layer   native float GEMV reading layer l of the stack in place
  nat-fp32    native float GEMV on w[l]
  bf16, bf16-layer, nat-bf16, nat-bf16-layer: the same with bfloat16 weights and activations

    PYTHONPATH=. python scripts/bench_native.py --float --rows 1 8 16 --json runs/bench_native_float.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import native, ops
from llmeq_jax.core.quantize import Spec, quantize

SHAPES = {  # name -> (K, N); "head" is an (N, K) table
    "q/o 576x576": (576, 576),
    "k/v 576x192": (576, 192),
    "gate/up 576x1536": (576, 1536),
    "down 1536x576": (1536, 576),
    "head 49152x576 (nk)": (576, 49152),
}
FLOAT_SHAPES = {
    "gate/up 576x1536": (576, 1536),
    "down 1536x576": (1536, 576),
    "7b q 4096x4096": (4096, 4096),
    "7b up 4096x11008": (4096, 11008),
    "7b down 11008x4096": (11008, 4096),
}
FLOAT_COLS = ["fp32", "fp32-layer", "nat-fp32", "nat-fp32-layer", "bf16", "bf16-layer", "nat-bf16", "nat-bf16-layer"]
ACT = Spec(bits=8, granularity="token")
W8 = Spec(bits=8)
W4 = Spec(bits=4, granularity="group", group_size=128)


_q = jax.jit(quantize, static_argnums=1, static_argnames=("act_spec", "pack_axis"))


def _variants(name, k, n, rows, copies):
    """{variant: (jitted f(x, w), [weights per copy])} and the activations."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    v = {}

    def add(key, f, ws):
        v[key] = (jax.jit(f), ws)

    if "head" in name:
        es = [jnp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 0.05) for _ in range(copies)]
        add("fp32", lambda a, b: a @ b.T, es)
        specs = {"w8": (Spec(bits=8, axis=0), None), "w4": (Spec(bits=4, granularity="group", group_size=128, axis=1), 1)}
        for tag, (spec, pa) in specs.items():
            qs = [_q(e, spec, pack_axis=pa) for e in es]
            add(f"xla-{tag}", lambda a, b: ops.linear_nk(a, b, backend="xla"), qs)
            if native.available():
                add(f"nat-{tag}", native.weight_only_nk, qs)
        return x, v
    ws = [jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) * 0.05) for _ in range(copies)]
    add("fp32", lambda a, b: a @ b, ws)
    for tag, spec, act in (("w8", W8, None), ("w4", W4, None), ("w8a8", W8, ACT)):
        qs = [_q(w, spec, act_spec=act) for w in ws]
        add(f"xla-{tag}", lambda a, b: ops.linear(a, b, backend="xla"), qs)
        if native.available():
            add(f"nat-{tag}", (lambda a, b: native.w8a8_kn(a, b, ACT)) if act else native.weight_only_kn, qs)
    return x, v


def _float_variants(k, n, rows, copies):
    """The --float variants: each "weight" is (stack, layer index); the layer cycles through the stack."""
    rng = np.random.default_rng(0)
    v = {}
    for dt, tag in ((jnp.float32, "fp32"), (jnp.bfloat16, "bf16")):
        stack = jnp.asarray(rng.standard_normal((copies, k, n)).astype(np.float32) * 0.05).astype(dt)
        layers = [(stack, jnp.int32(i)) for i in range(copies)]
        own = [(stack[i], None) for i in range(copies)]  # arrays of their own: an unrolled model's kernels
        # x arrives float32 and takes the weights' dtype inside the jit (K values: nothing beside the product)
        v[tag] = (jax.jit(lambda a, w, dt=dt: a.astype(dt) @ w[0]), own)
        v[f"{tag}-layer"] = (jax.jit(lambda a, w, dt=dt: a.astype(dt) @ jax.lax.dynamic_index_in_dim(w[0], w[1], 0, False)),
                             layers)
        if native.available():
            v[f"nat-{tag}"] = (jax.jit(lambda a, w, dt=dt: native.float_matmul(a.astype(dt), w[0])), own)
            v[f"nat-{tag}-layer"] = (jax.jit(lambda a, w, dt=dt: native.float_matmul(a.astype(dt), w[0], layer=w[1])),
                                     layers)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    return x, v


def _time_once(f, x, ws, min_s):
    n, t0 = 0, time.perf_counter()
    while True:
        y = f(x, ws[n % len(ws)])
        n += 1
        if n >= max(3, len(ws)) and time.perf_counter() - t0 >= min_s:
            break
    jax.block_until_ready(y)
    return (time.perf_counter() - t0) / n


def bench(name, k, n, rows, reps, min_s, cache_mb, floats=False):
    copies = max(1, -(-int(cache_mb * 2**20) // (4 * k * n)))
    x, variants = (_float_variants(k, n, rows, copies) if floats else _variants(name, k, n, rows, copies))
    for f, ws in variants.values():  # compile everything first
        jax.block_until_ready(f(x, ws[0]))
    samples = {key: [] for key in variants}
    for _ in range(reps):  # interleaved: every variant sees the same machine load
        for key, (f, w) in variants.items():
            samples[key].append(_time_once(f, x, w, min_s))
    med = {key: statistics.median(v) * 1e6 for key, v in samples.items()}
    # Speed vs fp32 from per-round ratios (robust to load drifting between rounds).
    speed = {key: statistics.median(a / b for a, b in zip(samples["fp32"], v)) for key, v in samples.items()}
    return {"shape": name, "K": k, "N": n, "rows": rows, "copies": copies, "us": med, "speed_vs_fp32": speed}


def suggest_thresholds(results):
    """Largest measured row count at which native beats XLA on every shape, per kind."""
    out = {}
    for kind in ("w8", "w4", "w8a8"):
        ok_rows = []
        for rows in sorted({r["rows"] for r in results}):
            rs = [r for r in results if r["rows"] == rows and f"nat-{kind}" in r["us"]]
            if rs and all(r["us"][f"nat-{kind}"] <= r["us"][f"xla-{kind}"] for r in rs):
                ok_rows.append(rows)
            else:
                break
        out[kind] = ok_rows[-1] if ok_rows else 0
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="subset of: " + ", ".join(SHAPES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=0.05, help="per timing sample")
    p.add_argument("--cache-mb", type=float, default=48, help="fp32 weight bytes cycled through per variant")
    p.add_argument("--json", default="runs/bench_native.json")
    p.add_argument("--float", action="store_true", help="float kernels: XLA vs the native float GEMV, unrolled and stacked")
    a = p.parse_args()
    if a.float:
        return main_float(a)
    print(f"native: available={native.available()} simd={native.simd()} ({native.unavailable_reason() or 'ok'})")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, jax {jax.__version__}")
    results = []
    cols = ["fp32", "xla-w8", "nat-w8", "xla-w4", "nat-w4", "xla-w8a8", "nat-w8a8"]
    print(f"{'shape':22s} {'M':>4s} " + " ".join(f"{c:>15s}" for c in cols))
    for name in a.shapes:
        k, n = SHAPES[name]
        for rows in a.rows:
            if "head" in name and rows > 64:
                continue  # prefill needs the head for the last token only
            r = bench(name, k, n, rows, a.reps, a.min_seconds, a.cache_mb)
            results.append(r)
            cells = []
            for c in cols:
                if c in r["us"]:
                    cells.append(f"{r['us'][c]:8.0f}us {r['speed_vs_fp32'][c]:4.2f}x")
                else:
                    cells.append(f"{'-':>15s}")
            print(f"{name:22s} {rows:4d} " + " ".join(cells), flush=True)
    sug = suggest_thresholds(results)
    print(f"native beats XLA up to rows: {sug}  (ops.NATIVE_MAX_ROWS = {ops.NATIVE_MAX_ROWS})")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"results": results, "suggested_max_rows": sug, "native_max_rows": ops.NATIVE_MAX_ROWS}, f, indent=1)
        print(f"wrote {a.json}")


def main_float(a):
    """--float: float kernels, XLA vs the native GEMV, each kernel its own array or a layer of a stack."""
    shapes = [sh for sh in a.shapes if sh in FLOAT_SHAPES] if a.shapes != list(SHAPES) else list(FLOAT_SHAPES)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, jax {jax.__version__}, "
          f"native {native.available()}")
    print(f"{'shape':22s} {'M':>4s} " + " ".join(f"{c:>16s}" for c in FLOAT_COLS))
    results = []
    for name in shapes:
        k, n = FLOAT_SHAPES[name]
        for rows in a.rows:
            r = bench(name, k, n, rows, a.reps, a.min_seconds, a.cache_mb, floats=True)
            results.append(r)
            print(f"{name:22s} {rows:4d} " + " ".join(
                f"{r['us'][c]:9.0f}us {r['speed_vs_fp32'][c]:4.2f}x" if c in r["us"] else f"{'-':>16s}"
                for c in FLOAT_COLS), flush=True)
    print(f"ops.NATIVE_MAX_ROWS: float_layer {ops.NATIVE_MAX_ROWS['float_layer']}, "
          f"bfloat16 {ops.NATIVE_MAX_ROWS['bfloat16']}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"results": results, "native_max_rows": ops.NATIVE_MAX_ROWS}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
