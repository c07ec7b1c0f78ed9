"""One decode step's attention on a CPU, per kernel: the float cache vs the quantized store, all layers.

    PYTHONPATH=$PWD python scripts/bench_decode_attention.py --slots 64 1088 4096

For each cache length, one jitted program runs a ``lax.scan`` over the ``--layers`` layers of a
stacked cache (SmolLM2-135M's shapes by default: 9 query heads, 3 KV heads, head dim 64, batch 1)
and calls, per layer, one query per head against every slot:

  float        native.decode_attention over the float32 stack (kv.attention.layer_attention)
  xla-float    XLA's attention over the layer sliced out of the stack (what runs without the kernels)
  int8, int4   native.kv_store_attention over the codes, keys post-RoPE (the key grid folded into q)
  int8-rope, int4-rope   the same with keys stored before RoPE (dequantized and rotated per slot)

Times are medians of ``--runs`` warm calls of the whole program (all layers), in milliseconds, with
each variant's speed relative to the float kernel (float_ms / ms) in the same process. Random codes
and grids: the speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import native
from llmeq_jax.kv import attention


def _time(f, *args, runs: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _over_layers(layers: int, one_layer):
    """A jitted scan calling ``one_layer(layer, *args)`` for every layer (summed, so nothing is dropped)."""

    def run(*args):
        def step(total, layer):
            return total + jnp.sum(one_layer(layer, *args)), None

        return jax.lax.scan(step, jnp.float32(0), jnp.arange(layers))[0]

    return jax.jit(run)


def variants(layers, batch, heads, kv_heads, slots, dim, rng):
    """{name: (jitted program, its arguments)} for one cache length."""
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((layers, batch, kv_heads, slots, dim)), jnp.float32)
    v = k * 0.5
    mask = jnp.ones((batch, 1, slots), bool)
    codes8 = jnp.asarray(rng.integers(-128, 128, (layers, batch, kv_heads, slots, dim)), jnp.int8)
    codes4 = jnp.asarray(rng.integers(0, 256, (layers, batch, kv_heads, slots, dim // 2)), jnp.uint8)
    k_scale, k_lo = jnp.full((kv_heads, dim), 0.01), jnp.zeros((kv_heads, dim))
    v_scale = jnp.full((layers, batch, kv_heads, slots, 1), 0.01, jnp.float16)
    v_lo = jnp.zeros((layers, batch, kv_heads, slots, 1), jnp.float16)
    angles = rng.random((batch, slots, dim // 2)).astype(np.float32)
    tables = (jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles)))
    allowed = mask[:, 0]

    def store(bits, rope):
        def one(layer, q, kc, vc):
            return native.kv_store_attention(q[:, 0], kc, vc, k_scale, k_lo, v_scale, v_lo, slots, bits=bits,
                                             layer=layer, allowed=allowed, rope_tables=tables if rope else None)[0]
        return _over_layers(layers, one)

    return {
        "float": (_over_layers(layers, lambda i, q, k, v: attention.layer_attention(q, k, v, i, mask)), (q, k, v)),
        "xla-float": (_over_layers(layers, lambda i, q, k, v: attention.attention_xla(q, k[i], v[i], mask)), (q, k, v)),
        "int8": (store(8, False), (q, codes8, codes8)),
        "int8-rope": (store(8, True), (q, codes8, codes8)),
        "int4": (store(4, False), (q, codes4, codes4)),
        "int4-rope": (store(4, True), (q, codes4, codes4)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, nargs="+", default=[64, 1088, 4096], help="cache lengths")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--runs", type=int, default=9)
    a = ap.parse_args()
    if not native.available():
        raise SystemExit("the native CPU kernels are not built (pip install -e . builds them)")
    rng = np.random.default_rng(0)
    print(f"{a.layers} layers, batch {a.batch}, {a.heads} query / {a.kv_heads} KV heads, head dim {a.head_dim}; "
          f"ms per step (all layers), speed vs the float kernel")
    for slots in a.slots:
        cells, base = [], None
        for name, (f, args) in variants(a.layers, a.batch, a.heads, a.kv_heads, slots, a.head_dim, rng).items():
            ms = _time(f, *args, runs=a.runs)
            base = base or ms
            cells.append(f"{name} {ms:7.3f} ({base / ms:4.2f}x)")
        print(f"slots {slots:6d}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
