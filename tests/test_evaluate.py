import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import evaluate as ev


def _bigram_logits_fn(table):
    """A 'model' whose logits at position t are a fixed row chosen by token t."""
    table = jnp.asarray(table)
    return lambda toks: table[toks]


def test_perplexity_matches_a_hand_computation():
    rng = np.random.default_rng(0)
    vocab, seq_len = 11, 6
    table = rng.normal(size=(vocab, vocab)).astype(np.float32)
    ids = rng.integers(0, vocab, size=40).astype(np.int32)
    windows = ev.make_windows(ids, seq_len, n_windows=5)

    # By hand: for every window, every position t predicts token t+1 from row ids[t].
    nll = []
    for w in windows:
        for t in range(seq_len - 1):
            row = table[w[t]].astype(np.float64)
            logz = math.log(np.exp(row - row.max()).sum()) + row.max()
            nll.append(logz - row[w[t + 1]])
    expected = math.exp(sum(nll) / len(nll))

    # batch_size 2 over 5 windows exercises the padded last batch.
    out = ev.perplexity(_bigram_logits_fn(table), windows, batch_size=2)
    assert out["tokens"] == 5 * (seq_len - 1) == len(nll)
    assert out["ppl"] == pytest.approx(expected, rel=1e-5)


def test_windows_are_non_overlapping_from_the_start():
    ids = np.arange(23, dtype=np.int32)
    w = ev.make_windows(ids, 5, 0)
    assert w.shape == (4, 5) and w[1, 0] == 5 and w[-1, -1] == 19
    assert ev.make_windows(ids, 5, 2).shape == (2, 5)


@pytest.mark.parametrize(
    "n,seq,windows,msg",
    [(3, 5, 1, "fewer than one window"), (23, 5, 9, "9 were requested"), (23, 1, 1, "too short"), (23, 5, -1, ">= 0")],
)
def test_window_errors(n, seq, windows, msg):
    with pytest.raises(ValueError, match=msg):
        ev.make_windows(np.arange(n), seq, windows)


def test_report_json_and_markdown(tmp_path):
    rep = ev.Report(model="m", text="t.txt", seq_len=8, n_windows=2)
    rep.rows.append(ev.Row(recipe="fp32", ppl=10.0, param_bytes=4_000_000))
    rep.rows.append(ev.Row(recipe="rtn-w8", ppl=10.5, param_bytes=1_000_000, quantize_s=0.5))
    data = json.loads(rep.save_json(tmp_path / "r.json").read_text())
    assert data["rows"][1]["ppl"] == 10.5 and "perplexity" in data["protocol"]
    assert data["machine"]["jax_backend"] == jax.default_backend()
    md = rep.to_markdown()
    assert "| rtn-w8 | 10.500 | +5.00 | 1.00 | 0.250× |" in md
    assert "| Δ% vs fp32 |" in md and "| size vs fp32 |" in md  # the header names the row compared with


def test_one_row_report_has_no_relative_columns():
    """`llmeq eval` reports one model: "Δ% vs first" would compare it with itself."""
    rep = ev.Report(model="m", text="t.txt", seq_len=8, n_windows=2)
    rep.rows.append(ev.Row(recipe="as-loaded", ppl=10.0, param_bytes=4_000_000))
    md = rep.to_markdown()
    assert " vs " not in md.split("\n")[2]
    assert "| as-loaded | 10.000 | 4.00 | – | – | – |" in md


def test_median_time_and_memory():
    calls = []
    t = ev.median_time(lambda: calls.append(1) or jnp.zeros(3), runs=3, warmup=2)
    assert len(calls) == 5 and t >= 0
    assert ev.peak_host_memory_mb() > 10


def test_perplexity_with_params_as_an_argument_equals_the_closure():
    rng = np.random.default_rng(1)
    table = rng.normal(size=(7, 7)).astype(np.float32)
    windows = ev.make_windows(rng.integers(0, 7, size=30).astype(np.int32), 5, n_windows=0)
    closed = ev.perplexity(_bigram_logits_fn(table), windows, batch_size=2)
    passed = ev.perplexity(lambda p, toks: p[toks], windows, batch_size=2, params=jnp.asarray(table))
    assert passed["ppl"] == pytest.approx(closed["ppl"], rel=1e-6)


@pytest.mark.parametrize("seq_len,chunk", [(6, 2), (9, 4), (5, 128)])
def test_chunked_nll_equals_the_full_logits_nll(seq_len, chunk):
    """The head applied a chunk of positions at a time (padding the last chunk) gives the same
    per-position NLL as full logits, for chunks that divide T-1, do not, and exceed it."""
    rng = np.random.default_rng(2)
    vocab, hidden = 13, 5
    w = jnp.asarray(rng.normal(size=(hidden, vocab)).astype(np.float32)) * 3
    head_fn = lambda h: h @ w  # noqa: E731
    h = jnp.asarray(rng.normal(size=(2, seq_len, hidden)).astype(np.float32))
    toks = jnp.asarray(rng.integers(0, vocab, size=(2, seq_len)).astype(np.int32))
    full = ev.token_nll(head_fn(h), toks)
    chunked = ev.chunked_token_nll(head_fn, h, toks, chunk=chunk)
    assert chunked.shape == full.shape == (2, seq_len - 1)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_perplexity_from_an_nll_fn_equals_the_logits_fn():
    rng = np.random.default_rng(3)
    table = rng.normal(size=(7, 7)).astype(np.float32)
    windows = ev.make_windows(rng.integers(0, 7, size=30).astype(np.int32), 5, n_windows=0)
    by_logits = ev.perplexity(lambda p, toks: p[toks], windows, batch_size=2, params=jnp.asarray(table))
    by_nll = ev.perplexity(None, windows, batch_size=2, params=jnp.asarray(table),
                           nll_fn=lambda p, toks: ev.chunked_token_nll(lambda h: h @ p, jax.nn.one_hot(toks, 7), toks, chunk=3))
    assert by_nll["ppl"] == pytest.approx(by_logits["ppl"], rel=1e-6)
    with pytest.raises(ValueError, match="exactly one"):
        ev.perplexity(None, windows)
