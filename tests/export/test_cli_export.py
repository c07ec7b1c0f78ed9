"""`llmeq export` on stories260K checkpoints: files written, one clear error, nothing half-written."""

import json

import gguf
import pytest

from llmeq_jax import checkpoint, cli
from llmeq_jax.core.rules import quantize_params, recipe_from_dict
from llmeq_jax.models import load_model
from tests.shared_data import shared_data_path

MODEL = shared_data_path("stories260K.gguf")
INT8 = {"pattern": ".*/kernel", "weight": {"bits": 8, "granularity": "channel"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints saved as `llmeq quantize` saves them: down_proj skipped, and every kernel int8."""
    root = tmp_path_factory.mktemp("ckpts")
    config, params, tokenizer = load_model(MODEL)
    out = {}
    cases = (("skip-down", [{"pattern": ".*down_proj.*", "skip": True}, INT8], None), ("all", [INT8], None),
             ("kv8", [INT8], {"bits": 8}))
    for name, rules, kv in cases:
        recipe = recipe_from_dict({"name": name, "rules": rules, **({"kv": kv} if kv else {})})
        out[name] = checkpoint.save_model_checkpoint(root / name, config, quantize_params(params, recipe), tokenizer,
                                                     recipe=recipe, extra={"source": str(MODEL)})
    return out


def test_export_gguf_and_compressed_tensors(checkpoints, tmp_path, capsys):
    ckpt = checkpoints["skip-down"]
    assert cli.main(["export", str(ckpt), "--format", "gguf", "--out", str(tmp_path / "m.gguf"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bytes"] == (tmp_path / "m.gguf").stat().st_size and info["checkpoint_bytes"] > 0
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F32

    assert cli.main(["export", str(ckpt), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 0
    assert "wrote compressed-tensors" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "ct").iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct", "m.gguf"]  # no temporary names left


def test_export_onnx_runs_in_onnxruntime(checkpoints, tmp_path, capsys):
    import numpy as np
    import onnxruntime as ort

    from llmeq_jax.export.onnx import empty_past, session_options

    out = tmp_path / "m.onnx"
    assert cli.main(["export", str(checkpoints["all"]), "--format", "onnx", "--out", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bytes"] == out.stat().st_size
    config = checkpoint.load_model_checkpoint(checkpoints["all"])[0]
    session = ort.InferenceSession(str(out), session_options(), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"input_ids": np.array([[1, 403, 407]], np.int64), **empty_past(config, 1)})[0]
    assert logits.shape == (1, 3, config.vocab_size) and np.all(np.isfinite(logits))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("fmt, ckpt, message", [
    ("gguf", "all", "layers_0/mlp/down_proj/kernel (int8 per-channel sym): input dim 172 is not a multiple of the GGUF "
                    "block size 32"),
    ("onnx", "kv8", "layers_*/attn (KV cache): the recipe quantizes the KV cache"),
])
def test_unsupported_layer_is_one_line_and_nothing_written(checkpoints, tmp_path, capsys, fmt, ckpt, message):
    out = tmp_path / "out"
    assert cli.main(["export", str(checkpoints[ckpt]), "--format", fmt, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmeq export: error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_bad_input(checkpoints, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "is not an llmeq_jax checkpoint" in capsys.readouterr().err
    assert cli.main(["export", str(checkpoints["skip-down"]), "--format", "gguf", "--out", str(tmp_path / "x.gguf"),
                     "--source", str(tmp_path / "missing.gguf")]) == 2
    assert "missing.gguf' does not exist" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert cli.main(["export", str(checkpoints["skip-down"]), "--format", "compressed-tensors",
                     "--out", str(tmp_path / "taken")]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
