"""How far a perplexity moves when the float inputs move by one ulp (docs/cpu-speed.md).

A "same perplexity to 1e-4" check between two implementations only means something for
quantities that one-ulp float changes do not move. This script nudges every entry of every
norm scale (float in every recipe) to a neighbouring float (``nextafter`` up or down at random,
``--seeds`` draws), keeps everything else fixed, and reports each recipe's perplexity spread over the draws, with the
native CPU kernels on and off (``LLMEQ_NATIVE``, a subprocess each). Dynamic per-token int8
activations (W8A8) round ``x / scale`` to integers, so a last-bit change flips a few codes and
the perplexity moves by far more than 1e-4; weight-only and float models do not.

    PYTHONPATH=. python scripts/bench_ulp_sensitivity.py --recipes fp32 rtn-w8 rtn-w8a8 --windows 8 --seeds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def nudged(table, seed: int):
    """``table`` with every entry moved one ulp up or down (seed 0: unchanged)."""
    import numpy as np

    if seed == 0:
        return table
    a = np.asarray(table, np.float32)
    up = np.random.default_rng(seed).random(a.shape) < 0.5
    return np.where(up, np.nextafter(a, np.inf), np.nextafter(a, -np.inf)).astype(np.float32)


def nudged_norms(params, seed: int):
    """``params`` with every norm scale (float in every recipe) moved one ulp per entry."""
    import jax
    import jax.numpy as jnp

    def visit(path, leaf):
        names = [str(getattr(k, "key", "")) for k in path]
        return jnp.asarray(nudged(leaf, seed)) if any("norm" in n for n in names) else leaf

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda a: hasattr(a, "qvalue"))


def measure(args) -> dict:
    """{recipe: [ppl per seed]} in this process (its LLMEQ_NATIVE setting)."""
    import numpy as np

    from llmeq_jax import evaluate, pipeline
    from llmeq_jax.models import load_model

    config, params, tokenizer = load_model(args.model)
    ids = evaluate.tokenize_text(tokenizer, Path(args.text).read_text())
    windows = evaluate.make_windows(ids, 512, args.windows)
    out = {}
    for name in args.recipes:
        q = params if name == "fp32" else pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe(name),
                                                              None, 16, progress=False).params
        ppls = []
        for seed in range(args.seeds + 1):
            res = pipeline.windows_perplexity(config, nudged_norms(q, seed), np.asarray(windows), 4)
            ppls.append(res["ppl"])
        out[name] = ppls
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipes", nargs="+", default=["fp32", "rtn-w8", "rtn-w8a8"])
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2_test.txt"))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=4, help="nudged draws beside the unchanged table")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args)))
        return
    runs = {}
    for native in ("1", "0"):
        cmd = [sys.executable, __file__, "--one", *sys.argv[1:]] if argv is None else [sys.executable, __file__, "--one", *argv]
        proc = subprocess.run(cmd, env={**os.environ, "LLMEQ_NATIVE": native, "TQDM_DISABLE": "1"},
                              capture_output=True, text=True, check=True)
        runs["native" if native == "1" else "xla"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{args.model}, {args.windows} windows of 512 of {Path(args.text).name}; every norm scale nudged by one "
          f"ulp per entry ({args.seeds} draws) beside the unchanged one\n")
    print("| recipe | path | ppl unchanged | nudged min | nudged max | spread (max-min)/unchanged |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.recipes:
        for path, res in runs.items():
            p = res[name]
            print(f"| {name} | {path} | {p[0]:.5f} | {min(p[1:]):.5f} | {max(p[1:]):.5f} | "
                  f"{(max(p) - min(p)) / p[0]:.2e} |")
    for name in args.recipes:
        gap = abs(statistics.mean(runs["native"][name]) - statistics.mean(runs["xla"][name]))
        print(f"\n{name}: |mean native - mean xla| / mean xla = {gap / statistics.mean(runs['xla'][name]):.2e}", end="")
    print()


if __name__ == "__main__":
    main()
