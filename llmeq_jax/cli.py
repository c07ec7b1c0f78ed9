"""`llmeq`: quantize, evaluate, compare, generate, convert and inspect models.

MODEL is everywhere a registry name (``smollm2-135m``), a Hugging Face
directory, a GGUF file, or a checkpoint directory written by ``llmeq quantize``
/ ``llmeq convert``. Errors print one line on stderr and exit with status 2:
arguments are checked before any work starts, and any exception that still
escapes becomes one line too (``LLMEQ_DEBUG=1`` prints the traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from llmeq_jax.data import CALIB_TEXT, EVAL_TEXT, HELD_OUT_TEXT, extra_eval_text, find_data_file, windows_of
from llmeq_jax.errors import UsageError
from llmeq_jax.pipeline import (LOAD_DTYPES, MAIN_RECIPES, build_kv_quantizer, first_kernel_path, kv_mapping, kv_memory,
                                layer_values, measure_speed, open_model, param_bytes, read_recipe, recipe_path,
                                run_recipe, text_perplexity, windows_perplexity)

MODEL_HELP = "registry name (e.g. smollm2-135m), Hugging Face directory, .gguf file or llmeq checkpoint directory"


SEED_MAX = 2**32 - 1  # jax.random.key takes the seed as a 32-bit value without x64


# --------------------------------------------------------------------------- argument types
# argparse calls these on the raw strings, so a bad value is rejected before any work starts.


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected {what}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is out of range; expected {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _finite_float(low: float | None, high: float | None, what: str, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected {what}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not finite; expected {what}")
        if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; expected {what}")
        return value

    parse.__name__ = what
    return parse


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected a seed in [0, {SEED_MAX}]") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{value} is out of range; expected a seed in [0, {SEED_MAX}]")
    return value


def _candidate_arg(text: str):
    """An allocation candidate key (``4``, ``4g64``, ``8c``) for an argument."""
    from llmeq_jax.methods.allocate import _candidate_key

    key = _candidate_key(text)
    if key is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a candidate; expected B, BgG or Bc (e.g. 4, 4g64, 8c)")
    return key


POSITIVE = _int_at_least(1, "an integer >= 1")
NON_NEGATIVE = _int_at_least(0, "an integer >= 0")
SEQ_LEN = _int_at_least(2, "an integer >= 2 (one token predicts the next)")
TEMPERATURE = _finite_float(0.0, None, "a finite temperature >= 0 (0 = greedy)")
TOP_P = _finite_float(0.0, 1.0, "a finite mass in (0, 1]", low_open=True)
BUDGET_GB = _finite_float(0.0, None, "a finite size in GiB > 0", low_open=True)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (its default prints the usage block first)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


# --------------------------------------------------------------------------- argument checks


def check_writable_dir(out: Path, overwrite: bool) -> None:
    """Before any work: --out may be created, or (with --overwrite) replaced -- only if it is a checkpoint of ours."""
    from llmeq_jax import checkpoint

    if out.exists() or out.is_symlink():
        if not overwrite:
            raise UsageError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
        full = Path(os.path.abspath(out))
        if full == Path.cwd() or full in Path.cwd().parents:
            raise UsageError(f"--out {str(out)!r} is the current directory or holds it; refusing to replace it")
        if out.is_symlink() or not out.is_dir() or not checkpoint.is_checkpoint(out):
            raise UsageError(f"--out {str(out)!r} exists and is not an llmeq_jax checkpoint; --overwrite replaces "
                           "only a checkpoint directory, never other files")
    parent = out.absolute().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"output directory {str(out)!r} cannot be created: {str(probe)!r} is not a directory")
    if not os.access(probe, os.W_OK):
        raise UsageError(f"output directory {str(out)!r} cannot be written (no write permission in {str(probe)!r})")


def check_context(config, seq_len: int, flag: str = "--seq-len") -> None:
    """A window longer than the model's context would run past its positions: refuse, don't extrapolate."""
    if seq_len > config.max_position_embeddings:
        raise UsageError(f"{flag} {seq_len} exceeds the model's context of {config.max_position_embeddings} tokens")


def checkpoint_dir_for(out_dir: Path, recipe_name: str) -> Path:
    """``out_dir/ckpt-<name>`` with the name reduced to one safe path component (never ``..`` or ``/``)."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]", "_", str(recipe_name)).lstrip(".") or "recipe"
    path = out_dir / f"ckpt-{safe}"
    if Path(os.path.abspath(path)).parent != Path(os.path.abspath(out_dir)):
        raise UsageError(f"recipe name {recipe_name!r} does not give a directory inside --out-dir {str(out_dir)!r}")
    return path


# --------------------------------------------------------------------------- commands


