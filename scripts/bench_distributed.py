#!/usr/bin/env python
"""Quantization wall time of SmolLM2-135M over 1, 2, 4, 8 CPU devices (one process) and 2 processes x 2 devices.

    python scripts/bench_distributed.py [--devices 1 2 4 8] [--no-multiprocess] [--model smollm2-135m]

Each configuration runs in a fresh process (XLA_FLAGS fixes the device count at start).
Every linear kernel is placed on a ``(1, N)`` mesh first (not timed), then quantized where
it lives with ``distributed.quantize_params_sharded``; the figure is the warm wall time
(median of 3, after one compiling run) for the whole model, plus the first (compiling) run.

Two layouts per recipe show the collectives' share:
  ``columns``  kernels split over output features: per-channel and g128 (groups along
               the input dim) scales are whole on each device -> no collective at all.
  ``rows``     kernels split over input features: per-output-channel needs ``pmax`` over
               the shards, g128 groups may cross shards (partial ranges + pmax).
``collective share`` = (rows - columns) / rows: same weights, devices and arithmetic, the
difference being the cross-device synchronisation (an estimate, not a profiler figure).

GPTQ W4 g128 (``llmeq_jax/configs/gptq-w4-g128.yaml``, 16 x 512 calibration tokens of
wikitext2_valid.txt) runs with ``distributed.quantize_model_sharded`` on an ``(N, 1)`` mesh:
calibration windows split over the data axis, Hessians combined shard by shard
(``ordered_sums``: all_gather, bit-identical to one device), the GPTQ solve replicated.
One timed run (minutes each). Its ``collective share`` is measured, not estimated by
difference: the statistic collectives of one block (the same arrays, shapes and mesh,
run alone under jit, median of 5) times the number of block steps, over the total.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _collective_seconds(config, mesh, batch: int, seq_len: int, steps: int) -> float:
    """Wall time of the statistic collectives GPTQ calibration runs: per block, per step."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from llmeq_jax import distributed as dist
    from llmeq_jax.calibrate import input_stats
    from llmeq_jax.evaluate import median_time

    d, f = config.hidden_size, config.intermediate_size
    widths = {"q": d, "k": d, "v": d, "o": config.num_heads * config.head_dim, "gate": d, "up": d, "down": f}
    shards = mesh.shape[dist.DATA]

    def local(*xs):  # each shard's Hessians, no collective
        return {name: input_stats(x.reshape(-1, x.shape[-1]), ("hessian",)) for name, x in zip(widths, xs)}

    fn = jax.jit(jax.shard_map(lambda *xs: dist.reduce_stats(local(*xs), dist.DATA, ordered_sums=True),
                               mesh=mesh, in_specs=P(dist.DATA), out_specs=P()))
    stats_only = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(dist.DATA), out_specs=P(dist.DATA)))
    xs = [dist.global_array(np.ones((batch * shards, seq_len, w), np.float32), NamedSharding(mesh, P(dist.DATA)))
          for w in widths.values()]
    with_coll = median_time(lambda: jax.block_until_ready(fn(*xs)), runs=5)
    without = median_time(lambda: jax.block_until_ready(stats_only(*xs)), runs=5)
    return max(with_coll - without, 0.0) * config.num_layers * steps


