"""What every exporter shares: the error type, a kernel's grid in the (out, in) layout, atomic output.

Our kernels are ``(in, out)`` matrices with their scales grouped along ``in``
(the contraction dim); every serving format stores ``(out, in)`` rows with
per-row (or per-row-block) scales. :func:`kernel_grid` turns a QArray into
that layout once, so each exporter only encodes bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import is_table, path_str


class ExportError(ValueError):
    """A model, recipe or destination that a format cannot take, with the layer and the reason."""


@dataclasses.dataclass(frozen=True)
class KernelGrid:
    """One quantized kernel as a serving format sees it.

    ``q`` (out, in) int8 values; ``scale`` (out, groups) float32; ``zero_point``
    (out, groups) int8 (float32 where ``kernel_grid`` let float zero points through) or None;
    ``group`` input features per scale (``in`` when there is one scale per row).
    ``x[o, i] = (q - zp)[o, i] * scale[o, i // group]``.
    ``grid="fp8"``: ``q`` holds E4M3 bit patterns and ``x = e4m3(q) * scale`` (no zero point).
    """

    path: str
    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    group: int
    bits: int
    act_spec: Spec | None = None
    act_scale: np.ndarray | None = None
    grid: str = "uniform"

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    def describe(self) -> str:
        g = "per-channel" if self.group >= self.in_features else f"g{self.group}"
        if self.act_spec is None:
            act = ""
        else:
            a = "fp8" if self.act_spec.grid == "fp8" else f"int{self.act_spec.bits}"
            act = f", {a} {self.act_spec.granularity} activations"
        kind = "fp8-e4m3" if self.grid == "fp8" else f"int{self.bits}"
        return f"{kind} {g} {'sym' if self.symmetric else 'asym'}{act}"

    def values(self) -> np.ndarray:
        """(out, in) values before scaling, as float32: the integers, or the E4M3 floats of an fp8 grid."""
        if self.grid == "fp8":
            return self.fp8().astype(np.float32)
        return self.q.astype(np.float32)

    def fp8(self) -> np.ndarray:
        """An fp8 grid's codes as ``float8_e4m3fn`` values (ml_dtypes)."""
        import ml_dtypes

        return self.q.view(ml_dtypes.float8_e4m3fn)

    def dequantize(self) -> np.ndarray:
        """(out, in) float32 weights, as our model computes them."""
        q = self.values()
        cols = np.arange(self.in_features) // self.group
        if self.zero_point is not None:
            q = q - self.zero_point.astype(np.float32)[:, cols]
        return q * self.scale[:, cols]


def kernel_grid(path: str, w: QArray, grids: tuple[str, ...] = ("uniform",),
                float_zero_points: bool = False) -> KernelGrid:
    """The (out, in) view of an ``(in, out)`` QArray kernel; an ExportError when no format could read it.

    ``grids``: the value grids the calling format encodes (compressed-tensors also writes ``fp8``).
    ``float_zero_points``: whether the format stores non-integer zero points (GGUF's block minimum does;
    they come from GGUF Q4_1 / K-quant files loaded with ``keep_quantized``), else they are refused."""
    if w.ndim != 2:
        raise ExportError(f"{path}: expected an (in, out) kernel, got shape {w.shape}")
    float_zp = w.zero_point is not None and not np.issubdtype(np.dtype(w.zero_point.dtype), np.integer)
    if float_zp and not float_zero_points:
        raise ExportError(f"{path}: float zero points (a GGUF Q4_1 / K-quant grid kept as stored) have no encoding "
                          "in this format; export as GGUF, or load the GGUF without --keep-quantized and quantize "
                          "with a recipe")
    if w.grid not in grids:
        raise ExportError(f"{path}: {w.grid} grid codes have no encoding in this format; expected "
                          + " or ".join({"uniform": "a uniform integer grid", "fp8": "an fp8 (E4M3) grid"}[g]
                                        for g in grids))
    k, n = w.shape
    t_in, t_out = w.tile
    if t_out not in (1, n):
        # Every format keeps one scale per output row (or one per tensor); groups across rows have no encoding.
        raise ExportError(f"{path}: scales are grouped along the output dim (tile {w.tile}); "
                          "exported formats need one scale per output row or per row block")
    groups = -(-k // t_in)

    def rows(a: Any, dtype) -> np.ndarray:
        a = np.asarray(a, dtype=dtype)
        return np.ascontiguousarray(np.broadcast_to(a, (groups, n)).T)

    act_scale = None if w.act_scale is None else np.asarray(w.act_scale, np.float32)
    return KernelGrid(
        path=path,
        q=np.ascontiguousarray(np.asarray(w.values(), np.int8).T),
        scale=rows(w.scale, np.float32),
        zero_point=None if w.zero_point is None else rows(w.zero_point, np.float32 if float_zp else np.int8),
        group=min(t_in, k),
        bits=w.bits,
        act_spec=w.act_spec,
        act_scale=act_scale,
        grid=w.grid,
    )


def flat_params(params: Any, keep_tables: bool = False) -> dict[str, Any]:
    """``{"layers_0/attn/q_proj/kernel": leaf}`` with QArrays kept whole.

    A quantized token table comes back as its dequantized floats (the values our model reads) unless
    ``keep_tables``: compressed-tensors and ONNX quantize Linear weights only; GGUF keeps it
    (:func:`table_grid`).
    """
    import jax

    flat = {path_str(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_qarray)}
    if keep_tables:
        return flat
    return {p: (leaf.dequantize() if is_table(p) and is_qarray(leaf) else leaf) for p, leaf in flat.items()}


def table_grid(path: str, table: QArray, float_zero_points: bool = False) -> KernelGrid:
    """A quantized ``(vocab, hidden)`` token table as a KernelGrid: rows = vocabulary, groups along hidden."""
    from llmeq_jax.decode_layout import kernel_view

    grid = kernel_grid(path, kernel_view(table), float_zero_points=float_zero_points)
    return dataclasses.replace(grid, bits=table.bits)  # kernel_view stores sub-byte values one per int8


@contextlib.contextmanager
def atomic_output(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to write into; move it into place only on success.

    On any error the temporary file or directory is removed, so a failed
    export leaves nothing behind (and an existing ``out`` untouched).
    """
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise ExportError(f"output {str(out)!r} already exists; pass overwrite=True (--overwrite) to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the parent directory of {str(out)!r}: {e}") from None
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        if out.exists():
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, trash)
            os.replace(tmp, out)
            _remove(trash)
        else:
            os.replace(tmp, out)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)
