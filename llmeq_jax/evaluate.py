"""What quantization cost and bought: perplexity, bytes, speed (DESIGN §6).

Perplexity protocol: read the text as-is, tokenize it whole with the model's
tokenizer (no BOS), cut it into non-overlapping windows of ``seq_len`` tokens,
evaluate the first ``n_windows`` (0 = all), and report
``exp(mean next-token NLL)`` over every predicted token (``seq_len - 1`` per
window).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

PROTOCOL = (
    "perplexity: whole text tokenized without BOS, non-overlapping windows of seq_len tokens, "
    "first n_windows (0 = all), ppl = exp(mean next-token NLL over seq_len-1 predictions per window); "
    "speed: warm (after compilation), median of runs"
)


# --------------------------------------------------------------------------- perplexity


def tokenize_text(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of the whole text, without BOS/EOS."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int32)


def make_windows(ids: np.ndarray, seq_len: int, n_windows: int) -> np.ndarray:
    """Non-overlapping ``[n, seq_len]`` windows from the start of ``ids`` (n_windows 0 = all)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is too short; expected at least 2 tokens per window")
    available = len(ids) // seq_len
    if available == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}")
    if n_windows < 0:
        raise ValueError(f"n_windows={n_windows} must be >= 0 (0 = all windows)")
    n = available if n_windows == 0 else n_windows
    if n > available:
        raise ValueError(
            f"the text has {len(ids)} tokens = {available} windows of {seq_len}; {n_windows} were requested"
        )
    return ids[: n * seq_len].reshape(n, seq_len)


def token_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per-position next-token NLL ``[B, T-1]`` (float32) from logits ``[B, T, V]``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


# Positions per head application in chunked_token_nll: [B, 128, vocab] logits (25 MB for a 49k
# vocabulary at B = 1) stay in the last-level cache, where whole-window logits (100 MB per window)
# made the log-softmax a DRAM round trip. Measured on SmolLM2-135M, 2-core Zen 1: 128 beat 64 and 256.
NLL_CHUNK = 128


def chunked_token_nll(head_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, tokens: jax.Array,
                      chunk: int = NLL_CHUNK) -> jax.Array:
    """:func:`token_nll` from hidden states: ``head_fn`` ([B, c, hidden] -> logits [B, c, V]) runs on
    ``chunk`` positions at a time (a ``lax.map``) and each chunk's logits are reduced to NLLs at once,
    so the full [B, T, V] logits never exist. Same math as ``token_nll(head_fn(hidden), tokens)``."""
    b, t, d = hidden.shape
    n = t - 1
    h, targets = hidden[:, :-1], tokens[:, 1:]
    pad = (-n) % chunk
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h = h.reshape(b, -1, chunk, d).swapaxes(0, 1)
    targets = targets.reshape(b, -1, chunk).swapaxes(0, 1)

    def one(args):
        hc, tc = args
        logits = head_fn(hc).astype(jnp.float32)
        top = jnp.max(logits, axis=-1, keepdims=True)
        # The sum of exponentials as a dot with ones: XLA's CPU reduce of exp ran ~2x slower.
        total = jnp.exp(logits - top) @ jnp.ones((logits.shape[-1],), jnp.float32)
        picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        return jnp.log(total) + top[..., 0] - picked

    nll = jax.lax.map(one, (h, targets))
    return nll.swapaxes(0, 1).reshape(b, -1)[:, :n]


def perplexity(
    logits_fn: Callable[..., jax.Array] | None,
    windows: np.ndarray,
    batch_size: int = 4,
    progress: bool = False,
    params: Any = None,
    nll_fn: Callable[..., jax.Array] | None = None,
) -> dict:
    """Perplexity of ``logits_fn`` (tokens ``[B, T]`` -> logits ``[B, T, V]``) over ``windows``.

    Or of ``nll_fn`` (tokens -> per-position NLL ``[B, T-1]``, e.g. :func:`chunked_token_nll`
    over a model's hidden states), given instead of ``logits_fn``.
    With ``params``, either function takes ``(params, tokens)`` and the params are an
    argument of the jitted step. Pass them that way: a closure over the params makes
    them constants of the compiled program (XLA then constant-folds every weight, slow
    to compile, and holds a second copy of the model).
    The NLL is reduced inside the jitted step, so logits never leave the device.
    The last batch is padded to ``batch_size`` (padded rows are not counted)
    to keep one compiled shape.
    """
    if (logits_fn is None) == (nll_fn is None):
        raise ValueError("perplexity: pass exactly one of logits_fn and nll_fn")
    from llmeq_jax.subchannel import prompt_jit  # a GPU's int4 products in its fused form, where it may run

    if nll_fn is None:
        nll_fn = lambda *a: token_nll(logits_fn(*a), a[-1])  # noqa: E731
    if params is None:
        step = prompt_jit(lambda toks: jnp.sum(nll_fn(toks), axis=-1))
    else:
        jitted = prompt_jit(lambda p, toks: jnp.sum(nll_fn(p, toks), axis=-1))
        step = lambda toks: jitted(params, toks)  # noqa: E731
    total = 0.0
    for chunk, real in padded_batches(windows, batch_size, progress, "perplexity"):
        total += float(np.sum(np.asarray(step(jnp.asarray(chunk)))[:real], dtype=np.float64))
    return perplexity_summary(total, windows)