def gptq_row(config, params, tokenizer) -> dict:
    import jax

    from llmeq_jax import distributed as dist
    from llmeq_jax.calibrate import calibration_windows
    from llmeq_jax.data import CALIB_TEXT, find_data_file
    from llmeq_jax.pipeline import read_recipe

    recipe = read_recipe("gptq-w4-g128")
    windows = calibration_windows(tokenizer, find_data_file(None, CALIB_TEXT, "calibration text"), 16, 512)
    n = jax.device_count()
    mesh = dist.make_mesh(n, 1)
    batch = max(1, 4 // n)  # windows per shard per step: 4 windows per step on one device, 1 per shard from 4 up
    t = time.perf_counter()
    q, _ = dist.quantize_model_sharded(config, params, recipe, windows, mesh, batch_size=batch)
    jax.block_until_ready(q)
    total = time.perf_counter() - t
    steps = len(windows) // (batch * n)
    coll = _collective_seconds(config, mesh, batch, windows.shape[1], steps) if n > 1 else 0.0
    return {"recipe": "GPTQ W4 g128", "layout": "data-parallel calibration", "first_s": total, "warm_s": total,
            "collective_s": coll}


def worker(model: str, gptq: bool) -> dict:
    import jax
    from jax.sharding import PartitionSpec as P

    from llmeq_jax import distributed as dist
    from llmeq_jax.core.quantize import Spec
    from llmeq_jax.core.rules import Recipe, Rule
    from llmeq_jax.models import load_model

    config, params, tokenizer = load_model(model)
    mesh = dist.make_mesh(1, jax.device_count())
    n = jax.device_count()
    recipes = {
        "RTN W8 per-channel": Recipe((Rule(r".*/kernel", weight=Spec(8, "channel")),), name="w8"),
        "RTN W4 g128": Recipe((Rule(r".*/kernel", weight=Spec(4, "group", group_size=128)),), name="w4g128"),
    }

    def layout(kind):
        def part(path, shape, m):
            if path.endswith("kernel") and len(shape) == 2:
                d = 1 if kind == "columns" else 0
                if shape[d] % n == 0:
                    return P(None, dist.MODEL) if d == 1 else P(dist.MODEL, None)
            return P()
        return part

    def run(recipe, part, placed):
        t = time.perf_counter()
        q = dist.quantize_params_sharded(placed, recipe, mesh, partition=part)
        jax.block_until_ready(q)
        return time.perf_counter() - t

    rows = []
    for name, recipe in recipes.items():
        for kind in ("columns", "rows"):
            part = layout(kind)
            placed = dist.shard_params(params, mesh, partition=part)
            jax.block_until_ready(placed)
            first = run(recipe, part, placed)
            warm = statistics.median(run(recipe, part, placed) for _ in range(3))
            rows.append({"recipe": name, "layout": kind, "first_s": first, "warm_s": warm})
    if gptq:
        rows.append(gptq_row(config, params, tokenizer))
    return {
        "devices": n, "processes": jax.process_count(), "rows": rows,
        "device_kind": jax.devices()[0].device_kind, "cpus": os.cpu_count(),
    }


def spawn(devices: int | None, model: str, processes: int = 1, gptq: bool = True) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    if processes == 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        cmd = [sys.executable, __file__, "--worker", "--model", model]
    else:
        cmd = [sys.executable, str(REPO / "scripts" / "launch_multihost.py"), "--local", str(processes),
               "--cpu-devices", str(devices), "--timeout", "3500", __file__, "--worker", "--model", model]
    if not gptq:
        cmd.append("--no-gptq")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"benchmark worker failed ({cmd}):\n{out.stderr[-4000:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--no-multiprocess", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--no-gptq", action="store_true", help="RTN rows only (GPTQ takes minutes per config)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        res = worker(a.model, not a.no_gptq)
        import jax

        if jax.process_index() == 0:
            print(json.dumps(res), flush=True)
        return
    results = [spawn(n, a.model, gptq=not a.no_gptq) for n in a.devices]
    if not a.no_multiprocess:
        results.append(spawn(2, a.model, processes=2, gptq=not a.no_gptq))
    base = {(r["recipe"], r["layout"]): r["warm_s"] for r in results[0]["rows"]}
    print(f"model {a.model}; CPU backend, {results[0]['cpus']} cores; warm = median of 3 after a compiling run")
    print("| processes x devices | recipe | layout | first run s | warm s | speed-up vs first config | collective share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        warm = {(x["recipe"], x["layout"]): x["warm_s"] for x in r["rows"]}
        for x in r["rows"]:
            share = ""
            if "collective_s" in x:
                share = f"{x['collective_s'] / x['warm_s']:.1%} ({x['collective_s']:.2f} s)"
            elif x["layout"] == "rows":
                cols = warm[(x["recipe"], "columns")]
                share = f"{max(0.0, (x['warm_s'] - cols) / x['warm_s']):.0%}"
            cfg = f"{r['processes']} x {r['devices'] // r['processes']}"
            print(f"| {cfg} | {x['recipe']} | {x['layout']} | {x['first_s']:.2f} | {x['warm_s']:.3f} | "
                  f"{base[(x['recipe'], x['layout'])] / x['warm_s']:.2f}x | {share} |")


if __name__ == "__main__":
    main()