def cmd_quantize(args) -> int:
    from llmeq_jax import checkpoint

    out = Path(args.out)
    check_writable_dir(out, args.overwrite)
    recipe = read_recipe(args.recipe)
    config, params, tokenizer, _ = open_model(args.model, verify=args.verify, dtype=args.dtype)
    qparams, q_s, c_s, n = run_recipe(config, params, tokenizer, recipe, args.calib, args.calib_samples,
                                          not args.json, args.calib_seq_len)
    kv = build_kv_quantizer(config, qparams, tokenizer, kv_mapping(args.kv, recipe.to_dict()), args.calib)
    if kv is not None:  # the key ranges are calibrated on the quantized model and travel in the recipe
        import dataclasses

        recipe = dataclasses.replace(recipe, kv=kv.to_dict())
    checkpoint.save_model_checkpoint(out, config, qparams, tokenizer, recipe=recipe, overwrite=args.overwrite,
                                     extra={"source": args.model, "quantize_s": q_s, "calib_s": c_s,
                                            "calib_samples": n})
    info = {"out": str(out), "recipe": recipe.name, "quantize_s": q_s, "calib_s": c_s, "calib_samples": n,
            "param_bytes": param_bytes(qparams), "disk_bytes": checkpoint.disk_bytes(out)}
    _emit(args, info, f"saved {recipe.name} checkpoint to {out} ({info['disk_bytes'] / 1e6:.2f} MB on disk, "
                      f"quantized in {q_s:.1f} s)")
    return 0


def cmd_eval(args) -> int:
    from llmeq_jax import checkpoint, evaluate
    from llmeq_jax.generate import cache_dtype_for

    text = find_data_file(args.text, EVAL_TEXT, "evaluation text")
    t0 = time.perf_counter()
    config, params, tokenizer, recipe = open_model(args.model, verify=args.verify, keep_quantized=args.keep_quantized,
                                                   dtype=args.dtype)
    load_s = time.perf_counter() - t0
    check_context(config, args.seq_len)
    kv = build_kv_quantizer(config, params, tokenizer, kv_mapping(args.kv, recipe), args.calib)
    t0 = time.perf_counter()
    res = text_perplexity(config, params, tokenizer, text, args.seq_len, args.windows, args.batch_size, not args.json, kv,
                          recipe, scan_layers=args.scan_layers)
    loaded = "gguf-as-stored" if args.keep_quantized else "as-loaded"
    name = (recipe or {}).get("name", loaded) + ("" if kv is None else f" + kv{kv.spec.bits}")
    row = evaluate.Row(recipe=name, ppl=res["ppl"], nll=res["nll"],
                       param_bytes=param_bytes(params), load_s=load_s, eval_s=time.perf_counter() - t0)
    mem = kv_memory(config, args.seq_len, kv, args.kv_budget_gb, cache_dtype_for(params).name)
    row.extra.update(mem)
    if Path(args.model).is_dir() and (Path(args.model) / checkpoint.MANIFEST).is_file():
        row.disk_bytes = checkpoint.disk_bytes(args.model)
    if args.speed:
        row.__dict__.update(measure_speed(config, params, scan_layers=args.scan_layers))
    report = evaluate.Report(model=args.model, text=str(text), seq_len=args.seq_len, n_windows=res["windows"],
                             rows=[row], peak_host_mb=evaluate.peak_host_memory_mb())
    report.rows[0].extra["tokens"] = res["tokens"]
    if args.dtype:
        report.notes.append(f"float weights and activations in {args.dtype} (--dtype)")
    flt = mem["float_kv"]
    report.notes.append(
        f"KV cache ({mem['kv']}): {mem['kv_bytes_per_token']:.0f} bytes/token "
        f"({mem['kv_x_smaller_than_float']:.2f}x smaller than {flt}) + {mem['kv_fixed_bytes']} fixed bytes; "
        f"longest context in {mem['kv_budget_gb']:g} GiB: {mem['kv_longest_context']} tokens "
        f"({flt} cache: {mem['float_kv_longest_context']}; the model's own limit: {mem['model_max_context']})")
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.to_markdown())
    return 0


