"""Where the int4 word kernel's time goes on a GPU: its grid, tiles and pipeline with less work a K step.

The word kernel (``pallas_kernels/int4_words.py``, int4 decode) streams its words at 1.2-1.5 TB/s on an H200
where XLA's bf16 dot streams at 2.9-3.4 (docs/kernels.md), and its tiles, warps, stages and splits moved it
only within the run-to-run spread. Whether its bound is the loop's work (~2.2 instructions a weight in SASS,
72 MMAs a K step) or its grid and pipeline (~2 programs an SM, each a 3-stage ``cp.async`` pipeline over 4-5
K steps of 8-16 KB) decides what the next kernel changes. This times, at M = 1, each against the bf16 dot
in turns (``bench_kernels.timed_round_robin``), the same launch (``common.launch_matmul``: grid, K splits,
masks) with the loop doing:

  loads    the words and x tiles loaded as the kernel loads them, one nibble position dequantized and one
           MMA a word block (1/8 of the kernel's dequantization and weight MMAs);
  nibbles  every nibble dequantized by the kernel's PTX and multiplied: 8 MMAs a word block, no offset
           correction, no scales;
  sums     nibbles + x's row sums by MMAs against a tile of ones, taken off each word block (the offset's
           correction, as the kernel makes it per scale group);
  kernel   the word kernel itself (+ the scale rows, zero points, epilogue);

and ``loads`` under other launches (K splits x0.5 / x2 / none, 2 and 4 stages, 8 warps, 128 / 256 columns).
How to read it: ``loads`` near the bf16 dot's bandwidth and the others falling off step by step -> the loop's
work is the bound (fewer instructions or MMAs a weight); ``loads`` itself near the kernel's ~1.3 TB/s -> the
launch is (programs too short or too few bytes in flight: longer programs, deeper pipelines, a persistent
grid), and no dequantization trick will reach issue #15's 2.5x.

    PYTHONPATH=. python scripts/probe_words.py [--weights 4096x4096,4096x11008] [--reps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import config  # noqa: E402
from pallas_kernels import int4_words as iw  # noqa: E402
from pallas_kernels.common import (  # noqa: E402
    dot, launch_matmul, load_tile, matmul_program, span, split_refs, store_matmul)

WEIGHTS = ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336))  # issue #15's int4 target shapes
GROUP = 128
WORKS = ("loads", "nibbles", "sums")  # the probe's loop bodies, lightest first


def _probe_kernel(*refs, m, n, k, blocks, has_bias, split_blocks, split, stacked, work, interpreted):
    """The word kernel's loop (one word block a K step) doing only ``work`` (see the module doc)."""
    _, (x_ref, w_ref), _, _, o_ref = split_refs(refs, stacked=stacked, inputs=2, has_zp=False, has_bias=has_bias)
    cdt = x_ref.dtype
    prog = matmul_program(m, n, k, blocks, split_blocks)
    positions = 1 if work == "loads" else iw.NIBBLES
    ones = jnp.ones((iw.SLICE, blocks.bn), cdt)

    def body(kb, acc):
        words = load_tile(w_ref, span(kb * iw.SLICE, iw.SLICE, w_ref.shape[0], in_bounds=True), prog.cols, 0)
        part = sums = None
        for j in range(positions):
            xt = load_tile(x_ref, prog.rows, span(kb * iw.WORD_BLOCK + j * iw.SLICE, iw.SLICE, k, in_bounds=True), 0)
            term = dot(xt, iw.nibble_operands(words, j, cdt, interpreted))
            part = term if part is None else part + term
            if work == "sums":  # a chain of its own, as the kernel's (ptxas issues it once a warp)
                s = dot(xt, ones)
                sums = s if sums is None else sums + s
        return acc + (part if sums is None else part - sums * iw.code_offset(cdt))

    acc = jax.lax.fori_loop(prog.first, prog.last, body, jnp.zeros((blocks.bm, blocks.bn), jnp.float32))
    store_matmul(o_ref, None, acc, prog, split=split, has_bias=False)


def probe(x, words, *, work: str, blocks=None, k_splits: int | None = None, interpret: bool | None = None):
    """``x`` (M, K) against :func:`int4_words.pack_words` words (K a multiple of 128, N of the tile's columns)
    with the probe's loop ``work`` (:data:`WORKS`) -> (M, N) in x's dtype; :func:`probe_reference` is its value."""
    if work not in WORKS:
        raise ValueError(f"probe: work must be one of {WORKS}, got {work!r}")
    m, k = x.shape
    n = words.shape[1]
    blocks = blocks or iw.default_blocks(m, n, GROUP)
    if k % iw.WORD_BLOCK or words.shape[0] != k // iw.NIBBLES or n % blocks.bn or blocks.bk != iw.WORD_BLOCK:
        raise ValueError(f"probe: expected K a multiple of {iw.WORD_BLOCK} with {k // iw.NIBBLES} word rows, N a "
                         f"multiple of {blocks.bn} and K steps of {iw.WORD_BLOCK}; got x {x.shape}, words "
                         f"{words.shape}, blocks {blocks}")
    interpret = config.resolve_interpret(interpret)
    return launch_matmul(_probe_kernel, [x, words], m=m, n=n, k=k, blocks=blocks, bias=None, k_splits=k_splits,
                         out_dtype=x.dtype, interpret=interpret, name=f"probe_words_{work}", work=work,
                         interpreted=interpret)


