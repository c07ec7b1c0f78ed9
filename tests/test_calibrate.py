"""Calibration: statistics against a dense reference, batching, sequential processing, bad input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate
from llmeq_jax.models.layers import RMSNorm
from llmeq_jax.models.model import embed
from tests.methods.tiny_models import tiny_model, tiny_windows
from tests.shared_data import shared_data_path


def _q_proj_input(config, params, windows):
    """Layer 0's q_proj input computed by hand: RMSNorm(embeddings)."""
    toks = jnp.asarray(windows)
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    h = embed(config, params, toks, pos)
    x = RMSNorm(config.norm_eps).apply({"params": params["layers_0"]["input_norm"]}, h)
    return np.asarray(x).reshape(-1, config.hidden_size).astype(np.float64)


def test_stats_match_dense_reference_across_batches():
    config, params = tiny_model("qwen2")
    windows = tiny_windows(config, n=6, t=16)
    stats, out = calibrate.calibrate(config, params, windows, wants=calibrate.STATS, batch_size=4)
    assert out["layers_0"] is params["layers_0"]
    s = stats["layers_0/attn/q_proj/kernel"]
    x = _q_proj_input(config, params, windows)
    np.testing.assert_allclose(s["absmax"], np.abs(x).max(0), rtol=1e-5)
    np.testing.assert_allclose(s["min"], x.min(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s["max"], x.max(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s["abs_sum"] / s["count"], np.abs(x).mean(0), rtol=1e-4)
    assert float(s["count"]) == 6 * 16
    np.testing.assert_allclose(s["hessian"], x.T @ x, rtol=1e-4, atol=1e-3)
    # The sample holds real input rows (from both batches when one batch has fewer than SAMPLE_TOKENS).
    sample = np.asarray(s["sample"], np.float64)
    assert sample.shape == (6 * 16, config.hidden_size)
    np.testing.assert_allclose(sample, x, rtol=1e-5, atol=1e-6)
    # Every linear of every block is there, keyed by its kernel path.
    assert len(stats) == 7 * config.num_layers and "layers_1/mlp/down_proj/kernel" in stats


def test_process_block_feeds_the_processed_block_forward():
    config, params = tiny_model("qwen2")
    windows = tiny_windows(config, n=4, t=16)

    def zero_mlp(layer, block, block_stats, inputs):
        assert set(block_stats) >= {"attn/q_proj/kernel", "mlp/down_proj/kernel"} and len(inputs) == 1
        mlp = {**block["mlp"], "down_proj": {"kernel": jnp.zeros_like(block["mlp"]["down_proj"]["kernel"])}}
        return {**block, "mlp": mlp} if layer == 0 else block

    stats, out = calibrate.calibrate(config, params, windows, wants=("absmax", "hessian"), process_block=zero_mlp,
                                     keep=("absmax",))
    assert not np.any(np.asarray(out["layers_0"]["mlp"]["down_proj"]["kernel"]))
    assert set(stats["layers_1/attn/q_proj/kernel"]) == {"absmax"}  # keep= drops the Hessians
    ref, _ = calibrate.calibrate(config, out, windows, wants=("absmax",))
    base, _ = calibrate.calibrate(config, params, windows, wants=("absmax",))
    key = "layers_1/attn/q_proj/kernel"
    np.testing.assert_allclose(stats[key]["absmax"], ref[key]["absmax"], rtol=1e-6)
    assert not np.allclose(stats[key]["absmax"], base[key]["absmax"])


def test_bad_calibration_input(tmp_path):
    from llmeq_jax.models import load_model

    _, _, tok = load_model(str(shared_data_path("stories260K.gguf")))
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a cat. " * 20)
    with pytest.raises(calibrate.CalibrationError, match=r"short.txt has \d+ tokens = \d+ samples of 512; 16 were"):
        calibrate.calibration_windows(tok, short, 16, 512)
    with pytest.raises(calibrate.CalibrationError, match="does not exist"):
        calibrate.calibration_windows(tok, tmp_path / "missing.txt", 1, 16)
    with pytest.raises(calibrate.CalibrationError, match="at least one sample"):
        calibrate.calibration_windows(tok, short, 0, 16)
    with pytest.raises(calibrate.CalibrationError, match="unknown statistic"):
        calibrate.input_stats(jnp.ones((2, 3)), ("median",))