def cmd_compare(args) -> int:
    text = find_data_file(args.text, EVAL_TEXT, "evaluation text")
    extra_texts = dict(extra_eval_text(t) for t in args.extra_text)
    if len(extra_texts) != len(args.extra_text):
        raise UsageError(f"--extra-text: two texts share a name ({args.extra_text}); each needs its own file name")
    recipes = [read_recipe(r) for r in args.recipes]
    out_dir = Path(args.out_dir)
    ckpts = [checkpoint_dir_for(out_dir, r.name) for r in recipes]
    if len(set(ckpts)) != len(ckpts):
        raise UsageError(f"--recipes: two recipes share a name ({[r.name for r in recipes]}); each needs its own")
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out-dir {str(out_dir)!r} exists and is not a directory")
    t0 = time.perf_counter()
    config, params, tokenizer, _ = open_model(args.model, verify=args.verify, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    check_context(config, args.seq_len)
    created = _missing_dirs(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        extra_windows = {name: windows_of(tokenizer, t, args.seq_len, args.windows) for name, t in extra_texts.items()}
        return _compare_into(args, text, extra_windows, recipes, ckpts, out_dir, config, params, tokenizer, load_s)
    except BaseException:
        for d in created:  # deepest first: leave no empty directory of ours behind
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for d in [path, *path.absolute().parents]:
        if d.exists():
            break
        missing.append(d)
    return missing


def _compare_into(args, text, extra_windows, recipes, ckpts, out_dir, config, params, tokenizer, load_s) -> int:
    import shutil

    from llmeq_jax import checkpoint, evaluate, plots

    report = evaluate.Report(model=args.model, text=str(text), seq_len=args.seq_len, n_windows=args.windows,
                             extra_texts=list(extra_windows))
    layer = first_kernel_path(params)
    hist: dict[str, Any] = {}
    for recipe, ckpt in zip(recipes, ckpts):
        _log(args, f"== {recipe.name}")
        qparams, q_s, c_s, n = run_recipe(config, params, tokenizer, recipe, args.calib, args.calib_samples,
                                              not args.json, args.calib_seq_len)
        checkpoint.save_model_checkpoint(ckpt, config, qparams, tokenizer, recipe=recipe, overwrite=True)
        disk = checkpoint.disk_bytes(ckpt)
        if not args.keep_checkpoints:
            shutil.rmtree(ckpt)
        t1 = time.perf_counter()
        res = text_perplexity(config, qparams, tokenizer, text, args.seq_len, args.windows, args.batch_size, not args.json,
                              recipe=recipe, scan_layers=args.scan_layers)
        row = evaluate.Row(recipe=recipe.name, ppl=res["ppl"], nll=res["nll"], param_bytes=param_bytes(qparams),
                           disk_bytes=disk, load_s=load_s, calib_s=c_s, calib_samples=n, quantize_s=q_s,
                           eval_s=time.perf_counter() - t1)
        for name, wins in extra_windows.items():
            more = windows_perplexity(config, qparams, wins, args.batch_size, not args.json, recipe=recipe,
                                      scan_layers=args.scan_layers)
            row.extra.setdefault("texts", {})[name] = {"ppl": more["ppl"], "nll": more["nll"], "tokens": more["tokens"]}
        if args.speed:
            row.__dict__.update(measure_speed(config, qparams, scan_layers=args.scan_layers))
        report.rows.append(row)
        if layer:
            hist[recipe.name] = layer_values(qparams, layer)
        _log(args, f"   ppl {row.ppl:.3f}  bytes {row.param_bytes / 1e6:.2f} MB  quantize {q_s:.1f} s")
    report.peak_host_mb = evaluate.peak_host_memory_mb()
    report.notes.append(f"load {load_s:.1f} s; calibration text {args.calib or CALIB_TEXT} where a recipe needs it")
    if args.dtype and args.dtype != "float32":  # the unquantized row is named after its recipe (fp32)
        report.notes.append(f"float weights and activations in {args.dtype} (--dtype): a recipe that quantizes "
                            f"nothing (fp32) gives the {args.dtype} model")
    report.save_json(out_dir / "report.json")
    (out_dir / "report.md").write_text(report.to_markdown() + "\n")
    plots.ppl_vs_size(report, out_dir / "ppl_vs_size.png")
    plots.time_breakdown(report, out_dir / "time_breakdown.png")
    if hist:
        plots.weight_histograms(hist, layer, out_dir / "weight_hist.png")
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.to_markdown())
        print(f"\nreport, plots: {out_dir}/")
    return 0


def cmd_generate(args) -> int:
    import jax.numpy as jnp

    from llmeq_jax.generate import generate

    config, params, tokenizer, recipe = open_model(args.model, verify=args.verify, keep_quantized=args.keep_quantized,
                                                   dtype=args.dtype)
    ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if config.bos_token_id is not None and not args.no_bos:
        ids = [config.bos_token_id] + ids
    if not ids:
        raise UsageError("--prompt is empty and no BOS token is prepended (--no-bos or a model without one); "
                       "expected at least one token to continue from")
    kv = build_kv_quantizer(config, params, tokenizer, kv_mapping(args.kv, recipe), args.calib)
    from llmeq_jax import online

    alphas = online.decays(params, recipe)
    if alphas and (kv is not None or not (args.temperature is None or args.temperature == 0)):
        raise UsageError("a recipe with online activation scales (act_ema) generates greedily with a float KV cache; "
                       "drop --kv / --temperature")
    if len(ids) + args.max_new_tokens > config.max_position_embeddings:
        raise UsageError(f"prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds the model's "
                       f"context of {config.max_position_embeddings}")
    greedy = not args.temperature  # None (no --temperature) or 0: argmax, as --temperature 0 means elsewhere
    if alphas and args.prompt_activation_bits != 16:
        raise UsageError("a recipe with online activation scales (act_ema) runs its own prefill; "
                         "drop --prompt-activation-bits")
    if alphas and args.scan_layers:
        raise UsageError("a recipe with online activation scales (act_ema) generates with unrolled blocks; "
                         "drop --scan-layers")
    if alphas:  # the EMA state runs through prefill and every decode step
        out, _ = online.generate(config, params, jnp.asarray([ids], jnp.int32), args.max_new_tokens, alphas)
    else:
        if args.scan_layers:
            from llmeq_jax.models import stacked

            params = stacked.stack_blocks_or_warn(config, params)
        out = generate(config, params, jnp.asarray([ids], jnp.int32), args.max_new_tokens,
                       greedy=greedy, temperature=args.temperature if not greedy else 1.0,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, kv=kv,
                       prompt_activation_bits=args.prompt_activation_bits)
    new = [int(t) for t in out[0]]
    if config.eos_ids:
        for i, t in enumerate(new):
            if t in config.eos_ids:
                new = new[: i + 1]
                break
    text = args.prompt + continuation_text(tokenizer, ids, new)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "tokens": new, "text": text}))
    else:
        print(text)
    return 0


