"""Losses of untrained models on the windows a QAT run trains on (docs/seeds-methods.md section 4).

``python scripts/qat_ref_loss.py LO HI RECIPE...``: the mean next-token loss of SmolLM2-135M
(fp32, then each recipe's fake-quantized model, no training) on QAT's training batches LO..HI-1
(``llmeq qat`` defaults: windows of 256 tokens of wikitext2_valid.txt in text order, 2 per batch),
i.e. the same windows on which a QAT run's progress bar reports its loss before updating on them.
Writes /tmp/qat/ref_LO_HI.json with the per-batch losses.
"""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import evaluate
from llmeq_jax.data import CALIB_TEXT, find_data_file
from llmeq_jax.methods import qat
from llmeq_jax.pipeline import open_model, read_recipe

SEQ_LEN, BATCH = 256, 2


def main() -> None:
    lo, hi, recipes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    config, params, tok, _ = open_model("smollm2-135m", verify=False)
    text = find_data_file(None, CALIB_TEXT, "training text").read_text()
    wins = evaluate.make_windows(evaluate.tokenize_text(tok, text), SEQ_LEN, 0)
    out = {}
    for name in ["fp32"] + recipes:
        recipe = read_recipe(name)
        loss = jax.jit(lambda p, t, recipe=recipe: qat.qat_loss(p, t, config=config, recipe=recipe))
        out[name] = [float(loss(params, jnp.asarray(wins[b * BATCH:(b + 1) * BATCH]))) for b in range(lo, hi)]
        print(name, float(np.mean(out[name])), flush=True)
    Path("/tmp/qat").mkdir(parents=True, exist_ok=True)
    Path(f"/tmp/qat/ref_{lo}_{hi}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
