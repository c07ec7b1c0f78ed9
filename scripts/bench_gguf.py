"""GGUF files as they are: our model kept quantized (``keep_quantized``) beside the same file dequantized
to float32 and, when llama-cpp-python is installed, llama.cpp running it.

    python scripts/bench_gguf.py [FILE.gguf ...] [--make Q4_K_M Q8_0 ...] [--model smollm2-135m]

Per file: bytes of the weights (ours kept / ours float), max |Δlogit| / max |logit| of kept against float on
a 128-token window of wikitext2_test.txt, perplexity (``--ppl-windows`` windows of 256 tokens) of ours kept,
ours float and llama.cpp, and prefill (128 tokens) / decode (batch 1, 32 greedy steps, ours through
``generate``: t(33) - t(1)) tokens/s, and the prompt's time to its first token (ours kept: ``generate`` of one
token, with int16 and with int8 prompt activations; llama.cpp without ``logits_all``: both compute the head on
the last position only, where the prefill column's full forwards compute every position's logits), all timers
run in turn for ``--rounds`` rounds, medians.

``--make TYPE ...`` (llama-cpp-python needed) writes the ``--model`` as a float32 GGUF and has llama.cpp's
own quantizer (``llama_model_quantize``) turn it into each llama.cpp file type (Q4_K_M, Q5_K_M, Q6_K,
Q8_0, Q4_0, ...), then benchmarks those files; with no FILE and no ``--make``, the ``--model`` file itself.
SmolLM2 is 576 wide, not a multiple of 256: llama.cpp writes most of its K-quant files in Q5_0 / Q5_1 /
Q8_0 instead; ``--random-layers N`` makes N random blocks of TinyLlama-1.1B's shapes, which it K-quantizes
throughout (their perplexity means nothing; logits, bytes and speed do).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from llmeq_jax import data
from llmeq_jax.core.qarray import tree_nbytes
from llmeq_jax.export.gguf import write_gguf
from llmeq_jax.models import gguf_loader, load_model
from llmeq_jax.models.registry import REGISTRY, resolve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import (  # noqa: E402 - the sibling script's runners, timed the same way
    has_llama_cpp, interleaved_medians, jit_forward, llama_cpp_first_token, llama_cpp_model, llama_cpp_runner,
    mean_nll, ours_first_token, ours_runner,
)


def tinyllama_shapes(config, layers: int):
    """``config`` (for its vocabulary) with TinyLlama-1.1B's blocks, ``layers`` of them, and random weights:
    widths that are multiples of 256, so llama.cpp's K-quants apply to every linear weight."""
    import dataclasses

    import jax

    from llmeq_jax.models.model import init_params

    config = dataclasses.replace(config, hidden_size=2048, intermediate_size=5632, num_layers=layers, num_heads=32,
                                 num_kv_heads=4, head_dim=64, tie_word_embeddings=False)
    return config, init_params(config, jax.random.key(0))


def make_files(model: str, types: list[str], out: Path, random_layers: int = 0) -> list[Path]:
    """``model`` (or, with ``random_layers``, :func:`tinyllama_shapes`) as float32 GGUF, then quantized by
    llama.cpp to each file type in ``types``."""
    import llama_cpp

    source = resolve(model) if model in REGISTRY else Path(model)
    config, params, _ = load_model(source)
    stem = "f32"
    if random_layers:
        config, params = tinyllama_shapes(config, random_layers)
        stem = f"tinyllama-shapes-{random_layers}l"
    f32 = write_gguf(config, params, out / f"{stem}.gguf", source=source, overwrite=True)
    del params
    files = []
    for name in types:
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        target = out / f"{stem.replace('f32', 'model')}-{name}.gguf"
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(), ctypes.byref(p)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {f32} to {name}")
        files.append(target)
    return files


def perplexity(nll_of, windows) -> float:
    return float(np.exp(np.mean([nll_of(w) for w in windows])))