def continuation_text(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add after the prompt.

    Decoding the new tokens alone drops the space a SentencePiece token carries in front
    ("Once upon" + "a time" -> "Once upona time"); decoding prompt + new and cutting off the
    prompt's own decoding keeps it.
    """
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)
    if full.startswith(prompt):
        return full[len(prompt):]
    return tokenizer.decode(new_ids, skip_special_tokens=True)


def cmd_convert(args) -> int:
    from llmeq_jax import checkpoint

    out = Path(args.dst)
    check_writable_dir(out, args.overwrite)
    if args.recipe and args.keep_quantized:
        raise UsageError("--recipe quantizes float weights; --keep-quantized keeps the GGUF file's own grids: "
                         "pass one of them")
    config, params, tokenizer, _ = open_model(args.src, verify=args.verify, keep_quantized=args.keep_quantized,
                                              dtype=args.dtype)
    recipe = None
    if args.recipe:
        recipe = read_recipe(args.recipe)
        params, *_ = run_recipe(config, params, tokenizer, recipe, args.calib, args.calib_samples, True,
                                    args.calib_seq_len)
    checkpoint.save_model_checkpoint(out, config, params, tokenizer, recipe=recipe, overwrite=args.overwrite,
                                     extra={"source": args.src})
    size = checkpoint.disk_bytes(out)
    _emit(args, {"out": str(out), "recipe": None if recipe is None else recipe.name, "bytes": size},
          f"wrote {out} ({size / 1e6:.2f} MB on disk)")
    return 0


def cmd_inspect(args) -> int:
    from llmeq_jax import checkpoint

    manifest = checkpoint.read_manifest(args.dir)
    # Always the cheap check (manifest hash, every file there at its size); --verify hashes every byte.
    n_files = checkpoint.verify(args.dir) if args.verify else checkpoint.check_files_present(args.dir)
    checked = f"{n_files} files verified (sha256)" if args.verify else f"{n_files} files present (--verify hashes them)"
    rows = checkpoint.describe_layout(manifest["layout"])
    if args.json:
        print(json.dumps({"recipe": manifest.get("recipe"), "metadata": manifest.get("metadata"), "leaves": rows,
                          "verified": bool(args.verify), "files_checked": n_files}, indent=1))
        return 0
    recipe = (manifest.get("recipe") or {}).get("name", "none")
    print(f"{args.dir}: recipe {recipe}, format version {manifest['format_version']}, "
          f"{checkpoint.disk_bytes(args.dir) / 1e6:.2f} MB on disk, {checked}")
    width = max(len(r["path"]) for r in rows) if rows else 10
    print(f"{'path':<{width}}  {'kind':<6} {'bits':>4} {'grid':<7} {'granularity':<16} {'shape':<16} {'bytes':>10}")
    for r in rows:
        print(f"{r['path']:<{width}}  {r['kind']:<6} {r['bits'] or '':>4} {r['grid'] or '':<7} {r['granularity']:<16} "
              f"{str(tuple(r['shape'])):<16} {r['bytes']:>10}")
    total = sum(r["bytes"] for r in rows)
    print(f"total {total} bytes ({total / 1e6:.2f} MB) in {len(rows)} leaves")
    return 0


def cmd_export(args) -> int:
    from llmeq_jax import checkpoint
    from llmeq_jax.export import export_checkpoint

    out = export_checkpoint(args.ckpt, args.format, args.out, source=args.source, overwrite=args.overwrite)
    size = checkpoint.disk_bytes(out) if out.is_dir() else out.stat().st_size
    info = {"out": str(out), "format": args.format, "bytes": size, "checkpoint_bytes": checkpoint.disk_bytes(args.ckpt)}
    _emit(args, info, f"wrote {args.format} {out} ({size / 1e6:.2f} MB; checkpoint {info['checkpoint_bytes'] / 1e6:.2f} MB)")
    return 0


def cmd_allocate(args) -> int:
    """Per-layer bit widths under a budget -> a recipe YAML that `llmeq quantize` runs (methods/allocate.py)."""
    from llmeq_jax import calibrate
    from llmeq_jax.methods import allocate as alloc

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise UsageError(f"--out {str(out)!r} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_file():
        raise UsageError(f"--out {str(out)!r} exists and is not a file")
    if not out.absolute().parent.is_dir():
        raise UsageError(f"--out {str(out)!r}: folder {str(out.absolute().parent)!r} does not exist")
    candidates = alloc.parse_candidates(args.candidates)
    base = read_recipe(args.base) if args.base else None
    config, params, tokenizer, recipe = open_model(args.model, verify=args.verify)
    if recipe is not None:
        raise UsageError(f"MODEL {args.model!r} is an already quantized checkpoint; allocate from the float model")
    check_context(config, args.calib_seq_len, "--calib-seq-len")
    text = find_data_file(args.calib, CALIB_TEXT, "calibration text")
    windows = calibrate.calibration_windows(tokenizer, text, args.calib_samples, args.calib_seq_len)
    grad_windows = None
    if args.sensitivity == "nll":
        check_context(config, args.grad_seq_len, "--grad-seq-len")
        grad_windows = calibrate.calibration_windows(tokenizer, text, args.grad_samples, args.grad_seq_len)
    elif args.reference is not None:
        raise UsageError("--reference is the nll sensitivity's uniform width; pass --sensitivity nll")
    name = args.name or out.stem
    t0 = time.perf_counter()
    recipe, info = alloc.allocate(config, params, windows, candidates=candidates, budget_bits=args.budget_bits,
                                  budget_mb=args.budget_mb, group_size=args.group_size or None, solver=args.solver,
                                  sensitivity=args.sensitivity, method=args.method, name=name,
                                  symmetric=args.symmetric, edge_min_bits=args.edge_min_bits or None,
                                  max_delta=args.max_delta or None, progress=not args.json,
                                  measure=[alloc._candidate_key(x) for x in args.measure.split(",")]
                                  if args.measure else None, base=base, reference=args.reference,
                                  first_order=args.first_order, grad_windows=grad_windows)
    info["seconds"] = time.perf_counter() - t0
    group = f"g{args.group_size}" if args.group_size else "per-channel"
    nll = (f" around uniform {info['reference']}, first-order weight {args.first_order:g}, gradient on "
           f"{args.grad_samples} x {args.grad_seq_len} tokens" if args.sensitivity == "nll" else "")
    header = [f"{name}: per-layer widths from `llmeq allocate {args.model}` ({args.sensitivity} sensitivity{nll}, "
              f"{args.solver} solver" + (f", built on {base.name}" if base is not None else "") + ")",
              f"budget {info['budget_bytes']} bytes of block linears; used {info['bytes']} "
              f"({info['avg_bits']:.3f} stored bits/weight, scales counted); widths {info['widths']} ({group})",
              f"calibration: {args.calib_samples} x {args.calib_seq_len} tokens of {text.name}; "
              f"{info['seconds']:.0f} s"]
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(alloc.recipe_yaml(recipe, header))
    os.replace(tmp, out)  # never a half-written recipe under the final name
    summary = {k: info[k] for k in ("budget_bytes", "bytes", "avg_bits", "widths", "solver", "sensitivity",
                                    "seconds")}
    _emit(args, {"out": str(out), **summary},
          f"wrote {out}: {info['avg_bits']:.3f} bits/weight ({info['bytes']} of {info['budget_bytes']} bytes), "
          f"widths {info['widths']}, {info['seconds']:.0f} s")
    return 0


def cmd_qat(args) -> int:
    """Quantization-aware training (fake quant + STE, optax), then the recipe's quantization and a checkpoint."""
    from llmeq_jax import checkpoint, evaluate
    from llmeq_jax.methods import qat

    out = Path(args.out)
    check_writable_dir(out, args.overwrite)
    recipe = read_recipe(args.recipe)
    if args.learn_scales and args.resume:
        raise UsageError("--resume continues QAT of float weights; --learn-scales runs keep no training state yet "
                         "(drop --resume, or --learn-scales)")
    try:
        opts = qat.QATOptions(steps=args.steps, lr=args.lr, batch_size=args.batch_size, save_every=args.save_every)
    except ValueError as e:
        raise UsageError(str(e)) from None
    text = find_data_file(args.text, CALIB_TEXT, "training text")
    config, params, tokenizer, loaded = open_model(args.model, verify=args.verify)
    if loaded is not None:
        raise UsageError(f"MODEL {args.model!r} is an already quantized checkpoint; QAT starts from the float model")
    check_context(config, args.seq_len)
    windows = evaluate.make_windows(evaluate.tokenize_text(tokenizer, text.read_text()), args.seq_len, 0)
    state_dir = out.with_name(out.name + ".qat-state")
    if args.learn_scales:  # LSQ: quantize first, then train the scales and latent weights of that grid
        from llmeq_jax.methods import distill

        qparams, q_s, c_s, n = run_recipe(config, params, tokenizer, recipe, args.calib, args.calib_samples,
                                          not args.json, args.calib_seq_len)
        t0 = time.perf_counter()
        dopts = distill.DistillOptions(steps=args.steps, learn="both", loss=args.loss, scale_lr=args.scale_lr,
                                       weight_lr=args.lr, batch_size=args.batch_size)
        qparams, losses, _ = distill.train(config, qparams, params, windows, dopts, progress=not args.json)
        train_s = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        trained, losses = qat.train(config, params, recipe, windows, opts, state_dir=state_dir, resume=args.resume,
                                    progress=not args.json, distill=args.loss == "kl")
        train_s = time.perf_counter() - t0
        qparams, q_s, c_s, n = run_recipe(config, trained, tokenizer, recipe, args.calib, args.calib_samples,
                                          not args.json, args.calib_seq_len)
    checkpoint.save_model_checkpoint(out, config, qparams, tokenizer, recipe=recipe, overwrite=args.overwrite,
                                     extra={"source": args.model, "qat_steps": opts.steps, "qat_lr": opts.lr,
                                            "qat_loss": args.loss, "qat_learn_scales": args.learn_scales,
                                            "qat_s": train_s, "quantize_s": q_s})
    info = {"out": str(out), "recipe": recipe.name, "steps": opts.steps, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "qat_s": train_s, "loss": args.loss,
            "learn_scales": args.learn_scales, "state_dir": None if args.learn_scales else str(state_dir)}
    _emit(args, info, f"saved QAT {recipe.name} checkpoint to {out} after {opts.steps} steps "
                      f"(loss {info['first_loss']:.4f} -> {info['last_loss']:.4f}, {train_s:.0f} s)")
    return 0


def cmd_main(args) -> int:
    """The README's main job: compare the ready recipes on the default real model."""
    args.recipes = [str(recipe_path(r)) for r in MAIN_RECIPES]
    return cmd_compare(args)


# --------------------------------------------------------------------------- plumbing


def _log(args, msg: str) -> None:
    if not getattr(args, "json", False):
        print(msg, file=sys.stderr, flush=True)


def _emit(args, info: dict, text: str) -> None:
    print(json.dumps(info) if args.json else text)


def _add_eval_opts(p, windows_default: int = 64):
    p.add_argument("--text", help=f"evaluation text file (default: {EVAL_TEXT} from $LLMEQ_DATA or ../shared/data)")
    p.add_argument("--seq-len", type=SEQ_LEN, default=512,
                   help="tokens per window, 2 .. the model's context (default 512)")
    p.add_argument("--windows", type=NON_NEGATIVE, default=windows_default,
                   help=f"windows to evaluate, 0 = all (default {windows_default})")
    p.add_argument("--batch-size", type=POSITIVE, default=4, help="windows per forward pass, >= 1 (default 4)")
    _add_scan_opt(p)


def _add_scan_opt(p):
    p.add_argument("--scan-layers", action="store_true",
                   help="run the decoder blocks as one lax.scan over stacked layer params: compiles one block "
                        "instead of every layer (big models, GPUs); on CPU decode runs slower (docs/models.md); "
                        "a model whose blocks differ (mixed bit widths) runs unrolled with a warning")


def _add_calib_opts(p):
    p.add_argument("--calib", help=f"calibration text (default: {CALIB_TEXT}); used by calibrated recipes only")
    p.add_argument("--calib-samples", type=POSITIVE, default=16, help="calibration sequences, >= 1 (default 16)")
    p.add_argument("--calib-seq-len", type=SEQ_LEN, default=512,
                   help="tokens per calibration sequence, >= 2, at most the model's context (default 512)")


def _add_kv_opts(p, budget: bool = False):
    p.add_argument("--kv", help="quantized KV cache: int8|int4|int2 (keys per channel pre-RoPE, values per token, "
                                "first 4 tokens in float), or a recipe with a 'kv:' mapping (e.g. kv4-w32); "
                                "default: the checkpoint's, else float")
    if budget:
        p.add_argument("--kv-budget-gb", type=BUDGET_GB, default=1.0,
                       help="memory budget for the reported longest context (GiB, default 1)")


def _add_xla_opt(p, default=False):
    # Also on every subcommand (`llmeq eval MODEL --xla`); there the default is SUPPRESS, so an
    # absent flag leaves the top-level value alone instead of resetting it.
    p.add_argument("--xla", action="store_true", default=default,
                   help="run everything through XLA: no Pallas kernels, even on a GPU")


def _add_keep_opt(p):
    p.add_argument("--keep-quantized", action="store_true",
                   help="a GGUF MODEL's linear weights in Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K blocks "
                        "stay quantized (the file's integers and scales) instead of being dequantized to float")


def _add_dtype_opt(p):
    p.add_argument("--dtype", choices=LOAD_DTYPES,
                   help="the float dtype an HF directory, GGUF file or registry name MODEL loads in (default "
                        "float32); bfloat16 halves the float weights' memory and is what GPUs run fast, and the "
                        "activations follow it. A checkpoint loads in the dtypes it was saved with")


def _add_verify_opt(p):
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check a checkpoint MODEL against its sha256 hashes before loading it")


def _add_checkpoint_out_opts(p):
    """--out, --overwrite, --no-verify and --json of the commands that write a checkpoint directory."""
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it exists and is an llmeq_jax checkpoint (never other directories)")
    _add_verify_opt(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary, no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmeq",
        description="Quantize LLMs in JAX: MODEL is a registry name (smollm2-135m), a Hugging Face directory, "
                    "a GGUF file, or a checkpoint directory written by `llmeq quantize`.",
    )
    _add_xla_opt(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("quantize", help="quantize MODEL with a recipe and save an Orbax checkpoint")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--recipe", required=True, help="recipe YAML (path, or a shipped recipe name, e.g. rtn-w8)")
    _add_calib_opts(p)
    _add_kv_opts(p)
    _add_checkpoint_out_opts(p)
    _add_dtype_opt(p)
    p.set_defaults(fn=cmd_quantize)

    p = sub.add_parser("eval", help="perplexity (and optionally speed) of MODEL on a text")
    p.add_argument("model", help=MODEL_HELP)
    _add_eval_opts(p)
    _add_kv_opts(p, budget=True)
    p.add_argument("--calib", help=f"calibration text for KV key ranges (default: {CALIB_TEXT})")
    p.add_argument("--speed", action="store_true", help="also measure prefill and decode tokens/s")
    _add_keep_opt(p)
    _add_verify_opt(p)
    _add_dtype_opt(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON, no progress bars")
    p.set_defaults(fn=cmd_eval)

    for name, fn, helptext in (
        ("compare", cmd_compare, "quantize MODEL with several recipes; table, JSON report and plots"),
        ("main", cmd_main, f"the main job: compare the ready recipes {', '.join(MAIN_RECIPES)} on smollm2-135m"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        if name == "compare":
            p.add_argument("model", help=MODEL_HELP)
            p.add_argument("--recipes", nargs="+", required=True,
                           help="recipe YAML files (or shipped recipe names, e.g. rtn-w8); the Δ%% and size columns compare with "
                                "the first (list fp32 first for the float baseline)")
        else:
            p.add_argument("model", nargs="?", default="smollm2-135m", help=MODEL_HELP + " (default smollm2-135m)")
        _add_eval_opts(p, windows_default=64 if name == "compare" else 16)
        _add_calib_opts(p)
        p.add_argument("--extra-text", nargs="+", default=[], metavar="TEXT",
                       help="more evaluation texts, a perplexity column each (same windows and seq-len): files, "
                            f"or {HELD_OUT_TEXT!r}, a held-out text of another domain built from this Python's "
                            "documentation (no file needed)")
        p.add_argument("--out-dir", default=f"runs/{name}", help="where report.json/.md and the plots go")
        p.add_argument("--no-speed", dest="speed", action="store_false", help="skip the tokens/s measurements")
        p.add_argument("--keep-checkpoints", action="store_true",
                       help="keep each recipe's checkpoint in --out-dir (as ckpt-<recipe name>)")
        _add_verify_opt(p)
        _add_dtype_opt(p)
        p.add_argument("--json", action="store_true", help="print the report as JSON, no progress bars")
        p.set_defaults(fn=fn)

    p = sub.add_parser("generate", help="continue a prompt with MODEL")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="the text to continue (printed, then the continuation)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=64, help=">= 1 (default 64)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    mode.add_argument("--temperature", type=TEMPERATURE,
                      help="sample with this finite temperature > 0; 0 means greedy")
    p.add_argument("--top-k", type=NON_NEGATIVE, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus sampling mass in (0, 1] (1.0 = off)")
    p.add_argument("--seed", type=_seed, default=0, help=f"sampling seed in [0, {SEED_MAX}] (default 0)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (then --prompt must not be empty)")
    p.add_argument("--prompt-activation-bits", type=int, choices=(16, 8), default=16,
                   help="activations of the prompt's weight-only products on AVX-512 VNNI CPUs: 16 (default, the "
                        "decode steps' int16) or 8 (int8 as llama.cpp: a faster first token, a little accuracy)")
    _add_scan_opt(p)
    _add_keep_opt(p)
    _add_verify_opt(p)
    _add_dtype_opt(p)
    _add_kv_opts(p)
    p.add_argument("--calib", help=f"calibration text for KV key ranges (default: {CALIB_TEXT})")
    p.add_argument("--json", action="store_true", help="print the prompt, new token ids and text as JSON")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("convert", help="HF directory or GGUF -> Orbax checkpoint (float, or quantized with --recipe)")
    p.add_argument("src", help="Hugging Face directory, .gguf file or registry name to read")
    p.add_argument("dst", help="checkpoint directory to write")
    p.add_argument("--recipe", help="quantize with this recipe while converting")
    _add_keep_opt(p)
    _add_calib_opts(p)
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it exists and is an llmeq_jax checkpoint (never other directories)")
    _add_verify_opt(p)
    _add_dtype_opt(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("export", help="write a checkpoint as GGUF (llama.cpp), compressed-tensors (vLLM, transformers) "
                                      "or ONNX (onnxruntime)")
    p.add_argument("ckpt", help="checkpoint directory from `llmeq quantize` / `llmeq convert`")
    p.add_argument("--format", required=True, choices=["gguf", "compressed-tensors", "onnx"])
    p.add_argument("--out", required=True, help="file (gguf, onnx) or directory (compressed-tensors) to write")
    p.add_argument("--source", help="the model the checkpoint came from (GGUF: a .gguf source's tokenizer and "
                                    "metadata are copied, else the checkpoint's own tokenizer is written); default: "
                                    "the source recorded in the checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("allocate", help="per-layer bit widths under a size budget -> a recipe YAML")
    p.add_argument("model")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bits", type=_finite_float(0.0, 64.0, "average stored bits per weight in (0, 64]",
                                                            low_open=True),
                        help="average stored bits per block-linear weight, scales counted (4.25 = int4 g128)")
    budget.add_argument("--budget-mb", type=_finite_float(0.0, None, "megabytes > 0", low_open=True),
                        help="bytes (1e6) of the block linears as stored")
    p.add_argument("--candidates", default="2,3,4,8",
                   help="widths to choose from (default 2,3,4,8); B = B bits at --group-size, BgG = B bits in groups "
                        "of G, Bc = B bits per output channel (e.g. 2,4c,4g256,4,4g64,8c)")
    p.add_argument("--measure", default="",
                   help="measured sensitivity: the candidates whose output KL is measured (default: one per "
                        "pickable width below the widest); the others are carried by the proxy's ratio")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--method", default="rtn", choices=["rtn", "gptq"],
                      help="the written recipe's method, with the settings of the ready {method}-w4-g128 recipe")
    base.add_argument("--base", metavar="RECIPE",
                      help="build on a ready recipe (name or YAML): its method and settings, rotation, fine-tuning "
                           "step and embedding/head rules, with per-linear widths (e.g. quarot-gptq-w3-g128-distill; "
                           "a rotated recipe's sensitivities are measured on the rotated model)")
    p.add_argument("--solver", default="greedy", choices=["greedy", "lagrange"])
    p.add_argument("--sensitivity", default="measured", choices=["measured", "proxy", "nll"],
                   help="measured: KL to the float model of each linear alone quantized; proxy: Hessian diagonal x "
                        "weight noise; nll: the calibration NLL's change of each linear's move from a uniform "
                        "reference width, to second order (KL + weighted first-order term)")
    p.add_argument("--reference", type=_candidate_arg,
                   help="nll: the uniform width the changes are taken around (default: the candidate whose uniform "
                        "size is the largest within the budget)")
    p.add_argument("--first-order", type=_finite_float(0.0, None, "a weight >= 0"), default=0.5,
                   help="nll: weight of the calibration text's first-order term (default 0.5; 1: the NLL's own "
                        "second-order model, which on SmolLM2 bought WikiText NLL with loss on other text)")
    p.add_argument("--grad-samples", type=POSITIVE, default=16,
                   help="nll: windows of the calibration text the NLL gradient is taken on (default 16)")
    p.add_argument("--grad-seq-len", type=SEQ_LEN, default=512, help="nll: tokens per gradient window (default 512)")
    p.add_argument("--group-size", type=NON_NEGATIVE, default=128, help="group size along the input (0: per channel)")
    p.add_argument("--symmetric", action="store_true",
                   help="symmetric candidate grids (default: asymmetric, integer zero point per group)")
    p.add_argument("--edge-min-bits", type=NON_NEGATIVE, default=4,
                   help="first and last blocks' linears never below this width (default 4; 0: no floor)")
    p.add_argument("--max-delta", type=_finite_float(0.0, None, "nats >= 0"), default=0.5,
                   help="measured and nll: a width whose own loss increase exceeds this many nats is never "
                        "picked for that linear (default 0.5; 0: off)")
    p.add_argument("--calib", help=f"calibration text (default: {CALIB_TEXT})")
    p.add_argument("--calib-samples", type=POSITIVE, default=4, help="calibration sequences (default 4)")
    p.add_argument("--calib-seq-len", type=SEQ_LEN, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--name", help="recipe name (default: the --out file's stem)")
    p.add_argument("--out", required=True, help="recipe YAML to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    _add_verify_opt(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary, no progress bars")
    p.set_defaults(fn=cmd_allocate)

    p = sub.add_parser("qat", help="quantization-aware training (fake quant, STE, optax) -> quantized checkpoint")
    p.add_argument("model")
    p.add_argument("--recipe", required=True, help="recipe YAML (path, or a shipped recipe name, e.g. rtn-w8)")
    p.add_argument("--text", help=f"training text (default: {CALIB_TEXT}; never the evaluation text)")
    p.add_argument("--steps", type=POSITIVE, default=100, help="optimizer steps, >= 1 (default 100)")
    p.add_argument("--lr", type=_finite_float(0.0, None, "a learning rate > 0", low_open=True), default=1e-5)
    p.add_argument("--batch-size", type=POSITIVE, default=4, help="windows per step (default 4)")
    p.add_argument("--seq-len", type=SEQ_LEN, default=256, help="tokens per training window (default 256)")
    p.add_argument("--save-every", type=POSITIVE, default=50, help="write the training state every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT.qat-state/ if a saved state is there")
    p.add_argument("--loss", choices=("nll", "kl"), default="nll",
                   help="nll: next-token loss of the text; kl: divergence from the float model's predictions "
                        "(distillation: less fit to the training text's domain)")
    p.add_argument("--learn-scales", action="store_true",
                   help="LSQ: quantize with the recipe first, then train its scales (--scale-lr) and latent "
                        "weights (--lr) through the fixed grid")
    p.add_argument("--scale-lr", type=_finite_float(0.0, None, "a learning rate > 0", low_open=True), default=1e-3,
                   help="Adam step of the log scale multipliers with --learn-scales (default 1e-3)")
    _add_calib_opts(p)
    _add_checkpoint_out_opts(p)
    p.set_defaults(fn=cmd_qat)

    p = sub.add_parser("inspect", help="list a checkpoint's leaves: bits, granularity, bytes")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--verify", action="store_true",
                   help="hash every file and compare with the sha256 written at save (default: sizes only)")
    p.add_argument("--json", action="store_true", help="print the leaves as JSON")
    p.set_defaults(fn=cmd_inspect)
    for command in sub.choices.values():
        _add_xla_opt(command, default=argparse.SUPPRESS)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"llmeq: warning: {message}\n"


def one_line(e: BaseException) -> str:
    """An exception as one line: our own errors as they are, others with their type named."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(text) > 400:
        text = text[:400] + " ..."
    if isinstance(e, UsageError) or (text and type(e).__module__.startswith("llmeq_jax")):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _fail(command: str | None, e: BaseException) -> int:
    if os.environ.get("LLMEQ_DEBUG") == "1":
        traceback.print_exc()
    print(f"llmeq{' ' + command if command else ''}: error: {one_line(e)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _fail(None, e)
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
    import warnings

    warnings.formatwarning = _one_line_warning  # the CLI's own output: one line per warning, no source echo
    if getattr(args, "json", False):
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        if args.xla:
            from pallas_kernels import config as kernel_config

            with kernel_config.disabled():
                return args.fn(args)
        return args.fn(args)
    except KeyboardInterrupt:
        print("llmeq: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- the contract: one line and status 2, never a traceback
        return _fail(args.command, e)


if __name__ == "__main__":
    sys.exit(main())
