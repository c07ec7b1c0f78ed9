"""`llmeq ... --kv`: quantized KV cache through quantize (ranges stored in the checkpoint), eval and generate."""

from __future__ import annotations

import json

import pytest

from llmeq_jax import cli, pipeline
from tests.shared_data import shared_data_path

MODEL = str(shared_data_path("stories260K.gguf"))
TEXT = str(shared_data_path("wikitext2_test.txt"))
CALIB = str(shared_data_path("wikitext2_valid.txt"))
EVAL = ["--text", TEXT, "--calib", CALIB, "--seq-len", "64", "--windows", "4", "--json"]


def run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(capsys, *args):
    code, out, err = run(capsys, "eval", *args, *EVAL)
    assert code == 0, err
    return json.loads(out)["rows"][0]


def test_longest_context_is_capped_by_the_model():
    """A 1 GiB budget holds far more than stories260K's context: report the model's limit, not the budget's."""
    from llmeq_jax.models import load_model

    config, params, tokenizer = load_model(MODEL)
    mem = pipeline.kv_memory(config, 64, None, 1.0)
    assert mem["model_max_context"] == config.max_position_embeddings
    assert mem["kv_longest_context"] == mem["float_kv_longest_context"] == config.max_position_embeddings
    tiny = pipeline.kv_memory(config, 64, None, 1e-5)  # ~10 KB: a few tokens, fewer than the model's limit
    assert 0 < tiny["kv_longest_context"] < config.max_position_embeddings


def test_eval_kv_ppl_and_bytes(capsys):
    # A 0.1 MB budget, so the longest context is set by the cache's bytes, not capped by the model's limit.
    budget = ["--kv-budget-gb", "0.0001"]
    fp, kv8, kv2 = (_row(capsys, MODEL, *extra, *budget) for extra in ([], ["--kv", "int8"], ["--kv", "int2"]))
    assert fp["extra"]["kv"] == "float32" and "int8" in kv8["extra"]["kv"] and kv8["recipe"].endswith("kv8")
    assert abs(kv8["ppl"] / fp["ppl"] - 1) < 0.01  # int8 KV costs (almost) nothing
    assert kv2["ppl"] > kv8["ppl"] * 1.01  # 2 bits does cost something
    assert kv8["extra"]["kv_bytes_per_token"] < fp["extra"]["kv_bytes_per_token"] / 3
    assert kv2["extra"]["kv_bytes_per_token"] < kv8["extra"]["kv_bytes_per_token"] / 2
    assert kv2["extra"]["kv_longest_context"] > kv8["extra"]["kv_longest_context"] > fp["extra"]["kv_longest_context"]
    assert kv2["extra"]["kv_longest_context"] < kv2["extra"]["model_max_context"]


def test_quantize_stores_kv_ranges_and_eval_uses_them(capsys, tmp_path):
    out = tmp_path / "w8kv4"
    code, _, err = run(capsys, "quantize", MODEL, "--recipe", "rtn-w8", "--kv", "kv4-w32", "--calib", CALIB,
                       "--out", str(out), "--json")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    kv = manifest["recipe"]["kv"]
    assert kv["bits"] == 4 and kv["window"] == 32
    assert [len(kv["key_ranges"]["lo"]), len(kv["key_ranges"]["lo"][0]), len(kv["key_ranges"]["lo"][0][0])] == [5, 4, 8]
    row = _row(capsys, str(out))
    assert "int4" in row["extra"]["kv"] and "32-token float window" in row["extra"]["kv"]
    code, text, err = run(capsys, "generate", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "40")
    assert code == 0 and text.startswith("Once upon a time"), err
    # 5 prompt + 8 new tokens: a 32-token float window is longer than that context.
    code, _, err = run(capsys, "generate", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "8")
    assert code == 2 and "float window (32 tokens) is longer than the context (13 tokens)" in err

    # A checkpoint whose KV key ranges do not fit the model's heads: one clear error.
    for k in ("lo", "hi"):
        kv["key_ranges"][k] = [heads[:3] for heads in kv["key_ranges"][k]]
    (out / "manifest.json").write_text(json.dumps(manifest))
    # The edited manifest no longer matches its hash: that is caught first ...
    code, _, err = run(capsys, "eval", str(out), *EVAL)
    assert code == 2 and "manifest.json does not match its sha256" in err
    # ... and without the hash check, the key ranges' shape is.
    code, _, err = run(capsys, "eval", str(out), "--no-verify", *EVAL)
    assert code == 2 and "the model needs [layers, kv_heads, head_dim] = [5, 4, 8]" in err


@pytest.mark.parametrize(
    "kv,message",
    [
        ("int3", "bits=3 is not supported; expected one of [2, 4, 8]"),
        ("fp32", "no 'kv:' mapping"),  # a recipe without a kv mapping
    ],
)
def test_bad_kv_option(capsys, kv, message):
    code, _, err = run(capsys, "eval", MODEL, "--kv", kv, *EVAL)
    assert code == 2 and message in err, err


def test_window_longer_than_eval_context(capsys, tmp_path):
    recipe = tmp_path / "kvlong.yaml"
    recipe.write_text("name: kvlong\nrules: []\nkv: {bits: 4, key_granularity: token, window: 100}\n")
    code, _, err = run(capsys, "eval", MODEL, "--kv", str(recipe), *EVAL)
    assert code == 2 and "float window (100 tokens) is longer than the context (64 tokens)" in err, err


def test_bad_bits_in_kv_recipe(capsys, tmp_path):
    recipe = tmp_path / "kv3.yaml"
    recipe.write_text("name: kv3\nrules: []\nkv: {bits: 3}\n")
    code, _, err = run(capsys, "eval", MODEL, "--kv", str(recipe), *EVAL)
    assert code == 2 and "bits=3 is not supported; expected one of [2, 4, 8]" in err, err
