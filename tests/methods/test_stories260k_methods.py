"""Every calibrated recipe in llmeq_jax/configs/ on the real stories260K model: finite perplexity, sensible order, CLI rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from llmeq_jax import calibrate, evaluate, methods
from llmeq_jax.pipeline import read_recipe
from llmeq_jax.core.qarray import QArray, tree_nbytes
from llmeq_jax.models import forward, load_model
from tests.shared_data import shared_data_path

RECIPES = ("fp32", "rtn-w4-g128", "gptq-w4-g128", "awq-w4-g128", "rtn-w4-g128-sym", "gptq-w4-g128-sym",
           "awq-w4-g128-sym", "rtn-w8a8-static", "smoothquant-w8a8",
           "smoothquant-w8a8-dynamic", "smoothquant-w8a8-mixed", "zeroquant-w8a8-g128")


@pytest.fixture(scope="module")
def results():
    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    windows = calibrate.calibration_windows(tok, shared_data_path("wikitext2_valid.txt"), 8, 128)
    ids = evaluate.tokenize_text(tok, shared_data_path("wikitext2_test.txt").read_text())
    ev = evaluate.make_windows(ids, 128, 8)
    def ppl(q):  # params as an argument of the jitted step, not closure constants (XLA would constant-fold them)
        return evaluate.perplexity(lambda p, t: forward(config, p, t), ev, batch_size=4, params=q)["ppl"]

    out = {}
    for name in RECIPES:
        q, info = methods.quantize_model(config, params, read_recipe(name), windows)
        out[name] = {"ppl": ppl(q), "bytes": tree_nbytes(q), "info": info, "params": q}
    # The float model with the recipes' int8 head (every recipe rounds the untied head the same way): the
    # reference for what the block kernels' quantization costs.
    head = out["rtn-w4-g128-sym"]["params"]["lm_head"]
    assert isinstance(head["kernel"], QArray) and head["kernel"].bits == 8
    out["fp32+int8 head"] = {"ppl": ppl({**params, "lm_head": head})}
    return out


def test_perplexities_are_finite_and_ordered(results):
    ppl = {k: v["ppl"] for k, v in results.items()}
    assert all(math.isfinite(p) and p > 1 for p in ppl.values()), ppl
    # The head's int8 rounding alone: small (measured +0.15 %), the same in every recipe.
    assert abs(ppl["fp32+int8 head"] / ppl["fp32"] - 1) < 0.01, ppl
    fp = ppl["fp32+int8 head"]
    # Symmetric grids: calibrated W4 beats RTN W4 by a clear part of RTN's degradation (of the block kernels).
    for m in ("gptq-w4-g128-sym", "awq-w4-g128-sym"):
        assert ppl[m] - fp < 0.5 * (ppl["rtn-w4-g128-sym"] - fp), ppl
    # The asymmetric default removes most of symmetric RTN's loss. (On this model and text, an
    # out-of-domain pair for a TinyStories model, asymmetric RTN lands at fp32's perplexity and
    # asymmetric GPTQ/AWQ do not beat it -- measured 183.1 vs GPTQ 200.9, AWQ 189.9, fp32 183.9 --
    # so no order between them is asserted here; docs/accuracy.md has SmolLM2's.)
    assert ppl["rtn-w4-g128"] - fp < 0.5 * (ppl["rtn-w4-g128-sym"] - fp), ppl
    # Smoothing repairs static per-tensor W8A8.
    assert ppl["smoothquant-w8a8"] < ppl["rtn-w8a8-static"], ppl
    for m in ("smoothquant-w8a8", "smoothquant-w8a8-dynamic", "smoothquant-w8a8-mixed", "zeroquant-w8a8-g128"):
        assert ppl[m] < 1.02 * fp, ppl


def test_quantized_trees_hold_qarrays_of_the_recipe(results):
    k = results["gptq-w4-g128"]["params"]["layers_2"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k, QArray) and k.bits == 4 and k.tile[0] == 128 and k.act_spec is None
    s = results["smoothquant-w8a8"]["params"]["layers_0"]["attn"]["o_proj"]["kernel"]
    assert s.bits == 8 and s.act_scale is not None
    mixed = results["smoothquant-w8a8-mixed"]["params"]["layers_0"]
    down, up = mixed["mlp"]["down_proj"]["kernel"], mixed["mlp"]["up_proj"]["kernel"]
    assert down.act_scale is None and down.act_spec.granularity == "token"  # dynamic per token
    assert up.act_scale is not None and up.act_spec.granularity == "tensor"  # static
    assert results["gptq-w4-g128"]["bytes"] < 0.5 * results["fp32"]["bytes"]
    assert results["gptq-w4-g128"]["info"]["calib_samples"] == 8


def test_cli_compare_runs_calibrated_recipes(tmp_path):
    # Short calibration windows: stories260K (trained on short stories) has atypical activations at far
    # positions of WikiText; Hessians from 512-token windows are dominated by them and GPTQ then loses to
    # RTN on this model (measured: 2 x 512 -> ppl 237 vs 8 x 128 of the same tokens -> 214, RTN 226).
    # Symmetric recipes: that is where the claim was measured (asymmetric RTN is already at fp32 here).
    env = {**os.environ, "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "llmeq_jax.cli", "compare", str(shared_data_path("stories260K.gguf")), "--recipes",
           "rtn-w4-g128-sym", "gptq-w4-g128-sym", "--text", str(shared_data_path("wikitext2_test.txt")), "--calib",
           str(shared_data_path("wikitext2_valid.txt")), "--calib-samples", "8", "--calib-seq-len", "128",
           "--seq-len", "128", "--windows", "4", "--no-speed", "--out-dir", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {r["recipe"]: r for r in json.loads(proc.stdout)["rows"]}
    assert rows["gptq-w4-g128-sym"]["calib_samples"] == 8 and rows["rtn-w4-g128-sym"]["calib_samples"] == 0
    assert rows["gptq-w4-g128-sym"]["ppl"] < rows["rtn-w4-g128-sym"]["ppl"]
    assert rows["gptq-w4-g128-sym"]["quantize_s"] > 0


def test_cli_reports_recipe_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmethod: gptq\nmethod_args: {damp: 0.01}\nrules:\n"
                   "  - pattern: '.*/kernel'\n    weight: {bits: 4, granularity: group, group_size: 32}\n")
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "llmeq_jax.cli", "quantize", str(shared_data_path("stories260K.gguf")),
                           "--recipe", str(bad), "--calib", str(shared_data_path("wikitext2_valid.txt")),
                           "--calib-samples", "1", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2
    assert "lm_head" in proc.stderr and "skip" in proc.stderr
