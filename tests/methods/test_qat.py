"""QAT on stories260K: the STE forward is the quantized grid, training lowers the loss, resume is exact, CLI saves."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmeq_jax.core.quantize import quantize_dequantize
from llmeq_jax.pipeline import read_recipe
from llmeq_jax.methods import qat
from tests.shared_data import shared_data_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stories():
    from llmeq_jax import evaluate
    from llmeq_jax.models import load_model

    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    ids = evaluate.tokenize_text(tok, "Once upon a time, there was a little girl named Lily. " * 40)
    return config, params, evaluate.make_windows(ids, 32, 4), read_recipe("gptq-w3-g128")


def test_fake_quant_tree_is_the_rtn_grid(stories):
    config, params, _, recipe = stories
    fq = qat.fake_quant_tree(params, recipe)
    w = params["layers_0"]["attn"]["q_proj"]["kernel"]
    spec = recipe.rule_for("layers_0/attn/q_proj/kernel").weight
    np.testing.assert_array_equal(np.asarray(fq["layers_0"]["attn"]["q_proj"]["kernel"]),
                                  np.asarray(quantize_dequantize(w, spec)))
    np.testing.assert_array_equal(np.asarray(fq["embed"]["embedding"]), np.asarray(params["embed"]["embedding"]))


def test_training_lowers_the_loss_and_resume_is_exact(stories, tmp_path):
    config, params, wins, recipe = stories
    cfg = qat.QATOptions(steps=4, lr=1e-3, batch_size=2, save_every=2)
    _, straight = qat.train(config, params, recipe, wins, cfg)
    assert straight[-1] < straight[0]
    qat.train(config, params, recipe, wins, qat.QATOptions(steps=2, lr=1e-3, batch_size=2, save_every=2),
              state_dir=tmp_path)
    assert qat.load_state(tmp_path)["step"] == 2
    _, resumed = qat.train(config, params, recipe, wins, cfg, state_dir=tmp_path, resume=True)
    np.testing.assert_allclose(resumed, straight, rtol=1e-5)


def test_cli_qat_saves_a_quantized_checkpoint(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 30)
    proc = subprocess.run([sys.executable, "-m", "llmeq_jax.cli", "qat", str(shared_data_path("stories260K.gguf")),
                           "--recipe", "rtn-w4-g128", "--text", str(text), "--steps", "2", "--seq-len", "32",
                           "--batch-size", "2", "--lr", "1e-3", "--out", str(tmp_path / "ck"), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["steps"] == 2 and np.isfinite(info["last_loss"])
    from llmeq_jax import checkpoint
    from llmeq_jax.core.qarray import QArray

    _, qp, _, recipe = checkpoint.load_model_checkpoint(tmp_path / "ck")
    assert isinstance(qp["layers_0"]["attn"]["q_proj"]["kernel"], QArray) and recipe["name"] == "rtn-w4-g128"
    assert (tmp_path / "ck.qat-state" / qat.STATE_FILE).is_file()


def test_bad_qat_settings_are_named():
    with pytest.raises(ValueError, match="learning rate"):
        qat.QATOptions(lr=float("nan"))


def test_rtn_w3_g128_recipe_is_asymmetric_int3_groups_of_128(stories):
    """The W3 baseline QAT is measured against (`rtn-w3-g128`): rtn-w4-g128 with 3-bit values."""
    from llmeq_jax import methods
    from llmeq_jax.core.qarray import QArray

    config, params, _, _ = stories
    recipe = read_recipe("rtn-w3-g128")
    assert recipe.name == "rtn-w3-g128" and recipe.method == "rtn"
    q, _ = methods.quantize_model(config, params, recipe, None)
    k = q["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(k, QArray) and k.bits == 3 and k.tile[0] == 128 and not k.symmetric
    w = np.asarray(params["layers_0"]["mlp"]["down_proj"]["kernel"])
    err3 = np.abs(np.asarray(k.dequantize()) - w).mean()
    k4 = methods.quantize_model(config, params, read_recipe("rtn-w4-g128"), None)[0]["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert err3 > np.abs(np.asarray(k4.dequantize()) - w).mean() > 0


def test_distilled_qat_starts_at_zero_kl_and_the_teacher_stays(stories):
    config, params, wins, recipe = stories
    fp32 = read_recipe("fp32")
    cfg = qat.QATOptions(steps=2, lr=1e-3, batch_size=2, save_every=2)
    _, losses = qat.train(config, params, fp32, wins, cfg, distill=True)
    assert abs(losses[0]) < 1e-5 and losses[1] > 1e-7  # the float model is its own teacher, then moves away
    _, w3 = qat.train(config, params, recipe, wins, qat.QATOptions(steps=3, lr=1e-4, batch_size=2), distill=True)
    assert w3[0] > 1e-3 and w3[2] < w3[0]  # steps 0 and 2 see the same batch


@pytest.mark.parametrize("loss", ["kl", "nll"])
def test_cli_qat_learn_scales_saves_the_method_grid(tmp_path, loss):
    from llmeq_jax.checkpoint import load_model_checkpoint

    text = tmp_path / "train.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 30)
    proc = subprocess.run([sys.executable, "-m", "llmeq_jax.cli", "qat", str(shared_data_path("stories260K.gguf")),
                           "--recipe", "rtn-w4-g128", "--text", str(text), "--steps", "2", "--seq-len", "32",
                           "--batch-size", "2", "--learn-scales", "--loss", loss, "--out", str(tmp_path / "ck"),
                           "--json"], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["learn_scales"] and info["loss"] == loss and info["state_dir"] is None
    _, qp, _, rec = load_model_checkpoint(tmp_path / "ck")
    q = qp["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.bits == 4 and q.zero_point is not None and rec["name"] == "rtn-w4-g128"


def test_cli_qat_learn_scales_refuses_resume(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llmeq_jax.cli", "qat", str(shared_data_path("stories260K.gguf")),
                           "--recipe", "rtn-w4-g128", "--learn-scales", "--resume", "--out", str(tmp_path / "ck")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and "--resume" in proc.stderr and "--learn-scales" in proc.stderr
    assert not (tmp_path / "ck").exists()
