"""Whether a decode step's idle memory bus can bring the next product's int4 weights into L2 ahead of it.

Between a decode layer's matmuls run ~15 small kernels (norms, RoPE, attention, residual adds, the cache's
writes): ~0.7 ms of rtn-w4-g128's 2.4 ms step on an H200 (docs/kernels.md, 2026-12-04), during which HBM
mostly idles. Read at ~3 TB/s, that time would carry ~2 MB of weights a microsecond, and an H100's or H200's
50 MB L2 holds most of a 7B model's int4 products (q/k/v 25 MB, gate/up 45 MB, down 22.5 MB). If the next
product's first bytes were read while the small kernels run, the product would find them in L2. Whether that
happens -- whether the reads overlap the small kernels at all, whether the lines survive until the product
reads them, and whether the extra kernel costs the product more than it saves -- only a GPU can say. This
times it on one product's shapes, inside a ``lax.scan`` over a stack of layers (each layer's words distinct,
the stack several times L2, as in a decode loop), each scan step:

  window   ``--window`` RMS norms of the carried row with residual adds: small XLA kernels, as between products;
  product  the int4 word kernel on the layer's words (``int4_words_matmul``, the decode path's kernel);

and times, in turns (``bench_kernels.timed_round_robin``), a layer step as:

  window only / product only   the two parts alone (what the window costs; what the product streams at);
  both                         window then product: the baseline;
  main N MB                    both, with the decode loop's read-ahead (``pallas_kernels.prefetch.read_token``):
                               the first N MB of the layer's words XOR-reduced by an XLA kernel that depends only
                               on the step's input (the window's start) and feeds the product's x a zero; if XLA
                               runs it beside the window (a command buffer's graph has no edge between them), the
                               window hides its reads;
  side N MB                    the same reduction on a second stream (``compute_on("gpu_stream:1")``): concurrency
                               by construction;

each under XLA's default command-buffer scheduling (the latency-hiding scheduler's order, which may serialize
the main stream's read with the window) and again under CONCURRENT (kernels ordered by their data alone: the
rows named ", concurrent"; also a measure of what that mode does to the baseline itself).

Reading it: a prefetch variant faster than ``both`` by about N MB at the product's rate (printed as "ideal")
says the lever works at that size; ``scripts/sweep_decode.py --settings prefetch:mb=N,stream=S`` then times it in
a whole decode, where every product's weights are read ahead after the product before it. Slower than ``both``:
the reads do not overlap, or they evict each other, or the extra kernel delays the product. Every variant's output
is the baseline's bit for bit (the token enters as ``0.0 *``), which the script checks.

    PYTHONPATH=. python scripts/probe_prefetch.py [--weights 4096x22016,4096x12288] [--layers 8]
        [--window 2] [--mb 8,16,32] [--reps 10] [--graphs lhs,concurrent]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import int4_words as iw, prefetch  # noqa: E402

# Llama-2-7B's decode products as the decode layout fuses them: gate/up, q/k/v, down
WEIGHTS = ((4096, 22016), (4096, 12288), (11008, 4096))
GROUP = 128
PREFETCH_MB = (8, 16, 32)
# How XLA orders a command buffer's kernels (xla_gpu_command_buffer_scheduling_mode): its default follows the
# latency-hiding scheduler's order, where a read on the program's stream runs where the order puts it; CONCURRENT
# orders kernels by their data alone, where it may run beside the window.
GRAPHS = {"lhs": None, "concurrent": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}}


def prefetch_rows(words_shape, nbytes: int) -> int:
    """How many leading rows of one layer's ``(rows, N)`` int32 words :func:`prefetch.read_token` reads for
    ``nbytes`` (at least one, at most all): the layer's first ``nbytes`` bytes."""
    return prefetch.leading_rows(words_shape[-2:], 4, nbytes)


def rms_norm(h, eps: float = 1e-6):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)


