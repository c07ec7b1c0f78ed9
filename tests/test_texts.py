"""The held-out text: Python's documentation topics, deterministic and of another domain than WikiText."""

import pytest

from llmeq_jax import texts


def test_pydoc_topics_text_is_joined_prose():
    from pydoc_data.topics import topics

    text = texts.pydoc_topics_text()
    assert text == texts.pydoc_topics_text()  # deterministic
    assert len(text) > 100_000
    # Every topic, in sorted-key order, one blank line between them.
    keys = sorted(topics)
    assert text.startswith(topics[keys[0]].strip("\n") + "\n\n" + topics[keys[1]].strip("\n"))
    assert text.endswith(topics[keys[-1]].strip("\n") + "\n")
    assert all(topics[k].strip("\n") in text for k in keys)
    assert "<unk>" not in text  # not WikiText's tokenized form
    assert " @-@ " not in text


def test_write_pydoc_topics(tmp_path):
    out = texts.write_pydoc_topics(tmp_path / "topics.txt")
    assert out.read_text(encoding="utf-8") == texts.pydoc_topics_text()
    with pytest.raises(ValueError, match="directory"):
        texts.write_pydoc_topics(tmp_path)
