"""Benchmark the Pallas kernels against XLA's bf16 dot, as ratios in one run.

On a GPU: warm median time of each kernel and of ``x @ w`` in bf16 for decode
(M = 1..16) and prefill (M = 512..4096) shapes on 4096x4096, 4096x11008 and
11008x4096 weights, printed as TFLOP/s, GB/s and speed-up over bf16; plus int8
decode attention vs bf16 at 32K context. Targets (H100): W8A8 >= 1.5x at
M >= 2048, int4 weight-only >= 2.5x at M <= 16, KV int8 decode >= 1.6x at 32K.

On a CPU: says no GPU was found and prints the roofline estimate (bytes moved,
integer/float ops) for the same shapes.

    PYTHONPATH=. python scripts/bench_kernels.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

WEIGHTS = ((4096, 4096), (4096, 11008), (11008, 4096))
DECODE_M = (1, 4, 16)
PREFILL_M = (512, 2048, 4096)
GROUP = 128


def bytes_moved(m, k, n, kind):
    """Minimum HBM traffic: activations in (bf16), weight (+ scales), output (bf16)."""
    act, out = 2 * m * k, 2 * m * n
    weight = {"bf16": 2 * k * n, "w8a8": k * n + 4 * n, "w8": k * n + 4 * n, "w4g128": k * n // 2 + 4 * n * -(-k // GROUP)}[kind]
    return act + weight + out


def roofline_table():
    print(f"{'weight':>12} {'M':>5} {'kind':>7} {'MB moved':>9} {'GOP':>8} {'bytes/bf16':>10}")
    for k, n in WEIGHTS:
        for m in DECODE_M + PREFILL_M:
            base = bytes_moved(m, k, n, "bf16")
            for kind in ("bf16", "w8a8", "w8", "w4g128"):
                b = bytes_moved(m, k, n, kind)
                print(f"{f'{k}x{n}':>12} {m:>5} {kind:>7} {b / 1e6:>9.1f} {2 * m * k * n / 1e9:>8.2f} {b / base:>10.2f}")
    t, h, d = 32768, 8, 128
    kv_bf16, kv_i8 = 2 * 2 * t * h * d, 2 * t * h * d + 4 * t * h
    print(f"decode attention, T={t}, {h} kv heads x {d}: bf16 {kv_bf16 / 1e6:.1f} MB, int8 {kv_i8 / 1e6:.1f} MB "
          f"(ratio {kv_bf16 / kv_i8:.2f}x)")


def timed(fn, *args, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_bench(reps):
    from llmeq_jax.core.quantize import Spec, quantize
    from pallas_kernels.kv_cache import decode_attention
    from pallas_kernels.w8a8 import w8a8_matmul
    from pallas_kernels.weight_only import weight_only_matmul

    print(f"device: {jax.devices()[0].device_kind}")
    print(f"{'weight':>12} {'M':>5} {'kind':>7} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'vs bf16':>8}")
    for k, n in WEIGHTS:
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
        q8 = quantize(w, Spec(bits=8, granularity="channel"))
        q4 = quantize(w, Spec(bits=4, granularity="group", group_size=GROUP))
        wb = w.astype(jnp.bfloat16)
        fns = {
            "bf16": jax.jit(lambda x: x @ wb),
            "w8a8": jax.jit(lambda x: w8a8_matmul(x, q8.qvalue, q8.scale)),
            "w8": jax.jit(lambda x: weight_only_matmul(x, q8.qvalue, q8.scale, bits=8)),
            "w4g128": jax.jit(lambda x: weight_only_matmul(x, q4.qvalue, q4.scale, bits=4, group=GROUP)),
        }
        for m in DECODE_M + PREFILL_M:
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            base = None
            for kind, fn in fns.items():
                t = timed(fn, x, reps=reps)
                base = base or t
                print(f"{f'{k}x{n}':>12} {m:>5} {kind:>7} {t * 1e3:>8.3f} {2 * m * k * n / t / 1e12:>8.1f} "
                      f"{bytes_moved(m, k, n, kind) / t / 1e9:>7.0f} {base / t:>7.2f}x")
    b, h, g, t, d = 1, 8, 4, 32768, 128
    kq = jax.random.randint(jax.random.key(2), (b, h, t, d), -127, 128).astype(jnp.int8)
    vs = jnp.full((b, h, t, 1), 0.01)
    ks = jnp.full((1, h, 1, d), 0.01)
    q = jax.random.normal(jax.random.key(3), (b, h * g, d), jnp.bfloat16)
    kb = (kq.astype(jnp.bfloat16) * 0.01)

    def bf16_attn(q, k, v):
        s = jnp.einsum("bhgd,bhtd->bhgt", q.reshape(b, h, g, d), k).astype(jnp.float32) / d**0.5
        return jnp.einsum("bhgt,bhtd->bhgd", jax.nn.softmax(s, -1).astype(k.dtype), v).reshape(b, h * g, d)

    t_bf = timed(jax.jit(bf16_attn), q, kb, kb, reps=reps)
    t_i8 = timed(jax.jit(lambda q, k, v: decode_attention(q, k, v, ks, vs, jnp.array([t]), bits=8)), q, kq, kq, reps=reps)
    print(f"decode attention T={t}: bf16 XLA {t_bf * 1e3:.3f} ms, int8 Pallas {t_i8 * 1e3:.3f} ms, {t_bf / t_i8:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        print(f"no GPU found (JAX backend: {jax.default_backend()}); printing the roofline estimate instead")
        roofline_table()
        return
    gpu_bench(args.reps)


if __name__ == "__main__":
    main()