def padded_batches(windows: np.ndarray, batch_size: int, progress: bool = False, desc: str = "perplexity"):
    """``(batch, real)`` for each ``batch_size`` consecutive windows in order: the last batch padded with copies
    of its last window to keep one compiled shape, ``real`` the rows to count. Copies also leave any absmax of
    the batch as its real windows make it (online activation scales)."""
    batches = range(0, len(windows), batch_size)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc=desc, unit="batch", leave=False)
    for start in batches:
        chunk = windows[start : start + batch_size]
        real = len(chunk)
        if real < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, axis=0)])
        yield chunk, real


def perplexity_summary(total_nll: float, windows: np.ndarray) -> dict:
    """The perplexity dict of a summed next-token NLL over every position of ``windows`` [n, T] after its first."""
    count = len(windows) * (windows.shape[1] - 1)
    mean = total_nll / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "windows": len(windows),
            "seq_len": int(windows.shape[1])}


# --------------------------------------------------------------------------- speed


def median_time(fn: Callable[[], Any], runs: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` (its result is blocked on), after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_host_memory_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss), in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def machine() -> dict:
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
        "jax_backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
    }


def versions() -> dict:
    import flax
    import orbax.checkpoint as ocp

    out = {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__}
    out["orbax"] = getattr(ocp, "__version__", "unknown")
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


# --------------------------------------------------------------------------- report


@dataclasses.dataclass
class Row:
    """One model variant (a recipe applied to a model) and what was measured on it."""

    recipe: str
    ppl: float | None = None
    nll: float | None = None
    param_bytes: int | None = None
    disk_bytes: int | None = None
    load_s: float | None = None
    calib_s: float | None = None
    calib_samples: int | None = None
    quantize_s: float | None = None
    eval_s: float | None = None
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Report:
    model: str
    text: str
    seq_len: int
    n_windows: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    # names of further evaluation texts: each row's extra["texts"][name] holds ppl / nll / tokens there
    extra_texts: list[str] = dataclasses.field(default_factory=list)
    protocol: str = PROTOCOL
    machine: dict = dataclasses.field(default_factory=machine)
    versions: dict = dataclasses.field(default_factory=versions)
    peak_host_mb: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def baseline(self) -> Row | None:
        return self.rows[0] if self.rows else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def to_markdown(self) -> str:
        """The report as a Markdown table. The relative columns name the row they compare with (the
        first); a one-row report (``llmeq eval``) has nothing to compare with and leaves them out."""
        base = self.baseline()
        relative = len(self.rows) > 1
        extra_cols = [c for t in self.extra_texts for c in (f"ppl {t}", *([f"Δ% {t}"] if relative else []))]
        cols = ["recipe", "ppl", *([f"Δ% vs {base.recipe}"] if relative else []), *extra_cols, "param MB",
                *([f"size vs {base.recipe}"] if relative else []), "quantize s", "prefill tok/s", "decode tok/s"]
        lines = [
            f"Model `{self.model}`, text `{self.text}`"
            f"{''.join(f', `{t}`' for t in self.extra_texts)}, seq_len {self.seq_len}, windows {self.n_windows}, "
            f"device {self.machine.get('device')} ({self.machine.get('jax_backend')}).",
            "",
            "| " + " | ".join(cols) + " |",
            "|" + "---|" * len(cols),
        ]
        for r in self.rows:
            cells = [r.recipe, _fmt(r.ppl, ".3f")]
            if relative:
                cells.append(_pct(r.ppl, base.ppl))
            for t in self.extra_texts:
                ppl, base_ppl = _text_ppl(r, t), _text_ppl(base, t)
                cells += [_fmt(ppl, ".3f"), *([_pct(ppl, base_ppl)] if relative else [])]
            cells.append(_fmt(_mb(r.param_bytes), ".2f"))
            if relative:
                cells.append(_ratio(r.param_bytes, base.param_bytes))
            cells += [_fmt(r.quantize_s, ".1f"), _fmt(r.prefill_tok_s, ".0f"), _fmt(r.decode_tok_s, ".1f")]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"Protocol: {self.protocol}."]
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def _text_ppl(row: Row, text: str) -> float | None:
    return row.extra.get("texts", {}).get(text, {}).get("ppl")


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _mb(b: int | None) -> float | None:
    return None if b is None else b / 1e6


def _pct(v: float | None, base: float | None) -> str:
    if v is None or not base:
        return "–"
    return f"{100.0 * (v - base) / base:+.2f}"


def _ratio(v: int | None, base: int | None) -> str:
    if v is None or not base:
        return "–"
    return f"{v / base:.3f}×"