def bench_file(path: Path, rounds: int, n_tokens: int, n_windows: int) -> dict:
    types = Counter(t.tensor_type.name for t in gguf_loader.open_reader(path).tensors if len(t.shape) == 2)
    config, floats, tokenizer = load_model(path)
    _, kept, _ = load_model(path, keep_quantized=True)
    text = data.find_data_file(None, data.EVAL_TEXT, "evaluation text").read_text()
    ids = tokenizer(text[:20000], add_special_tokens=False)["input_ids"][:n_tokens]
    all_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [np.asarray(all_ids[i * 256:(i + 1) * 256]) for i in range(n_windows)]
    fwd = jit_forward(config)
    a, b = fwd(kept, jnp.asarray([ids])), fwd(floats, jnp.asarray([ids]))
    row = {"file": path.name, "types": dict(types), "kept_mb": tree_nbytes(kept) / 1e6,
           "float_mb": tree_nbytes(floats) / 1e6,
           "rel_logit_diff": float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))}

    def ours_nll(params):
        return lambda w: mean_nll(fwd(params, jnp.asarray([w], jnp.int32))[0], w)

    row["ppl_kept"], row["ppl_float"] = perplexity(ours_nll(kept), windows), perplexity(ours_nll(floats), windows)
    timers = {}
    for name, params in (("kept", kept), ("float", floats)):
        timers[f"{name} prefill"], timers[f"{name} decode"] = ours_runner(config, params, ids)
    timers["kept first token"] = ours_first_token(config, kept, ids)
    timers["kept int8 first token"] = ours_first_token(config, kept, ids, prompt_activation_bits=8)
    if has_llama_cpp():
        llm = llama_cpp_model(path, 256)

        def theirs(w):
            llm.reset()
            llm.eval(list(w))
            return mean_nll(llm.scores[: len(w)], w)

        row["ppl_llama_cpp"] = perplexity(theirs, windows)
        del llm
        _, timers["llama.cpp prefill"], timers["llama.cpp decode"] = llama_cpp_runner(path, ids)
        timers["llama.cpp first token"] = llama_cpp_first_token(path, ids)
    med = interleaved_medians(timers, rounds)
    for name, seconds in med.items():
        if name.endswith("first token"):
            row[name.replace(" ", "_") + "_ms"] = 1e3 * seconds
        else:
            row[name.replace(" ", "_") + "_tok_s"] = (len(ids) if name.endswith("prefill") else 1) / seconds
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--make", nargs="+", default=[], metavar="TYPE", help="llama.cpp file types to quantize --model to")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-layers", type=int, default=0,
                    help="--make: random weights in this many TinyLlama-1.1B blocks (2048 wide, every linear weight "
                         "K-quantizable) instead of --model's weights (its vocabulary and tokenizer are kept)")
    ap.add_argument("--out", type=Path, default=Path("runs/gguf"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ppl-windows", type=int, default=8)
    args = ap.parse_args()
    files = list(args.files)
    if args.make:
        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit("--make needs llama-cpp-python (pip install llama-cpp-python)")
        args.out.mkdir(parents=True, exist_ok=True)
        files += make_files(args.model, args.make, args.out, args.random_layers)
    if not files:
        files = [resolve(args.model) if args.model in REGISTRY else Path(args.model)]
    if not has_llama_cpp():
        print("llama-cpp-python is not installed: ours only")
    rows = [bench_file(f, args.rounds, args.tokens, args.ppl_windows) for f in files]
    cpp = has_llama_cpp()
    print()
    print("| file | tensor types | weights MB kept / float | Δlogit kept vs float | ppl kept | ppl float"
          + (" | ppl llama.cpp" if cpp else "") + " | decode tok/s kept | float | kept / float"
          + (" | llama.cpp | kept / llama.cpp" if cpp else "") + " | prefill tok/s kept | float"
          + (" | llama.cpp" if cpp else "") + " | first token ms kept | int8 prompt"
          + (" | llama.cpp | kept / llama.cpp" if cpp else "") + " |")
    print("|---|---|---|---:|---:|---:|" + ("---:|" if cpp else "") + "---:|---:|---:|" + ("---:|---:|" if cpp else "")
          + "---:|---:|" + ("---:|" if cpp else "") + "---:|---:|" + ("---:|---:|" if cpp else ""))
    for r in rows:
        types = ", ".join(f"{k} {v}" for k, v in sorted(r["types"].items(), key=lambda kv: -kv[1]))
        line = (f"| {r['file']} | {types} | {r['kept_mb']:.0f} / {r['float_mb']:.0f} | {r['rel_logit_diff']:.1e} "
                f"| {r['ppl_kept']:.4f} | {r['ppl_float']:.4f} |")
        if cpp:
            line += f" {r['ppl_llama_cpp']:.4f} |"
        kd, fd = r["kept_decode_tok_s"], r["float_decode_tok_s"]
        line += f" {kd:.1f} | {fd:.1f} | {kd / fd:.2f}x |"
        if cpp:
            line += f" {r['llama.cpp_decode_tok_s']:.1f} | {kd / r['llama.cpp_decode_tok_s']:.2f}x |"
        line += f" {r['kept_prefill_tok_s']:.0f} | {r['float_prefill_tok_s']:.0f} |"
        if cpp:
            line += f" {r['llama.cpp_prefill_tok_s']:.0f} |"
        line += f" {r['kept_first_token_ms']:.1f} | {r['kept_int8_first_token_ms']:.1f} |"
        if cpp:  # (speed ratios: llama.cpp's time over ours, int16 / int8 prompt activations)
            ms = r["llama.cpp_first_token_ms"]
            line += f" {ms:.1f} | {ms / r['kept_first_token_ms']:.2f}x / {ms / r['kept_int8_first_token_ms']:.2f}x |"
        print(line)


if __name__ == "__main__":
    main()