def layer_step(h, words, scales, layer, *, window: int, product: bool, stream: str | None, nbytes: int):
    """One scan step: ``window`` norms with residual adds on the (1, K) row ``h``, then (``product``) the layer's
    int4 product, its output folded back onto K columns. ``stream``: None (no read-ahead), "main" or "side"."""
    k = h.shape[-1]
    token = None
    if stream is not None:  # the decode loop's own read-ahead (pallas_kernels.prefetch), after the step's input
        token = prefetch.read_token(words, layer, h, nbytes=nbytes, stream=stream)
    v = h
    for _ in range(window):
        v = h + rms_norm(v) * 0.5
    if not product:
        return v
    x = v.astype(jnp.bfloat16)
    if token is not None:
        x = x + (token.astype(jnp.float32) * 0.0).astype(x.dtype)
    y = iw.int4_words_matmul(x, words, scales, group=GROUP, layer=layer).astype(jnp.float32)
    reps = -(-k // y.shape[-1])
    return v + jnp.tile(y, (1, reps))[:, :k] * 1e-3


def layer_loop(h, words, scales, *, window: int = 2, product: bool = True, stream: str | None = None,
               nbytes: int = 0):
    """``layer_step`` over every layer of the stacks ``words`` [L, rows, N], ``scales`` [L, K/group, N]."""

    def step(carry, layer):
        h, i = carry
        h = layer_step(h, words, scales, i, window=window, product=product, stream=stream, nbytes=nbytes)
        return (h, i + 1), None

    (h, _), _ = jax.lax.scan(step, (h, jnp.int32(0)), None, length=words.shape[0])
    return h


def variants(window: int, mbs, side: bool, graphs=("lhs",)) -> dict:
    """{name: (keyword arguments of :func:`layer_loop`, the command-buffer scheduling of :data:`GRAPHS`)} the probe
    times: each variant under each of ``graphs``, named with ", concurrent" where it is not XLA's default."""
    out = {}
    for graph in graphs:
        tag = "" if graph == "lhs" else f", {graph}"
        out |= {f"window only{tag}": (dict(window=window, product=False), graph),
                f"product only{tag}": (dict(window=0), graph), f"both{tag}": (dict(window=window), graph)}
        for mb in mbs:
            nbytes = int(mb * (1 << 20))
            out[f"main {mb:g} MB{tag}"] = (dict(window=window, stream="main", nbytes=nbytes), graph)
            if side:
                out[f"side {mb:g} MB{tag}"] = (dict(window=window, stream="side", nbytes=nbytes), graph)
    return out


def stacked_weights(k: int, n: int, layers: int):
    """Random int4 g128 weights for ``layers`` layers as the decode layout holds them: word and scale stacks."""
    from llmeq_jax.core.quantize import Spec, quantize

    ws, ss = [], []
    for i in range(layers):
        w = jax.random.normal(jax.random.key(i), (k, n), jnp.float32) * 0.02
        q4 = quantize(w, Spec(bits=4, granularity="group", group_size=GROUP))
        ws.append(iw.pack_words(q4.values(), GROUP))
        ss.append(q4.scale)
        del w, q4
    return jnp.stack(ws), jnp.stack(ss)


def run(weights=WEIGHTS, layers: int = 8, window: int = 2, mbs=PREFETCH_MB, reps: int = 10,
        side: bool = True, graphs=tuple(GRAPHS)) -> list[dict]:
    """Time each variant per layer step on each (K, N); print a line each and return them as dicts. A variant's
    ratio and saving are against "both" under the same command-buffer scheduling."""
    import bench_kernels as bench

    rows = []
    for k, n in weights:
        words, scales = stacked_weights(k, n, layers)
        h = jax.random.normal(jax.random.key(99), (1, k), jnp.float32)
        named = variants(window, [mb for mb in mbs if mb * (1 << 20) <= words[0].nbytes], side, graphs)
        fns = {name: (lambda h, w, s, kw=kw: layer_loop(h, w, s, **kw), [(h, words, scales)], GRAPHS[graph])
               for name, (kw, graph) in named.items()}
        outputs = {}
        times = bench.timed_round_robin(fns, reps=reps, outputs=outputs)
        for name, t in times.items():
            kw, graph = named[name]
            tag = "" if graph == "lhs" else f", {graph}"
            base, product = times[f"both{tag}"], times[f"product only{tag}"] / layers
            ideal = same = None
            if kw.get("stream"):
                prefetched = prefetch_rows(words.shape, kw["nbytes"]) * 4 * n
                ideal = product * prefetched / (words[0].nbytes + scales[0].nbytes)
                same = bool(jnp.array_equal(outputs[name], outputs["both"]))
            row = dict(weight=f"{k}x{n}", variant=name, graph=graph, us=t / layers * 1e6, vs_both=base / t,
                       vs_default_both=times["both"] / t, saved_us=(base - t) / layers * 1e6,
                       ideal_us=None if ideal is None else ideal * 1e6, same_output=same)
            rows.append(row)
            print(f"{row['weight']:>11} {name:>26} {row['us']:8.1f} us/layer {row['vs_both']:6.3f}x both "
                  f"({row['vs_default_both']:6.3f}x XLA's default)"
                  + (f"  saved {row['saved_us']:6.1f} us (ideal {row['ideal_us']:5.1f})" if ideal is not None else "")
                  + ("" if same is None else "  output: " + ("same" if same else "DIFFERENT")), flush=True)
        del words, scales
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=",".join(f"{k}x{n}" for k, n in WEIGHTS),
                        help="shapes KxN, comma-separated")
    parser.add_argument("--layers", type=int, default=8, help="layers in the stack (its bytes several times L2)")
    parser.add_argument("--window", type=int, default=2, help="RMS norms (with residual adds) before each product")
    parser.add_argument("--mb", default=",".join(map(str, PREFETCH_MB)), help="prefetch sizes in MB, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-side", action="store_true", help="only the main-stream prefetch")
    parser.add_argument("--graphs", default=",".join(GRAPHS),
                        help=f"command-buffer scheduling(s) to compile each variant under: {', '.join(GRAPHS)}")
    args = parser.parse_args(argv)
    try:
        weights = tuple(tuple(int(v) for v in s.split("x")) for s in args.weights.split(","))
        assert all(len(w) == 2 and w[0] % iw.WORD_BLOCK == 0 and w[1] % 128 == 0 for w in weights)
    except (ValueError, AssertionError):
        parser.error(f"--weights {args.weights!r}: expected shapes KxN, K a multiple of {iw.WORD_BLOCK}, "
                     "N of 128")
    try:
        mbs = tuple(float(v) for v in args.mb.split(","))
        assert all(mb > 0 for mb in mbs)
    except (ValueError, AssertionError):
        parser.error(f"--mb {args.mb!r}: expected positive sizes in MB, comma-separated")
    graphs = tuple(filter(None, args.graphs.split(",")))
    if not graphs or set(graphs) - set(GRAPHS):
        parser.error(f"--graphs {args.graphs!r}: expected some of {', '.join(GRAPHS)}")
    if args.layers < 2 or args.window < 0:
        parser.error(f"--layers must be >= 2 and --window >= 0, got {args.layers} and {args.window}")
    if jax.default_backend() != "gpu":
        parser.error(f"no GPU found (JAX backend: {jax.default_backend()}): the probe times GPU memory traffic")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; batch 1, int4 g{GROUP} words, "
          f"{args.layers} layers, a window of {args.window} norms")
    run(weights, args.layers, args.window, mbs, args.reps, side=not args.no_side, graphs=graphs)


if __name__ == "__main__":
    main()
