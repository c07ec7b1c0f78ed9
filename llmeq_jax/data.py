"""Where the shared texts are found, and reading them into evaluation / calibration windows.

The evaluation text (WikiText-2 test) and the calibration text (WikiText-2 validation)
are looked up by file name in ``$LLMEQ_DATA``, ``./../shared/data`` and
``<repo>/../shared/data``, in that order; an explicit path wins over the lookup.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmeq_jax.errors import UsageError

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_TEXT = "wikitext2_test.txt"
CALIB_TEXT = "wikitext2_valid.txt"
# A second domain for evaluation, built from this Python's documentation (llmeq_jax.texts): no file needed.
HELD_OUT_TEXT = "pydoc-topics"


def data_dirs() -> list[Path]:
    """Where shared data is looked for: $LLMEQ_DATA, ./../shared/data, <repo>/../shared/data."""
    dirs = []
    if os.environ.get("LLMEQ_DATA"):
        dirs.append(Path(os.environ["LLMEQ_DATA"]))
    dirs += [Path.cwd().parent / "shared" / "data", REPO_ROOT.parent / "shared" / "data"]
    return dirs


def find_data_file(given: str | None, default_name: str, what: str) -> Path:
    """The path of ``given`` (which must exist), else the first ``default_name`` in :func:`data_dirs`."""
    if given:
        p = Path(given)
        if not p.is_file():
            raise UsageError(f"{what} file {given!r} does not exist")
        return p
    for d in data_dirs():
        if (d / default_name).is_file():
            return d / default_name
    looked = ", ".join(str(d) for d in data_dirs())
    raise UsageError(f"no {what} file given and {default_name} was not found in {looked}; pass it with --text/--calib "
                     "or set LLMEQ_DATA to the folder that holds it")


def text_windows(tokenizer, path: str | Path, seq_len: int, n_windows: int):
    """The text at ``path`` tokenized and cut into ``n_windows`` windows of ``seq_len`` tokens (0 = all)."""
    return windows_of(tokenizer, Path(path).read_text(), seq_len, n_windows)


def windows_of(tokenizer, text: str, seq_len: int, n_windows: int):
    """``text`` tokenized and cut into ``n_windows`` windows of ``seq_len`` tokens (0 = all)."""
    from llmeq_jax import evaluate

    return evaluate.make_windows(evaluate.tokenize_text(tokenizer, text), seq_len, n_windows)


def extra_eval_text(given: str) -> tuple[str, str]:
    """``(label, text)`` of a further evaluation text: the file ``given``, or, when no such file exists,
    the held-out text built into the package under the name ``HELD_OUT_TEXT`` (:mod:`llmeq_jax.texts`)."""
    p = Path(given)
    if p.is_file():
        return p.stem, p.read_text()
    if given == HELD_OUT_TEXT:
        from llmeq_jax.texts import pydoc_topics_text

        return HELD_OUT_TEXT, pydoc_topics_text()
    raise UsageError(f"--extra-text {given!r} is neither a file nor the built-in held-out text {HELD_OUT_TEXT!r}")
