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
    from llmeq_jax import evaluate

    ids = evaluate.tokenize_text(tokenizer, Path(path).read_text())
    return evaluate.make_windows(ids, seq_len, n_windows)
