"""GGUF export of models from Hugging Face directories: GPT-2's architecture, and the tokenizer keys written from a
Hugging Face tokenizer (``export.gguf_tokenizer``) instead of copied from a source GGUF file."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llmeq_jax import cli
from llmeq_jax.core.rules import quantize_params, recipe_from_dict
from llmeq_jax.export import ExportError, gguf_tokenizer
from llmeq_jax.export.gguf import write_gguf
from llmeq_jax.models import forward as _forward
from llmeq_jax.models import load_model
from llmeq_jax.pipeline import read_recipe
from tests.models.hf_fixtures import make_hf_model, save
from tests.shared_data import shared_data_path

STORIES = shared_data_path("stories260K.gguf")
VOCAB = 320  # 256 byte tokens, <|endoftext|> and 63 merges
TEXT = "The tower is 324 metres tall , about the same height as an 81 @-@ storey building ."
K = gguf.Keys.Tokenizer
Q = gguf.GGMLQuantizationType
forward = jax.jit(_forward, static_argnums=0)


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's kind) trained on WikiText-2, <|endoftext|> its BOS and EOS."""
    lines = shared_data_path("wikitext2_valid.txt").read_text(encoding="utf-8").splitlines()[:3000]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(lines, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    assert len(tok) == VOCAB
    return tok


def _hf_dir(family, tokenizer, path):
    save(make_hf_model(family, vocab_size=VOCAB), family, path)
    tokenizer.save_pretrained(path)
    return path


def _rel_diff(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_tokenizer_keys(byte_bpe):
    """Tokens in id order with their types, merges, ids and add-BOS as llama.cpp's converter writes them."""
    with pytest.warns(UserWarning, match="not one llama.cpp names"):
        meta = gguf_tokenizer.tokenizer_metadata(byte_bpe, VOCAB + 3)
    tokens, types = meta[K.LIST][0], meta[K.TOKEN_TYPE][0]
    assert meta[K.MODEL][0] == "gpt2" and K.PRE not in meta  # an unknown vocabulary: llama.cpp's default split
    assert tokens[:VOCAB] == [byte_bpe.convert_ids_to_tokens(i) for i in range(VOCAB)]
    assert tokens[VOCAB:] == [f"[PAD{i}]" for i in range(VOCAB, VOCAB + 3)]  # the model's extra rows
    eot = byte_bpe.convert_tokens_to_ids("<|endoftext|>")
    assert types[eot] == gguf_tokenizer.CONTROL and types[VOCAB] == gguf_tokenizer.USER_DEFINED
    assert {t for i, t in enumerate(types[:VOCAB]) if i != eot} == {gguf_tokenizer.NORMAL}
    assert meta[K.BOS_ID][0] == meta[K.EOS_ID][0] == eot
    assert meta[K.ADD_BOS][0] is False and meta[K.ADD_EOS][0] is False
    merges = meta[K.MERGES][0]
    assert len(merges) == VOCAB - 257 and all(len(m.split(" ")) == 2 for m in merges)


def test_known_pre_tokenizer_is_named(byte_bpe, monkeypatch):
    """A vocabulary whose check hash llama.cpp knows gets that pre-tokenizer's name, and no warning."""
    digest = gguf_tokenizer.check_hash(byte_bpe)
    assert digest not in gguf_tokenizer.KNOWN_PRE
    monkeypatch.setitem(gguf_tokenizer.KNOWN_PRE, digest, "gpt-2")
    meta = gguf_tokenizer.tokenizer_metadata(byte_bpe, VOCAB)
    assert meta[K.PRE][0] == "gpt-2"
    # The hash is of the ids of llama.cpp's check text: another tokenization of it gives another hash.
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_bpe.backend_tokenizer.to_str()))
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert gguf_tokenizer.check_hash(other) != digest


def test_sentencepiece_keys_are_stories260ks():
    """stories260K's tokenizer (SentencePiece BPE, converted by transformers) written back: the file's tokens,
    scores, types and ids, as llama.cpp's ``llama`` tokenizer model."""
    config, _, tokenizer = load_model(STORIES)
    meta = gguf_tokenizer.tokenizer_metadata(tokenizer, config.vocab_size)
    fields = gguf.GGUFReader(str(STORIES)).fields
    for key in (K.MODEL, K.LIST, K.SCORES, K.TOKEN_TYPE, K.BOS_ID, K.EOS_ID, K.UNK_ID):
        assert meta[key][0] == fields[key].contents(), key
    assert meta[K.PRE][0] == "default" and K.MERGES not in meta
    assert meta[K.ADD_BOS][0] is True and meta[K.ADD_PREFIX][0] is True and meta[K.ADD_EOS][0] is False


def test_sentencepiece_round_trip(tmp_path):
    """stories260K written with its tokenizer rebuilt from transformers' (no source file): our loader reads back
    the same tokens and logits."""
    config, params, tokenizer = load_model(STORIES)
    out = write_gguf(config, params, tmp_path / "m.gguf", tokenizer=tokenizer)
    config2, params2, tokenizer2 = load_model(out)
    text = shared_data_path("wikitext2_valid.txt").read_text(encoding="utf-8")[:4000]
    assert tokenizer2(text)["input_ids"] == tokenizer(text)["input_ids"]
    tokens = jnp.asarray([tokenizer(TEXT)["input_ids"]], jnp.int32)
    assert _rel_diff(forward(config2, params2, tokens), forward(config, params, tokens)) <= 1e-6


def test_other_tokenizers_are_refused(tmp_path):
    config, params, _ = load_model(STORIES)
    word_level = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")))
    with pytest.raises(ExportError, match="this one is WordLevel.*--source"):
        write_gguf(config, params, tmp_path / "m.gguf", tokenizer=word_level)
    with pytest.raises(ExportError, match="needs the model's tokenizer"):
        write_gguf(config, params, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "llama"])
