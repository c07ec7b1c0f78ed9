"""A GGUF file's tokenizer keys (``tokenizer.ggml.*``) from a Hugging Face tokenizer, as llama.cpp reads them.

Two kinds of vocabulary, told apart by the tokenizer's BPE model:

* byte-level BPE (GPT-2, Llama-3, Qwen2/3, SmolLM) is llama.cpp's ``gpt2`` tokenizer model: the tokens in id
  order with their types, the merges, and ``tokenizer.ggml.pre``, the name of the regex split llama.cpp applies
  before the merges. That name is found the way llama.cpp's own converter finds it: the SHA-256 of the token ids
  the tokenizer gives a fixed check text, looked up among known hashes (``KNOWN_PRE``, from llama.cpp's
  ``convert_hf_to_gguf.py``). An unknown hash writes no ``pre``: llama.cpp then splits with its default regex
  and warns, and so do we.
* BPE with byte fallback (SentencePiece models as transformers converts them: Llama-2, Mistral v0.1,
  TinyLlama) is llama.cpp's ``llama`` model, which merges the adjacent pair whose joined piece has the highest
  score. SentencePiece's BPE vocabularies are sorted by that score (piece i scores -i after the control and
  byte pieces), so the scores are rebuilt from the ids: stories260K's file comes back score for score.

Both: special ids and the chat template (read by gguf's ``SpecialVocab``), whether BOS / EOS are added (and a
leading space, for SentencePiece) as the tokenizer does it.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import warnings
from hashlib import sha256
from typing import Any

from llmeq_jax.export.common import ExportError

# llama.cpp's check text: its token ids' hash identifies a BPE vocabulary's pre-tokenizer.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure "
    "I'll make it, 'D you like some tea? We'Ve a'lL"
)
# sha256(str(token ids of CHECK_TEXT)) -> llama.cpp's pre-tokenizer name, for the families we load.
KNOWN_PRE = {
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / Qwen2
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
}
# gguf.TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte-fallback pieces


def check_hash(tokenizer) -> str:
    """llama.cpp's fingerprint of a tokenizer: the SHA-256 of ``str(ids)`` of :data:`CHECK_TEXT`."""
    return sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()


def pre_tokenizer_name(tokenizer) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` for ``tokenizer``, or None (with a warning) when its hash is unknown."""
    digest = check_hash(tokenizer)
    name = KNOWN_PRE.get(digest)
    if name is None:
        warnings.warn(f"GGUF export: this tokenizer's pre-tokenizer is not one llama.cpp names (check hash "
                      f"{digest[:16]}...); no tokenizer.ggml.pre is written and llama.cpp will split text with its "
                      "default regex, which may tokenize differently", stacklevel=3)
    return name


def _backend_model(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("GGUF export needs a fast (tokenizers-backed) tokenizer to write the vocabulary")
    return json.loads(backend.to_str())["model"]


def vocabulary_kind(tokenizer) -> str:
    """llama.cpp's tokenizer model for ``tokenizer``: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece BPE)."""
    model = _backend_model(tokenizer)
    if model.get("type") == "BPE":
        return "llama" if model.get("byte_fallback") else "gpt2"
    raise ExportError(f"GGUF export writes BPE tokenizers (byte-level or SentencePiece-style); this one is "
                      f"{model.get('type')}; give a GGUF file of the same tokenizer with --source to copy its "
                      "vocabulary")


def token_list(tokenizer, vocab_size: int, kind: str) -> tuple[list[str], list[int]]:
    """(tokens in id order, llama.cpp token types), padded with unused ``[PADi]`` ids up to ``vocab_size``."""
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    n = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(USER_DEFINED)
        elif kind == "llama" and i == tokenizer.unk_token_id:
            tokens.append(by_id[i])
            types.append(UNKNOWN)
        elif i in added:
            tokens.append(added[i].content)
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(BYTE if kind == "llama" and _BYTE_PIECE.fullmatch(by_id[i]) else NORMAL)
    return tokens, types


def sentencepiece_scores(types: list[int]) -> list[float]:
    """Scores in id order: SentencePiece's -rank for normal pieces (ranked from the first one), 0 for the rest."""
    first = types.index(NORMAL) if NORMAL in types else 0
    return [float(first - i) if t == NORMAL else 0.0 for i, t in enumerate(types)]


def _special_keys(tokenizer, vocab_size: int, kind: str) -> dict[str, tuple[Any, Any]]:
    """Merges (byte-level BPE), special ids and the chat template (read by gguf's own ``SpecialVocab``),
    add-BOS/EOS (and the leading space of SentencePiece) as the tokenizer does them."""
    import gguf
    from gguf import GGUFValueType as T

    vocab_log = logging.getLogger("gguf.vocab")  # its notes on add-BOS/EOS/SEP guesses, which we do not use
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            special = gguf.SpecialVocab(tmp, load_merges=kind == "gpt2", n_vocab=vocab_size)
    finally:
        vocab_log.setLevel(level)
    K = gguf.Keys.Tokenizer
    out: dict[str, tuple[Any, Any]] = {}
    if kind == "gpt2":
        if not special.merges:
            raise ExportError("GGUF export: the BPE tokenizer has no merges to write")
        out[K.MERGES] = (list(special.merges), T.ARRAY)
    for name, token_id in special.special_token_ids.items():
        key = getattr(K, f"{name.upper()}_ID", None)
        if key is not None:
            out[key] = (int(token_id), T.UINT32)
    # What the tokenizer does, always written: llama.cpp's defaults differ by vocabulary.
    ids = tokenizer.encode("a")
    out[K.ADD_BOS] = (tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id, T.BOOL)
    out[K.ADD_EOS] = (tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id, T.BOOL)
    if kind == "llama":
        first = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))[0]
        out[K.ADD_PREFIX] = (first.startswith("\u2581"), T.BOOL)  # "▁a": a space is put before the text
    if isinstance(special.chat_template, str):
        out[K.CHAT_TEMPLATE] = (special.chat_template, T.STRING)
    return out


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict[str, tuple[Any, Any, Any]]:
    """``{key: (value, GGUFValueType, array element type)}``: every ``tokenizer.*`` key llama.cpp reads."""
    import gguf
    from gguf import GGUFValueType as T

    kind = vocabulary_kind(tokenizer)
    K = gguf.Keys.Tokenizer
    tokens, types = token_list(tokenizer, vocab_size, kind)
    out: dict[str, tuple[Any, Any, Any]] = {
        K.MODEL: (kind, T.STRING, None),
        K.LIST: (tokens, T.ARRAY, T.STRING),
        K.TOKEN_TYPE: (types, T.ARRAY, T.INT32),
    }
    if kind == "llama":
        out[K.PRE] = ("default", T.STRING, None)  # as llama.cpp's converter writes SentencePiece vocabularies
        out[K.SCORES] = (sentencepiece_scores(types), T.ARRAY, T.FLOAT32)
    else:
        pre = pre_tokenizer_name(tokenizer)
        if pre is not None:
            out[K.PRE] = (pre, T.STRING, None)
    for key, (value, vtype) in _special_keys(tokenizer, len(tokens), kind).items():
        out[key] = (value, vtype, T.STRING if vtype == T.ARRAY else None)
    return out
