"""Accuracy of the low-bit recipes on WikiText-2 test and the held-out text, in one process (docs/accuracy.md).

Loads the model once, quantizes it with each recipe (calibration: the first
``--calib-samples`` windows of 512 tokens of wikitext2_valid.txt), and evaluates
perplexity (DESIGN §6) on the first ``--windows`` windows of 512 tokens of
WikiText-2 test and of the held-out text (``llmeq_jax.texts.pydoc_topics_text``).
``--texts tune`` evaluates on the last quarter of wikitext2_valid.txt instead (the
text choices are tuned on). Prints one markdown row per recipe as soon as it is done, so a long run shows
progress; ``llmeq compare`` gives the same numbers one text at a time.

    PYTHONPATH=. python scripts/bench_accuracy.py smollm2-135m --windows 64 \\
        --recipes fp32 rtn-w4-g128-sym rtn-w4-g128 gptq-w4-g128 awq-w4-g128 autoround-w4-g128
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from llmeq_jax import calibrate, evaluate, methods, texts
from llmeq_jax.data import find_data_file
from llmeq_jax.pipeline import finetune_windows, open_model, read_recipe
from llmeq_jax.models import forward


def _tune_text() -> str:
    s = find_data_file(None, "wikitext2_valid.txt", "calibration text").read_text()
    t = s[int(len(s) * 0.75):]
    return t[t.index(chr(10)) + 1:]


TEXTS = {"wikitext2-test": lambda: find_data_file(None, "wikitext2_test.txt", "evaluation text").read_text(),
         "pydoc-topics": texts.pydoc_topics_text, "tune": _tune_text}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--recipes", nargs="+", required=True)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--texts", nargs="+", default=["wikitext2-test", "pydoc-topics"], choices=list(TEXTS),
                    help="evaluation texts; 'tune' is the last quarter of wikitext2_valid.txt (for tuning choices: "
                         "it does not overlap the calibration windows, the first ones of the same file)")
    ap.add_argument("--text-file", nargs="*", default=[], type=Path,
                    help="more evaluation texts (plain text files), named by their file stem")
    a = ap.parse_args()
    config, params, tok, _ = open_model(a.model, verify=False)
    corpora = {k: TEXTS[k]() for k in a.texts} | {f.stem: f.read_text() for f in a.text_file}
    wins = {k: evaluate.make_windows(evaluate.tokenize_text(tok, t), a.seq_len, a.windows) for k, t in corpora.items()}
    valid = find_data_file(None, "wikitext2_valid.txt", "calibration text")
    calib = calibrate.calibration_windows(tok, valid, a.calib_samples, a.seq_len)
    base = {}
    print(f"| recipe | {' | '.join(f'{k} ppl | Δ%' for k in wins)} | quantize s |", flush=True)
    for name in a.recipes:
        recipe = read_recipe(name)
        t0 = time.perf_counter()
        q, info = methods.quantize_model(config, params, recipe, calib if methods.needs_calibration(recipe) else None,
                                         finetune_windows=finetune_windows(config, tok, recipe, valid))
        q_s = time.perf_counter() - t0
        cells = []
        for k, w in wins.items():
            ppl = evaluate.perplexity(lambda p, t: forward(config, p, t), w, batch_size=4, params=q)["ppl"]
            base.setdefault(k, ppl)
            cells.append(f"{ppl:.3f} | {100 * (ppl / base[k] - 1):+.2f}")
        extra = {k: v for k, v in info.items() if k in ("autoround", "rotate_s")}
        print(f"| {name} | {' | '.join(cells)} | {q_s:.1f} |", extra or "", flush=True)


if __name__ == "__main__":
    main()
