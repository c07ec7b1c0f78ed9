"""Does an allocation that lowers the summed single-layer KLs lower the model's loss? Joint numbers, side by side.

For uniform W4 g128 (asymmetric RTN) and the greedy allocation at its size, from the sensitivity table an
earlier ``scripts/bench_allocate.py`` run saved (``OUT/table-measured.json``): the table's estimate (sum of
single-layer KLs), the joint KL(float || quantized) on the calibration tokens the table was measured on
and on tuning windows (the last quarter of wikitext2_valid.txt), and the next-token NLL there
(its increase over the float model is what perplexity sees).

    PYTHONPATH=. python scripts/alloc_kl_vs_nll.py runs/alloc --candidates 3c,3,3g64,4c,4g256,4,4g64,8c
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from llmeq_jax import calibrate, evaluate
from llmeq_jax.data import CALIB_TEXT, find_data_file
from llmeq_jax.methods import allocate as A
from llmeq_jax.methods import quantize_model
from llmeq_jax.models import forward, load_model


def tune_windows(tok, seq_len: int, n: int):
    text = find_data_file(None, CALIB_TEXT, "calibration").read_text()
    tail = text[int(len(text) * 0.75):]
    return evaluate.make_windows(evaluate.tokenize_text(tok, tail[tail.index("\n") + 1:]), seq_len, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="a bench_allocate.py --out directory holding table-measured.json")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--candidates", required=True, help="the candidates the table was measured with")
    ap.add_argument("--calib-samples", type=int, default=1)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16, help="tuning windows of 512 tokens")
    args = ap.parse_args()
    config, params, tok = load_model(args.model)
    cal = calibrate.calibration_windows(tok, find_data_file(None, CALIB_TEXT, "calibration"), args.calib_samples,
                                        args.calib_seq_len)
    wins = tune_windows(tok, 512, args.windows)
    cands = A.parse_candidates(args.candidates)
    key = {str(k): k for k in cands}
    saved = json.loads((Path(args.out) / "table-measured.json").read_text())["table"]
    table = {p: {key[k]: v for k, v in row.items() if k in key} for p, row in saved.items()}
    shapes = A.block_kernels(params)
    cost = A.cost_table(shapes, cands, 128)
    budget = sum(A.spec_bytes(shapes[p], A.candidate_spec(4, 128)) for p in shapes)
    logp = jax.jit(lambda p, x: jax.nn.log_softmax(forward(config, p, x).astype(jnp.float32), -1))

    def joint(p, toks):
        """(mean KL(float || p) per token, mean next-token NLL per prediction) over ``toks``."""
        kl = nll = 0.0
        for i in range(0, len(toks), 4):
            x = jnp.asarray(toks[i:i + 4])
            lf, lq = logp(params, x), logp(p, x)
            kl += float(jnp.sum(jnp.exp(lf) * (lf - lq)))
            nll -= float(jnp.sum(jnp.take_along_axis(lq[:, :-1], x[:, 1:, None], -1)))
        return kl / toks.size, nll / (toks.size - len(toks))

    _, float_nll = joint(params, wins)
    print(f"float: tuning NLL {float_nll:.4f}")
    solve = A.restrict(cost, table, edges=A.edge_paths(list(shapes), config.num_layers), edge_min_bits=4,
                       max_delta=0.5)
    choices = {"uniform W4 g128": {p: 4 for p in shapes}, "greedy at its size": A.greedy(solve, table, budget)}
    settings = A.recipe_settings("rtn", None)
    for name, choice in choices.items():
        qp, _ = quantize_model(config, params, A.allocation_recipe(choice, group_size=128, name="x", **settings), cal)
        (kc, _), (kt, nt) = joint(qp, cal), joint(qp, wins)
        est = sum(table[p][b] for p, b in choice.items())
        print(f"{name}: estimate {est:.3f}, calibration KL {kc:.3f}, tuning KL {kt:.3f}, "
              f"tuning NLL +{nt - float_nll:.4f} (ppl x{float(jnp.exp(nt - float_nll)):.4f})", flush=True)


if __name__ == "__main__":
    main()
