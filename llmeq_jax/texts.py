"""Held-out evaluation text of another domain than WikiText, found on every machine without a download.

Perplexity on one corpus says little about over-fitting a calibration set drawn
from the same corpus (WikiText-2 validation -> test). For a second domain we use
the English prose of Python's own documentation that ships with CPython: the
standard-library module ``pydoc_data.topics`` holds the rendered text of the
Language Reference topics (``help('if')`` and friends) as a dict of strings.

``pydoc_topics_text()`` joins them in sorted-key order, one blank line between
topics, as-is otherwise (DESIGN §6: the text is read as-is). The exact text
depends on the Python version (3.11 here: 79 topics, about 465,000 characters);
reports name the version. ``python -m llmeq_jax.texts OUT.txt`` writes it to a
file for ``llmeq eval/compare --text OUT.txt``. Never tune or calibrate on it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def pydoc_topics_text() -> str:
    """The Python documentation topics (``pydoc_data.topics.topics``) joined in sorted-key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # stripped Python builds may leave pydoc_data out
        raise RuntimeError("the held-out text needs the standard-library module pydoc_data.topics, "
                           f"which this Python ({sys.version.split()[0]}) lacks") from e
    return "\n\n".join(topics[k].strip("\n") for k in sorted(topics)) + "\n"


def write_pydoc_topics(path: str | Path) -> Path:
    """Write :func:`pydoc_topics_text` to ``path`` (UTF-8); -> the path."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; expected a file name for the held-out text")
    path.write_text(pydoc_topics_text(), encoding="utf-8")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m llmeq_jax.texts OUT.txt")
    print(write_pydoc_topics(sys.argv[1]))
