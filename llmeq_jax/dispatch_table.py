"""A measured choice between a Pallas kernel and XLA for each quantized product on a device.

The static rule of :mod:`llmeq_jax.kernel_dispatch` hands every product a kernel can take to that
kernel. On a GPU that is not always the faster path: a kernel tuned for decode can lose to XLA's
dequantize-and-dot at prefill sizes, and the other way round. ``scripts/bench_kernels.py
--write-table PATH`` times, on the device it runs on, each kernel kind at each weight shape and
row count three ways -- the Pallas kernel, XLA's path for the same QArray, and a bf16 dot of float
weights -- and writes them as one JSON table. Activated (``LLMEQ_DISPATCH_TABLE=PATH`` or
``with dispatch_table.use(PATH):``), it overrules the static rule where it has a measurement:
the kernel takes a product only where it was measured faster than XLA on this device, kernel,
width, group, (K, N), activation dtype and row bucket. Where it has none the static rule stays.
The benchmark checks each kernel's output against XLA's on the same inputs before it trusts a time: an
entry marked ``"wrong": true`` (the kernel disagreed) chooses XLA's path whatever the times.

Tables measured by this project ship in ``llmeq_jax/dispatch_tables/`` (one JSON file per device
kind, e.g. ``NVIDIA_H200.json``) and apply by themselves on that device when no table is active;
``LLMEQ_DISPATCH_TABLE=none`` turns them off (the static rule everywhere).

Rows are bucketed to the next power of two (M = 3 reads the M = 4 entry; the benchmark measures
powers of two). A product the table did not measure takes the path its measured neighbours agree on:
the same kernel, width and activation dtype on other weight shapes, at the nearest measured row buckets
on either side of its own (:meth:`Table.inferred`) -- where at least two shapes were measured there and
all chose one path. (The H200's weight-only kernels lost to XLA by 2.3-3.3x at every prefill row count
and shape measured, yet a Llama-3-8B's unmeasured shapes took them: its int4 prefill ran at 0.47x bf16.)
Where they disagree, or fewer were measured, the static rule stays. A table measured on another device
kind is ignored, with one warning: kernel speed ratios do not carry from one GPU to another.

One exception, for the shipped tables only: where none was measured on this device kind, the one measured on a
GPU of the same architecture -- the same compute capability and number of SMs, as the table's header records
them -- applies, with one warning naming it (the H100 SXM and the H200 are one GH100 chip, 132 SMs at the same
clocks, with 3.35 against 4.8 TB/s of HBM). Its choices are between paths of the same product on the same SMs:
at prompt rows both compute-bound, at decode rows both streaming the weights, where the quantized path reads
fewer bytes and a slower memory favours it further. That is closer to this GPU than the static rule, which
sends a prompt's weight-only products to a kernel that ran at 0.27-0.34x bf16 on both.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Iterable

FORMAT = 1
ENV = "LLMEQ_DISPATCH_TABLE"
# int4_words: the weight-only int4 decode kernel on the word layout (decode_layout.Int4WordKernel);
# float: a float kernel's layer read in place from its stack (pallas_kernels.float_matmul) against XLA's
# slice-and-dot, bits = the float width; on a GPU taken where unmeasured (interpret mode: only where measured).
# int8_f16: the K-major int8 decode kernel with float16 operands (pallas_kernels.int8_f16) against the one it
# replaces, the K-major int8 kernel with x's dtype as operands: its "xla_s" is that kernel's time.
# kv_attention: one query token's attention over the quantized KV store, the Pallas decode kernel
# (pallas_kernels.kv_cache) against XLA's dots over the codes (llmeq_jax.kv.store_attention); bits = the codes'
# width, k = head_dim, n = the cache's slots (a power-of-two bucket), rows = query heads per KV head times the
# batch (bucketed), dtype the query's.
# weight_only_nk / w8a8_nk / fp8_w8a8_nk: the int8 kernels on weights stored K-major (decode_layout.for_decode's
# layout for decode rows on a GPU) against XLA's path: another kernel than the (K, N) one of the same name, whose
# verdicts do not apply to it (the K-major W8A8 kernel ran at 1.29x bf16 at M = 16 where the (K, N) one lost to XLA).
# rms_norm: a decode step's RMSNorm in one kernel (pallas_kernels.rms_norm) against XLA's two; bits 32 (the scale's),
# k = n = the features; on a GPU taken where unmeasured only once it passed its gpu cases on one
# (pallas_kernels.hardware_checked: not yet).
# prompt_attention: a prompt's attention as cuDNN's flash attention ("pallas_s": the fused kernel's time, though
# it is cuDNN's, not a Pallas one) against XLA's dots and softmax; bits 16, k = head_dim, n = the keys (a
# power-of-two bucket), rows = the query positions (bucketed), dtype the query's.
# decode_hopper: a decode step's int4 or int8 weight-only product through the Mosaic GPU decode kernel
# (pallas_kernels.decode_hopper: the (out, in) int4 rows of decode_layout.Int4RowKernel, or K-major int8) against
# the path it replaces, the faster of the Triton kernel (int4 words; K-major int8) and XLA's path, timed in the
# same row.
# w8a8_hopper / fp8_w8a8_hopper: a prompt's int8 / FP8 W8A8 product over K-major weights through the Mosaic GPU kernel
# (pallas_kernels.w8a8_hopper) against the K-major Triton kernel it replaces ("xla_s": that kernel's time).
# w8a8_decode_hopper / fp8_w8a8_decode_hopper: a decode step's int8 / FP8 W8A8 product through the same Mosaic GPU
# decode kernel (K-major codes straight from shared memory) against the faster of the K-major Triton W8A8 kernel and
# XLA's path, timed in the same row.
# kv_attention_hopper: one query token's attention over an int8 / int4 post-RoPE store through the Mosaic GPU kernel
# (pallas_kernels.kv_attention_hopper) against the faster of the Triton kernel and XLA's dots ("xla_s"); the keys as
# kv_attention's. kv_attention_hopper_rope: the same over a pre-RoPE store (keys rotated in the kernel) against the
# Triton kernel, which rotates them too (XLA's dots cannot).
# int4_words_prefill: the words of int4_words at prompt rows (pallas_kernels.int4_words_prefill, the weights as
# wgmma's A operand) against XLA's path of the packed QArray, the path prompts take without it.
# xla_subchannel / xla_subchannel_zp: a prompt's int4 group-wise product as XLA's GEMM with the dequantization fused in
# (llmeq_jax.subchannel: symmetric codes / codes with integer zero points, which add two rows a group) against XLA's
# path of the same QArray (the dequantized copy, then the GEMM); not a Pallas kernel, "pallas_s" is its time.
KERNELS = ("weight_only", "w8a8", "fp8_w8a8", "int4_words", "float", "int8_f16", "kv_attention", "weight_only_nk",
           "w8a8_nk", "fp8_w8a8_nk", "rms_norm", "prompt_attention", "int4_words_prefill", "w8a8_hopper",
           "fp8_w8a8_hopper", "weight_only_hopper", "decode_hopper", "w8a8_decode_hopper", "fp8_w8a8_decode_hopper",
           "kv_attention_hopper", "kv_attention_hopper_rope", "xla_subchannel", "xla_subchannel_zp")
# Measured weight shapes that must agree on a path before an unmeasured product follows them (Table.inferred).
MIN_AGREEING_SHAPES = 2
PATHS = ("pallas", "xla")


class DispatchTableError(ValueError):
    """A dispatch table file that cannot be read, with what is wrong in it."""


@dataclasses.dataclass(frozen=True)
class Key:
    """What one measurement is of: the product's kernel, widths, shape and row bucket on a device."""

    device: str
    kernel: str  # one of KERNELS
    bits: int  # stored weight width the kernel reads (8, or 4 for nibble-packed)
    group: int | None  # input-dim group size of the scales; None: one scale per output column
    k: int
    n: int
    rows: int  # row_bucket(M)
    dtype: str  # activation dtype, e.g. "bfloat16"


