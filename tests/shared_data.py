"""Where the real test data lives: ``<repo root>/../shared/data`` (never copied into the repo)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data_path(name: str) -> Path:
    """Path of a file in ../shared/data; fails the test (not skip) with a clear message when absent."""
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.fail(
            f"real test data {name!r} not found at {path}; the tests expect the shared data folder "
            f"at <repo root>/../shared/data (see its README.md)",
            pytrace=False,
        )
    return path


LILY = "Once upon a time, there was a little girl named Lily. She liked to run. "


def stories_with_windows(seq_len: int, n_windows: int = 4, text: str = LILY * 40):
    """(config, params, windows [n_windows, seq_len]) of stories260K.gguf and a short story text."""
    from llmeq_jax import evaluate
    from llmeq_jax.models import load_model

    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    return config, params, evaluate.make_windows(evaluate.tokenize_text(tok, text), seq_len, n_windows)