def probe_reference(x, words, *, work: str):
    """What :func:`probe` computes, in jnp: sum over word blocks b and the positions j it takes of
    ``x[:, 128 b + 16 j : +16] @ nibbles(words[16 b : +16], j)``; for "sums", the offset taken off through
    x's sums leaves ``x @ values``."""
    m, k = x.shape
    if work == "sums":
        y = x.astype(jnp.float32) @ iw.unpack_words(words, k).astype(jnp.float32)
        return y.astype(x.dtype)
    blocks, n = k // iw.WORD_BLOCK, words.shape[1]
    positions = 1 if work == "loads" else iw.NIBBLES
    xs = x.astype(jnp.float32).reshape(m, blocks, iw.NIBBLES, iw.SLICE)[:, :, :positions]
    w = jnp.stack([iw.nibbles(words, j, x.dtype) for j in range(positions)], axis=0).astype(jnp.float32)
    y = jnp.einsum("mbpi,pbin->mn", xs, w.reshape(positions, blocks, iw.SLICE, n))
    return y.astype(x.dtype)


def launches(k: int, n: int) -> dict:
    """The other launches ``loads`` is timed under: {name: probe keyword arguments}."""
    from pallas_kernels.blocks import Blocks
    from pallas_kernels.common import cdiv, fit_splits, splits_for

    d = iw.default_blocks(1, n, GROUP)
    splits, _ = fit_splits(cdiv(k, iw.WORD_BLOCK), splits_for(cdiv(n, d.bn), cdiv(k, iw.WORD_BLOCK)))
    other_bn = 256 if d.bn == 128 else 128
    out = {f"splits {s}": dict(k_splits=s) for s in sorted({1, max(1, splits // 2), 2 * splits} - {splits})}
    out |= {f"{s} stages": dict(blocks=dataclasses.replace(d, num_stages=s)) for s in (2, 4)}
    out["8 warps"] = dict(blocks=dataclasses.replace(d, num_warps=8))
    out[f"{other_bn} columns"] = dict(blocks=Blocks(d.bm, other_bn, d.bk, d.num_warps, d.num_stages))
    return out


def run(weights=WEIGHTS, reps: int = 10) -> list[dict]:
    """Time the probes at M = 1 on each (K, N); print a line each and return them as dicts."""
    import bench_kernels as bench

    from llmeq_jax.core.quantize import Spec, quantize

    rows = []
    for k, n in weights:
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
        q4 = quantize(w, Spec(bits=4, granularity="group", group_size=GROUP))
        words = iw.pack_words(q4.values(), GROUP)
        copies = bench.copies_for(words.nbytes)
        ws, ss = bench._copies(words, copies), bench._copies(q4.scale, copies)
        wb = bench._copies(w.astype(jnp.bfloat16), copies)
        xs = bench._copies(jax.random.normal(jax.random.key(1), (1, k), jnp.bfloat16), copies)
        del w
        variants = {"bf16": (lambda x, w: x @ w, list(zip(xs, wb))),
                    "kernel": (lambda x, w, s: iw.int4_words_matmul(x, w, s, group=GROUP), list(zip(xs, ws, ss)))}
        for work in WORKS:
            variants[work] = (lambda x, w, work=work: probe(x, w, work=work), list(zip(xs, ws)))
        for name, kw in launches(k, n).items():
            variants[f"loads, {name}"] = (lambda x, w, kw=kw: probe(x, w, work="loads", **kw), list(zip(xs, ws)))
        times = bench.timed_round_robin(variants, reps=reps)
        for name, t in times.items():
            nbytes = 2 * k * n if name == "bf16" else words.nbytes + (q4.scale.nbytes if name == "kernel" else 0)
            row = dict(weight=f"{k}x{n}", variant=name, us=t * 1e6, tb_s=nbytes / t / 1e12, vs_bf16=times["bf16"] / t)
            rows.append(row)
            print(f"{row['weight']:>11} {name:>22} {row['us']:8.1f} us {row['tb_s']:6.2f} TB/s "
                  f"{row['vs_bf16']:6.2f}x bf16", flush=True)
        del ws, ss, wb, xs
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=",".join(f"{k}x{n}" for k, n in WEIGHTS),
                        help="shapes KxN, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    try:
        weights = tuple(tuple(int(v) for v in s.split("x")) for s in args.weights.split(","))
        assert all(len(w) == 2 and w[0] % iw.WORD_BLOCK == 0 for w in weights)
    except (ValueError, AssertionError):
        parser.error(f"--weights {args.weights!r}: expected shapes KxN with K a multiple of {iw.WORD_BLOCK}")
    if jax.default_backend() != "gpu":
        parser.error(f"no GPU found (JAX backend: {jax.default_backend()}): the probe times GPU kernels")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; M = 1, int4 g{GROUP} words")
    run(weights, args.reps)


if __name__ == "__main__":
    main()