def row_bucket(m: int) -> int:
    """The power of two at or above ``m`` (>= 1): the row count a product of ``m`` rows is looked up at."""
    return 1 << max(0, int(m) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Table:
    """Measurements of one device: ``{Key: {"pallas_s", "xla_s", "bf16_s"}}``."""

    device: str
    entries: dict
    source: str = ""
    architecture: tuple[str, int] | None = None  # (compute capability, SMs) of the GPU measured, where recorded

    def choice(self, key: Key) -> str | None:
        """"pallas" or "xla", whichever was measured faster for ``key``, else the one its measured neighbours
        agree on (:meth:`inferred`); None without either."""
        e = self.entries.get(key)
        return _faster(e) if e is not None else self.inferred(key)

    def inferred(self, key: Key) -> str | None:
        """The path every measurement of ``key``'s kernel, width and activation dtype (any group, any shape)
        chose at the nearest measured row buckets around ``key.rows`` (the nearest at or below it and the
        nearest at or above it; outside the measured buckets, the nearest one), over at least
        :data:`MIN_AGREEING_SHAPES` weight shapes; None where they disagree, fewer were measured, or ``key``'s
        weight is under half the smallest of theirs."""
        kin = [(k, e) for k, e in self.entries.items()
               if (k.kernel, k.bits, k.dtype, k.device) == (key.kernel, key.bits, key.dtype, key.device)]
        below = [k.rows for k, _ in kin if k.rows <= key.rows]
        above = [k.rows for k, _ in kin if k.rows >= key.rows]
        around = {max(below, default=None), min(above, default=None)} - {None}
        near = [(k, e) for k, e in kin if k.rows in around]
        paths = {_faster(e) for _, e in near}
        shapes = {(k.k, k.n) for k, _ in near}
        if len(paths) != 1 or len(shapes) < MIN_AGREEING_SHAPES or key.k * key.n < min(a * b for a, b in shapes) / 2:
            return None  # no agreement, or a product far smaller than any measured (launch-bound: another regime)
        return paths.pop()

    def for_device(self, device: str, why: str) -> Table:
        """These measurements looked up as ``device``'s (a GPU of the same architecture: module docstring)."""
        entries = {dataclasses.replace(k, device=device): t for k, t in self.entries.items()}
        return Table(device, entries, f"{self.source} ({why})", self.architecture)


def architecture(device) -> tuple[str, int] | None:
    """(compute capability, SM count) of a jax GPU device (its ``compute_capability`` and ``core_count``), or
    None where the device does not say (a CPU)."""
    cc, cores = getattr(device, "compute_capability", None), getattr(device, "core_count", None)
    return None if cc is None or cores is None else (str(cc), int(cores))


def architecture_meta(device) -> dict:
    """A table header's record of the GPU it was measured on (empty where :func:`architecture` is None)."""
    arch = architecture(device)
    return {} if arch is None else {"compute_capability": arch[0], "core_count": arch[1]}


def _read_architecture(data: dict, where: str) -> tuple[str, int] | None:
    cc, cores = data.get("compute_capability"), data.get("core_count")
    if cc is None and cores is None:
        return None
    if not isinstance(cc, str) or not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
        raise DispatchTableError(f"{where}: \"compute_capability\" (a string, e.g. \"9.0\") and \"core_count\" "
                                 f"(a positive integer) go together, got {cc!r} and {cores!r}")
    return cc, cores


def _faster(times: dict) -> str:
    """The path an entry chooses: the faster, unless the kernel's output was wrong where it was timed."""
    return "pallas" if times["pallas_s"] <= times["xla_s"] and not times.get("wrong") else "xla"


def _entry_key(device: str, raw: dict, where: str) -> tuple[Key, dict]:
    fields = {"kernel": str, "bits": int, "k": int, "n": int, "rows": int, "dtype": str}
    times = ("pallas_s", "xla_s", "bf16_s")
    missing = [f for f in (*fields, "group", *times) if f not in raw]
    if missing:
        raise DispatchTableError(f"{where}: missing {missing}")
    for f, t in fields.items():
        if not isinstance(raw[f], t) or isinstance(raw[f], bool):
            raise DispatchTableError(f"{where}: {f} must be a {t.__name__}, got {raw[f]!r}")
    if raw["kernel"] not in KERNELS:
        raise DispatchTableError(f"{where}: kernel must be one of {list(KERNELS)}, got {raw['kernel']!r}")
    if raw["group"] is not None and (not isinstance(raw["group"], int) or raw["group"] < 1):
        raise DispatchTableError(f"{where}: group must be a positive integer or null, got {raw['group']!r}")
    if raw["rows"] != row_bucket(raw["rows"]):
        raise DispatchTableError(f"{where}: rows must be a power of two (a row bucket), got {raw['rows']}")
    for t in times:
        v = raw[t]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v == float("inf"):
            raise DispatchTableError(f"{where}: {t} must be a positive number of seconds, got {v!r}")
    if not isinstance(raw.get("wrong", False), bool):
        raise DispatchTableError(f"{where}: wrong must be true or false, got {raw['wrong']!r}")
    key = Key(device, raw["kernel"], raw["bits"], raw["group"], raw["k"], raw["n"], raw["rows"], raw["dtype"])
    return key, {t: float(raw[t]) for t in times} | ({"wrong": True} if raw.get("wrong") else {})


def from_json(data: dict, source: str = "") -> Table:
    """A :class:`Table` from the JSON object ``write`` produces; one clear error for anything else."""
    where = source or "dispatch table"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DispatchTableError(f"{where}: expected a JSON object with \"format\": {FORMAT} "
                                 f"(written by scripts/bench_kernels.py --write-table)")
    device, entries = data.get("device"), data.get("entries")
    if not isinstance(device, str) or not device:
        raise DispatchTableError(f"{where}: \"device\" must name the device kind the table was measured on")
    if not isinstance(entries, list):
        raise DispatchTableError(f"{where}: \"entries\" must be a list")
    table = {}
    for i, raw in enumerate(entries):
        if not isinstance(raw, dict):
            raise DispatchTableError(f"{where}: entries[{i}] must be an object, got {raw!r}")
        key, times = _entry_key(device, raw, f"{where}: entries[{i}]")
        table[key] = times
    return Table(device, table, source, _read_architecture(data, where))


def to_json(device: str, measured: Iterable[tuple[Key, dict]], **meta) -> dict:
    """The JSON object of a table: ``measured`` is (key, {"pallas_s", "xla_s", "bf16_s"[, "wrong"]}) pairs
    ("wrong": True where the benchmark found the kernel's output wrong; the entry then chooses XLA's path)."""
    entries = []
    for key, times in measured:
        if key.device != device:
            raise ValueError(f"a measurement of device {key.device!r} in a table of {device!r}")
        row = {f: getattr(key, f) for f in ("kernel", "bits", "group", "k", "n", "rows", "dtype")}
        entries.append(row | {t: float(times[t]) for t in ("pallas_s", "xla_s", "bf16_s")}
                       | ({"wrong": True} if times.get("wrong") else {}))
    return {"format": FORMAT, "device": device, **meta, "entries": entries}


def merge(base: Table, *newer: Table) -> Table:
    """``base`` with the measurements of ``newer`` tables added, a later one's replacing an earlier one's
    of the same product. All of one device kind: ratios do not carry from one GPU to another."""
    entries = dict(base.entries)
    for table in newer:
        if table.device != base.device:
            raise DispatchTableError(f"cannot merge {table.source or 'a table'} measured on {table.device!r} into "
                                     f"{base.source or 'a table'} of {base.device!r}")
        entries.update(table.entries)
    return Table(base.device, entries, base.source,
                 next((t.architecture for t in (*reversed(newer), base) if t.architecture), None))


def write(path: str | Path, table: Table, **meta) -> None:
    """Write ``table`` as JSON (sorted by product, for readable diffs); ``meta`` joins the header."""
    order = sorted(table.entries.items(), key=lambda kv: (kv[0].kernel, kv[0].bits, kv[0].k, kv[0].n, kv[0].rows,
                                                          kv[0].group or 0, kv[0].dtype))
    if table.architecture is not None:
        meta = {"compute_capability": table.architecture[0], "core_count": table.architecture[1], **meta}
    Path(path).write_text(json.dumps(to_json(table.device, order, **meta), indent=1) + "\n")


def load(path: str | Path) -> Table:
    """The table in the JSON file ``path``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DispatchTableError(f"dispatch table {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise DispatchTableError(f"dispatch table {str(path)!r} is not JSON: {e}") from None
    return from_json(data, str(path))


_ACTIVE: contextvars.ContextVar[Table | None] = contextvars.ContextVar("llmeq_dispatch_table", default=None)
# Each use() block's number (0 outside any): part of identity(), so that a trace made under one table is not
# reused under another (llmeq_jax.generate.kernel_state). A counter, not id(table): ids come back after a table
# is collected.
_USE_NUMBER = contextvars.ContextVar("llmeq_dispatch_table_use", default=0)
_uses = iter(range(1, 1 << 62))


@contextlib.contextmanager
def use(table: Table | str | Path):
    """Dispatch by ``table`` (or the table file at that path) inside this block."""
    token = _ACTIVE.set(table if isinstance(table, Table) else load(table))
    number = _USE_NUMBER.set(next(_uses))
    try:
        yield
    finally:
        _USE_NUMBER.reset(number)
        _ACTIVE.reset(token)


def identity() -> tuple:
    """Which table dispatch reads now, hashable: the innermost :func:`use` block's number, or the table file
    ``$LLMEQ_DISPATCH_TABLE`` names with its modification time (none: the shipped tables)."""
    number = _USE_NUMBER.get()
    if number:
        return ("use", number)
    path = os.environ.get(ENV)
    if not path or path == OFF:
        return ("env", path or None)
    try:
        return ("env", path, os.path.getmtime(path))
    except OSError:
        return ("env", path, None)  # dispatch says what is wrong with it, where it reads it


@functools.lru_cache(maxsize=4)
def _from_env(path: str, mtime: float) -> Table:
    return load(path)


OFF = "none"  # $LLMEQ_DISPATCH_TABLE=none: no table at all, not even a shipped one
SHIPPED = Path(__file__).parent / "dispatch_tables"


def shipped_path(device: str) -> Path:
    """Where the table this project measured on ``device`` ships (it may not exist)."""
    return SHIPPED / ("".join(c if c.isalnum() else "_" for c in device) + ".json")


@functools.lru_cache(maxsize=8)
def shipped(device: str, arch: tuple[str, int] | None = None) -> Table | None:
    """The shipped table of ``device``; where none was measured there, the one of a GPU of architecture ``arch``
    (:func:`architecture`: the same compute capability and SM count), looked up as ``device``'s, with one
    warning; else None."""
    path = shipped_path(device)
    if path.exists():
        return load(path)
    if arch is None:
        return None
    for other in sorted(SHIPPED.glob("*.json")):
        table = load(other)
        if table.architecture == arch:
            why = f"measured on {table.device!r}, compute capability {arch[0]} with {arch[1]} SMs as this GPU"
            warnings.warn(f"dispatch: no table measured on {device!r} ships; {other.name} applies ({why})",
                          stacklevel=3)
            return table.for_device(device, why)
    return None


def _architecture_traced_for(device: str) -> tuple[str, int] | None:
    """:func:`architecture` of the device traced for (``pallas_kernels.config.target_device``), where that is
    ``device``."""
    from pallas_kernels import config  # imported here: this module reads JSON, and is read without jax

    target = config.target_device()
    return architecture(target) if getattr(target, "device_kind", None) == device else None


def active() -> Table | None:
    """The table of the innermost :func:`use` block, else the one ``$LLMEQ_DISPATCH_TABLE`` names, else None."""
    table = _ACTIVE.get()
    if table is not None:
        return table
    path = os.environ.get(ENV)
    if not path or path == OFF:
        return None
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        raise DispatchTableError(f"${ENV} names {path!r}, which does not exist") from None
    return _from_env(path, mtime)


@functools.lru_cache(maxsize=16)
def _warn_other_device(source: str, measured: str, here: str) -> None:
    warnings.warn(f"dispatch table {source or '(in memory)'} was measured on {measured!r}, not on this "
                  f"device ({here!r}); it is ignored and the static kernel rule applies", stacklevel=3)


def _table_for(key: Key) -> Table | None:
    """The active table, else the one shipped for ``key``'s device (or its architecture: :func:`shipped`); None
    without one (or one of another device)."""
    table = active()
    if table is None:
        return None if os.environ.get(ENV) == OFF else shipped(key.device, _architecture_traced_for(key.device))
    if table.device != key.device:
        _warn_other_device(table.source, table.device, key.device)
        return None
    return table


def describe(device) -> str:
    """Which table dispatch follows on the jax ``device`` (a benchmark's header line): the active one, the one
    shipped for it or for its architecture (:func:`shipped`), or none (the static rule)."""
    table = active()
    if table is None and os.environ.get(ENV) != OFF:
        table = shipped(device.device_kind, architecture(device))
    if table is None or table.device != device.device_kind:
        return "none (the static kernel rule)"
    return f"{table.source or 'in memory'}, {len(table.entries)} products"


def choice(key: Key) -> str | None:
    """The measured path for ``key`` under the active table, else the table shipped for its device
    ("pallas" / "xla"), or None (no table, another device, or no measurement of this product)."""
    table = _table_for(key)
    return table.choice(key) if table is not None else None


def measured(key: Key) -> dict | None:
    """The times that table measured for ``key`` itself (``{"pallas_s", "xla_s", "bf16_s"}``), or None: what
    compares two kernels that both beat XLA's path."""
    table = _table_for(key)
    return None if table is None else table.entries.get(key)




def main(argv=None) -> None:
    """``python -m llmeq_jax.dispatch_table merge NEW.json... --into TABLE.json``: add measured tables
    (``scripts/bench_kernels.py --write-table``) to a table, e.g. the one shipped for their device."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m llmeq_jax.dispatch_table", description=main.__doc__.split(":")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="add measured tables to a table (later measurements win)")
    m.add_argument("tables", nargs="+", help="measured tables, oldest first")
    m.add_argument("--into", required=True, help="the table to update (created when missing)")
    m.add_argument("--jax", help="the jax version the measurements ran under (written in the header)")
    m.add_argument("--over-shipped", action="store_true",
                   help="where --into does not exist, start from the table shipped for the measurements' device (or, "
                        "where none ships, of a GPU of the architecture their header records) rather than from none")
    args = ap.parse_args(argv)
    newer = [load(p) for p in args.tables]
    into = Path(args.into)
    base = load(into) if into.exists() else None
    if base is None and args.over_shipped:
        arch = next((t.architecture for t in newer if t.architecture), None)
        base = shipped(newer[0].device, arch)
    if base is None:
        base = Table(newer[0].device, {}, str(into))
    table = merge(base, *newer)
    header = json.loads(into.read_text()) if into.exists() else {}
    meta = {k: v for k, v in header.items()
            if k not in ("format", "device", "entries", "compute_capability", "core_count")}  # the table's own
    if args.jax:
        meta["jax"] = args.jax
    write(into, table, **meta)
    print(f"{into}: {len(table.entries)} products ({len(table.entries) - len(base.entries)} new)")


__all__ = ["DispatchTableError", "ENV", "OFF", "Key", "Table", "active", "architecture", "architecture_meta", "choice",
           "describe", "from_json", "load", "merge", "row_bucket", "shipped", "shipped_path", "to_json", "use", "write"]


if __name__ == "__main__":
    main()
