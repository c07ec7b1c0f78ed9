"""Benchmark of the core: quantize throughput and ops.linear against fp32 ``x @ w``.

    PYTHONPATH=. python scripts/bench_core.py [--size 4096] [--rounds 15]

Prints figures; it is not a test and asserts nothing. Every variant is jitted,
warmed up (compiled and run twice), then timed with ``block_until_ready`` in
interleaved rounds (each round runs every variant once, so a load spike on a
shared machine hits all of them alike); the figure is the median over rounds.
Ratios compare variants measured in this one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import ops
from llmeq_jax.core.quantize import Spec, quantize

QUANT_SPECS = [
    Spec(bits=8, granularity="tensor"),
    Spec(bits=8, granularity="channel"),
    Spec(bits=8, granularity="channel", symmetric=False),
    Spec(bits=4, granularity="channel"),
    Spec(bits=2, granularity="channel"),
    Spec(bits=8, granularity="group", group_size=128),
    Spec(bits=4, granularity="group", group_size=128),
    Spec(bits=4, granularity="group", group_size=128, symmetric=False),
    Spec(bits=3, granularity="group", group_size=128),
    Spec(bits=2, granularity="group", group_size=128),
    Spec(bits=8, granularity="token"),
    Spec(bits=4, granularity="group", group_size=128, clip="mse"),
]


def timed_rounds(fns: dict, args: dict, rounds: int) -> dict:
    """Median seconds per call of each jitted fn, interleaved over ``rounds``."""
    for name, fn in fns.items():
        for _ in range(2):
            jax.block_until_ready(fn(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = jax.devices()[0]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}; {os.cpu_count()} CPUs; jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
        f"load average at start {load:.1f}"
    )


def bench_quantize(w: jax.Array, rounds: int) -> None:
    nbytes = w.size * w.dtype.itemsize
    fns = {s.describe(): jax.jit(functools.partial(quantize, spec=s)) for s in QUANT_SPECS}
    args = {name: (w,) for name in fns}
    t = timed_rounds(fns, args, rounds)
    print(f"\n## quantize throughput: {w.shape[0]}x{w.shape[1]} float32 ({nbytes / 2**20:.0f} MiB input)")
    print(f"{'spec':36s} {'ms':>9s} {'GB/s':>7s}")
    for name, sec in t.items():
        print(f"{name:36s} {sec * 1e3:9.2f} {nbytes / sec / 1e9:7.2f}")


def _int8_dynamic_gemv(x, w):
    """Alternative for weight-only int8: quantize x per token and run the int8 x int8 -> int32 dot."""
    return ops.w8a8_xla(x, w, Spec(bits=8, granularity="token"))


def bench_linear(w: jax.Array, rows: list[int], rounds: int) -> None:
    k, n = w.shape
    weights = {
        "w8 per-channel": quantize(w, Spec(bits=8, granularity="channel")),
        "w4 g128": quantize(w, Spec(bits=4, granularity="group", group_size=128)),
        "w8a8 dyn/token": quantize(w, Spec(bits=8, granularity="channel"), act_spec=Spec(bits=8, granularity="token")),
    }
    act_absmax = 4.0  # a calibrated-looking static scale for standard-normal activations
    weights["w8a8 static"] = quantize(
        w,
        Spec(bits=8, granularity="channel"),
        act_spec=Spec(bits=8, granularity="tensor"),
        act_scale=jnp.asarray(act_absmax / 127, jnp.float32),
    )
    linear = jax.jit(functools.partial(ops.linear, backend="xla"))
    # The weight-only formulations ops.py chooses between, timed side by side.
    formulations = {
        "chunked scan": jax.jit(ops._weight_only_chunked),
        "dequant+matmul": jax.jit(lambda x, q: jnp.matmul(x, q.dequantize(x.dtype))),
        "mult-reduce": jax.jit(ops._weight_only_reduce),
        "int8 dot, dyn act": jax.jit(_int8_dynamic_gemv),
    }
    print(f"\n## ops.linear vs fp32 x @ w: kernel {k}x{n}; median ms and time / fp32 time (< 1 is faster)")
    print(f"ops.SMALL_M = {ops.SMALL_M} (weight-only rows up to this take the chunked scan on CPU)")
    header = f"{'M':>5s} {'fp32 ms':>9s}" + "".join(f" {name:>16s}" for name in weights)
    print(header)
    detail = []
    for m in rows:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k), np.float32))
        fns = {"fp32": jax.jit(jnp.matmul)}
        args = {"fp32": (x, w)}
        for name, q in weights.items():
            fns[name] = linear
            args[name] = (x, q)
        # Same jitted fn with different args: give each its own key.
        fns = {name: (fn if name == "fp32" else functools.partial(lambda f, *a: f(*a), fn)) for name, fn in fns.items()}
        for wname in ("w8 per-channel", "w4 g128"):
            for fname, f in formulations.items():
                if fname == "mult-reduce" and m > 16:
                    continue  # 100x slower than fp32 already at M=1; not worth the minutes
                key = f"{wname} / {fname}"
                fns[key] = f
                args[key] = (x, weights[wname])
        t = timed_rounds(fns, args, rounds if m < 512 else max(5, rounds // 3))
        base = t["fp32"]
        print(f"{m:5d} {base * 1e3:9.2f}" + "".join(f" {t[name] * 1e3:7.2f} ({t[name] / base:5.2f}x)" for name in weights))
        detail += [(m, key, t[key], t[key] / base) for key in t if " / " in key]
    print("\n## weight-only formulations (the ones ops.py picks from), time / fp32 time")
    for m, key, sec, ratio in detail:
        print(f"M={m:<4d} {key:36s} {sec * 1e3:9.2f} ms  {ratio:6.2f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096, help="square kernel size (default 4096)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per variant (default 15)")
    p.add_argument("--rows", default="1,16,512", help="activation rows M to time (default 1,16,512)")
    p.add_argument("--skip-quantize", action="store_true")
    p.add_argument("--skip-linear", action="store_true")
    a = p.parse_args(argv)
    print(f"# bench_core: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# machine: {machine()}")
    w = jnp.asarray(np.random.default_rng(0).standard_normal((a.size, a.size), np.float32) / np.sqrt(a.size))
    if not a.skip_quantize:
        bench_quantize(w, a.rounds)
    if not a.skip_linear:
        bench_linear(w, [int(r) for r in a.rows.split(",")], a.rounds)


if __name__ == "__main__":
    main()
