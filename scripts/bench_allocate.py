"""Perplexity vs average stored bits: allocated (llmeq allocate) vs uniform recipes -> table + PNG.

    python scripts/bench_allocate.py smollm2-135m --budgets 2.5,3,4.25,6 --lagrange-budgets 3,4.25 \
        --uniform 2,4,8 --windows 16 --out runs/allocate

The sensitivity table is computed once (it does not depend on the budget), then each
budget is solved and its recipe quantized (``--method``: rtn, or gptq with the ready
``gptq-w4-g128`` settings on ``--method-calib`` windows of 512 tokens; or ``--base RECIPE``: that ready
recipe's method, rotation and fine-tuning step, as ``llmeq allocate --base``) and evaluated under DESIGN §6's protocol
(wikitext2_test.txt, windows of 512, the first --windows; calibration on
wikitext2_valid.txt). Results are appended to ``results.json`` as they come, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmeq_jax import calibrate, evaluate  # noqa: E402
from llmeq_jax.data import CALIB_TEXT, EVAL_TEXT, find_data_file  # noqa: E402
from llmeq_jax.methods import allocate as A  # noqa: E402
from llmeq_jax.methods import quantize_model  # noqa: E402
from llmeq_jax.methods import sensitivity as S  # noqa: E402
from llmeq_jax.models import forward, load_model  # noqa: E402
from llmeq_jax.pipeline import finetune_windows, read_recipe  # noqa: E402


def ppl(config, params, wins) -> float:
    return evaluate.perplexity(lambda p, t: forward(config, p, t), wins, batch_size=4, params=params)["ppl"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--budgets", default="2.5,3,u4,6",
                    help="average stored bits, or uN: the bytes of uniform N-bit (u4: the size of uniform W4 g128)")
    ap.add_argument("--uniform", default="2,4,8")
    ap.add_argument("--candidates", default="2,3,4,8")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sensitivity", default="measured", choices=list(A.SENSITIVITIES))
    ap.add_argument("--reference", default="4", help="nll: the uniform candidate the table is taken around")
    ap.add_argument("--first-order", type=float, default=0.5, help="nll: weight of the first-order term")
    ap.add_argument("--grad-samples", type=int, default=16, help="nll: gradient windows of --grad-seq-len tokens")
    ap.add_argument("--grad-seq-len", type=int, default=512)
    ap.add_argument("--lagrange-budgets", default="3,u4", help="budgets also solved by the Lagrangian rule")
    ap.add_argument("--edge-min-bits", type=int, default=4, help="first/last blocks' linears never below (0: off)")
    ap.add_argument("--max-delta", type=float, default=0.5, help="measured: drop widths costing more nats (0: off)")
    ap.add_argument("--method", default="rtn", help="how every recipe (allocated and uniform) is quantized")
    ap.add_argument("--base", help="a ready recipe every recipe is built on (replaces --method: its method, "
                                   "rotation and fine-tuning step; llmeq allocate --base)")
    ap.add_argument("--method-calib", type=int, default=16, help="calibration windows of 512 tokens for --method")
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default="runs/allocate")
    ap.add_argument("--measure", default="", help="candidates whose KL is measured (default: one per pickable "
                                                  "width below the widest)")
    ap.add_argument("--reuse-table", action="store_true", help="take the sensitivity table saved in --out by an "
                                                                   "earlier run with the same candidates")
    ap.add_argument("--float-ppl", type=float, help="the float model's perplexity under the same protocol, if "
                                                    "already measured (skips that evaluation)")
    args = ap.parse_args()
    if args.sensitivity == "nll" and args.lagrange_budgets:
        ap.error("--sensitivity nll takes the greedy solver only: pass --lagrange-budgets ''")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config, params, tok = load_model(args.model)
    cal = calibrate.calibration_windows(tok, find_data_file(None, CALIB_TEXT, "calibration"), args.calib_samples,
                                        args.calib_seq_len)
    ids = evaluate.tokenize_text(tok, find_data_file(None, EVAL_TEXT, "evaluation").read_text())
    wins = evaluate.make_windows(ids, args.seq_len, args.windows)
    settings = A.recipe_settings(args.method, read_recipe(args.base) if args.base else None)
    valid = find_data_file(None, CALIB_TEXT, "calibration")
    method_cal = calibrate.calibration_windows(tok, valid, args.method_calib, 512)
    grad_cal = (calibrate.calibration_windows(tok, valid, args.grad_samples, args.grad_seq_len)
                if args.sensitivity == "nll" else None)  # only nll takes a gradient
    sparams = A.sensitivity_params(config, params, settings.get("rotate"))  # what the method quantizes
    cands = A.parse_candidates(args.candidates)
    group = args.group_size or None
    shapes = A.block_kernels(sparams)
    cost = A.cost_table(shapes, cands, group)
    weights = {p: math.prod(s) for p, s in shapes.items()}

    spec_for = lambda b: A.candidate_spec(b, group)  # noqa: E731
    cache = out / f"table-{args.sensitivity}.json"
    if args.reuse_table and cache.exists():
        saved = json.loads(cache.read_text())
        key = {str(k): k for k in cands}
        table = {p: {key[k]: v for k, v in row.items() if k in key} for p, row in saved["table"].items()}
        if any(len(row) != len(cands) for row in table.values()):
            raise SystemExit(f"{cache} lacks some of the candidates {list(cands)}")
        t_proxy, t_meas = saved["proxy_s"], saved["measured_s"]
    else:
        table, t_proxy, t_meas = A.sensitivity_table(config, sparams, cal, shapes, cands, cost, spec_for,
                                                     args.sensitivity, progress=True,
                                                     measure=[A._candidate_key(x) for x in args.measure.split(",")]
                                                     if args.measure else None,
                                                     reference=A._candidate_key(args.reference),
                                                     first_order=args.first_order, grad_windows=grad_cal)
        cache.write_text(json.dumps({"table": {p: {str(k): v for k, v in row.items()} for p, row in table.items()},
                                     "proxy_s": t_proxy, "measured_s": t_meas}))
    solve_cost = A.restrict(cost, table, edges=A.edge_paths(list(shapes), config.num_layers),
                            edge_min_bits=args.edge_min_bits or None,
                            max_delta=(args.max_delta or None) if args.sensitivity != "proxy" else None)
    results = {"model": args.model, "device": f"{jax.devices()[0].device_kind} ({platform.processor() or 'cpu'})",
               "protocol": evaluate.PROTOCOL, "windows": args.windows, "seq_len": args.seq_len,
               "calibration": f"{args.calib_samples} x {args.calib_seq_len} tokens of {CALIB_TEXT}",
               "sensitivity": args.sensitivity + (f" around {args.reference}, first-order weight {args.first_order}, "
                                                  f"gradient on {args.grad_samples} x {args.grad_seq_len} tokens"
                                                  if args.sensitivity == "nll" else ""),
               "candidates": f"{args.candidates} asymmetric", "method": args.base or args.method, "proxy_s": t_proxy, "measured_s": t_meas, "rows": []}
    print(f"sensitivity: proxy {t_proxy:.0f} s, measured {t_meas:.0f} s", flush=True)

    def record(row):
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(row), flush=True)

    record({"kind": "float", "avg_bits": 32.0, "ppl": args.float_ppl or ppl(config, params, wins)})
    recipes = []
    for b in [A._candidate_key(x) for x in args.uniform.split(",") if x]:
        choice = {p: b for p in shapes}
        g = f"g{args.group_size}" if isinstance(b, int) else ""
        recipes.append(("uniform", f"{args.base or args.method}-w{b}{g}-asym", choice))
    for solver, budgets in (("greedy", args.budgets), ("lagrange", args.lagrange_budgets)):
        for budget in [x for x in budgets.split(",") if x]:
            if budget.startswith("u"):  # the bytes uniform N-bit stores
                ub = A._candidate_key(budget[1:])
                budget_b = sum(A.spec_bytes(shapes[p], A.candidate_spec(ub, group)) for p in shapes)
            else:
                budget_b = A.budget_bytes(shapes, float(budget), None)
            if solver == "greedy":
                choice = A.greedy(solve_cost, table, budget_b)
            else:
                choice = A.lagrange(solve_cost, S.lagrange_coefficients(table, weights), budget_b)[0]
            recipes.append((f"allocated-{solver}", f"alloc-{solver}-{budget}", choice))
    keys = {b for _, _, choice in recipes for b in choice.values()}
    allcost = A.cost_table(shapes, sorted(keys, key=A.candidate_order), group)
    for kind, name, choice in recipes:
        recipe = A.allocation_recipe(choice, group_size=group, name=name, **settings)
        qp, _ = quantize_model(config, params, recipe, method_cal,
                               finetune_windows=finetune_windows(config, tok, recipe, valid))
        s = A.summary(choice, allcost, shapes)
        record({"kind": kind, "name": name, "avg_bits": s["avg_bits"], "widths": {str(k): v for k, v in s["widths"].items()},
                "est_loss": sum(table[p][b] for p, b in choice.items()) if all(b in table[p] for p, b in choice.items()) else None,
                "ppl": ppl(config, qp, wins), "choice": {p: str(b) for p, b in choice.items()}})
    plot(results, out / "ppl_vs_bits.png")
    (out / "table.md").write_text(table_md(results))
    print(table_md(results))


def table_md(results: dict) -> str:
    base = next(r["ppl"] for r in results["rows"] if r["kind"] == "float")
    lines = ["| recipe | stored bits/weight | widths (count of linears) | ppl | vs float |", "|---|---:|---|---:|---:|"]
    for r in results["rows"]:
        if r["kind"] == "float":
            continue
        lines.append(f"| {r['name']} | {r['avg_bits']:.3f} | {r['widths']} | {r['ppl']:.3f} | "
                     f"{100 * (r['ppl'] / base - 1):+.1f} % |")
    lines.append(f"| float (dequantized Q4_1 baseline) | 32 | | {base:.3f} | |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    base = next(r["ppl"] for r in results["rows"] if r["kind"] == "float")
    kinds = sorted({r["kind"] for r in results["rows"] if r["kind"] != "float"})
    for kind in kinds:
        rows = sorted((r for r in results["rows"] if r["kind"] == kind), key=lambda r: r["avg_bits"])
        ax.plot([r["avg_bits"] for r in rows], [r["ppl"] for r in rows], "o-", label=kind)
    ax.axhline(base, color="gray", ls="--", label="float")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per block-linear weight (scales counted)")
    ax.set_ylabel(f"perplexity ({results['windows']} x {results['seq_len']} tokens, wikitext2 test)")
    ax.set_title(f"{results['model']}: allocated vs uniform {results.get('method', 'rtn')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