def test_hf_model_round_trips_through_gguf(family, byte_bpe, tmp_path):
    """An HF model with its tokenizer, written as GGUF (no source file) and read back by our GGUF loader: the
    same logits, the same tokens."""
    config, params, tokenizer = load_model(_hf_dir(family, byte_bpe, tmp_path / "hf"))
    tokens = jnp.asarray([tokenizer(TEXT)["input_ids"]], jnp.int32)
    with pytest.warns(UserWarning, match="not one llama.cpp names"):
        out = write_gguf(config, params, tmp_path / "m.gguf", tokenizer=tokenizer)
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == family
    config2, params2, tokenizer2 = load_model(out)
    assert config2.model_type == config.model_type and config2.num_layers == config.num_layers
    assert tokenizer2(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert _rel_diff(forward(config2, params2, tokens), forward(config, params, tokens)) <= 1e-6


@pytest.mark.parametrize("weight, qtype", [
    ({"bits": 8, "granularity": "channel"}, Q.Q8_0),
    ({"bits": 4, "granularity": "group", "group_size": 32, "symmetric": False, "scale_dtype": "float16"}, Q.Q4_1),
])
def test_gpt2_quantized_round_trip(weight, qtype, byte_bpe, tmp_path):
    """GPT-2 in llama.cpp's names: fused attn_qkv, position_embd, LayerNorm weights and biases; quantized kernels
    as block types, read back with the logits of our quantized model."""
    config, params, tokenizer = load_model(_hf_dir("gpt2", byte_bpe, tmp_path / "hf"))
    tokens = jnp.asarray([tokenizer(TEXT)["input_ids"]], jnp.int32)
    recipe = recipe_from_dict({"name": "t", "rules": [{"pattern": ".*/kernel", "weight": weight}]})
    qparams = quantize_params(params, recipe)
    with pytest.warns(UserWarning):
        out = write_gguf(config, qparams, tmp_path / "m.gguf", tokenizer=tokenizer)
    by_name = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert {by_name[f"blk.1.{n}.weight"].tensor_type for n in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")} \
        == {qtype}
    assert by_name["position_embd.weight"].tensor_type == Q.F32 and "output.weight" not in by_name  # tied head
    assert tuple(by_name["blk.0.attn_qkv.bias"].shape) == (3 * config.hidden_size,)
    config2, params2, _ = load_model(out)
    # The file's ids are the tokenizer's (the HF config states none); its epsilon a float32.
    assert config2 == dataclasses.replace(config, bos_token_id=config2.bos_token_id, eos_token_id=config2.eos_token_id,
                                          norm_eps=float(np.float32(config.norm_eps)))
    ref = forward(config, qparams, tokens)
    assert _rel_diff(forward(config2, params2, tokens), ref) <= (2e-6 if qtype == Q.Q4_1 else 1e-3)


@pytest.mark.parametrize("recipe, qtype", [
    ("rtn-w8-q8_0", Q.Q8_0), ("rtn-w4-g32-q4_0", Q.Q4_0), ("rtn-w4-g32-asym-q4_1", Q.Q4_1)])
def test_gguf_grid_recipes_write_every_matrix_as_blocks(recipe, qtype, byte_bpe, tmp_path):
    """The shipped GGUF-grid recipes: kernels in their block type and the tied token table in Q8_0, as
    llama.cpp's own quantizer writes a file, each holding our grid exactly (float32 summation order apart)."""
    config, params, tokenizer = load_model(_hf_dir("gpt2", byte_bpe, tmp_path / "hf"))
    tokens = jnp.asarray([tokenizer(TEXT)["input_ids"]], jnp.int32)
    qparams = quantize_params(params, read_recipe(recipe))
    with pytest.warns(UserWarning):
        out = write_gguf(config, qparams, tmp_path / "m.gguf", tokenizer=tokenizer)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["token_embd.weight"] == Q.Q8_0
    assert {types[f"blk.{i}.{n}.weight"] for i in range(2) for n in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")} \
        == {qtype}
    kept = load_model(out, keep_quantized=True)[1]["embed"]["embedding"]
    np.testing.assert_array_equal(np.asarray(kept.values()), np.asarray(qparams["embed"]["embedding"].values()))
    config2, params2, _ = load_model(out)
    assert _rel_diff(forward(config2, params2, tokens), forward(config, qparams, tokens)) <= 2e-6


def test_gpt2_exact_gelu_is_refused(byte_bpe, tmp_path):
    config, params, tokenizer = load_model(_hf_dir("gpt2", byte_bpe, tmp_path / "hf"))
    with pytest.raises(ExportError, match="tanh GELU"):
        write_gguf(dataclasses.replace(config, act="gelu"), params, tmp_path / "m.gguf", tokenizer=tokenizer)
    assert not (tmp_path / "m.gguf").exists()


def test_cli_exports_an_hf_checkpoint_to_gguf(byte_bpe, tmp_path, capsys):
    """``llmeq quantize`` from an HF directory then ``llmeq export --format gguf``: no --source needed."""
    hf = _hf_dir("gpt2", byte_bpe, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert cli.main(["quantize", str(hf), "--recipe", "rtn-w8", "--out", str(ckpt)]) == 0
    with pytest.warns(UserWarning):
        assert cli.main(["export", str(ckpt), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    capsys.readouterr()
    config, params, tokenizer = load_model(tmp_path / "m.gguf")
    assert config.model_type == "gpt2" and tokenizer(TEXT)["input_ids"] == byte_bpe(TEXT)["input_ids"]
    assert np.all(np.isfinite(np.asarray(forward(config, params, jnp.asarray([[1, 2, 3]], jnp.int32)))))
