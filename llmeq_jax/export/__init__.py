"""Export quantized checkpoints to the formats serving runtimes read: GGUF, compressed-tensors and ONNX.

One module per format; each takes ``(config, params, ...)`` and writes
through :func:`common.atomic_output`, after every check has passed, so a
recipe the format cannot express is one :class:`ExportError` naming the layer
and nothing is left on disk. :func:`export_checkpoint` is the
``llmeq export`` entry point.
"""

from __future__ import annotations

from pathlib import Path

from llmeq_jax.export.common import ExportError

FORMATS = ("gguf", "compressed-tensors", "onnx")


def source_of(ckpt: Path, given: str | Path | None) -> Path | None:
    """The model a checkpoint was made from: ``given``, else the ``source`` its manifest records (if on disk)."""
    from llmeq_jax import checkpoint
    from llmeq_jax.models.registry import REGISTRY, resolve

    if given is not None:
        p = Path(given)
        if not p.exists():
            raise ExportError(f"source {str(given)!r} does not exist")
        return p
    recorded = checkpoint.metadata(ckpt)["metadata"].get("source")
    if not recorded:
        return None
    if recorded in REGISTRY:
        try:
            return resolve(recorded)
        except ValueError:
            return None
    p = Path(recorded)
    return p if p.exists() else None


def export_checkpoint(ckpt: str | Path, fmt: str, out: str | Path, *, source: str | Path | None = None,
                      overwrite: bool = False) -> Path:
    """Write the checkpoint directory ``ckpt`` (from ``llmeq quantize``/``convert``) as ``fmt`` at ``out``."""
    from llmeq_jax import checkpoint

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    ckpt = Path(ckpt)
    checkpoint.read_manifest(ckpt)  # a clear error for a directory that is no checkpoint
    if Path(out).exists() and not overwrite:  # before the (slow) restore; atomic_output checks again
        raise ExportError(f"output {str(out)!r} already exists; pass --overwrite to replace it")
    src = source_of(ckpt, source)
    config, params, tokenizer, recipe = checkpoint.load_model_checkpoint(ckpt)
    if fmt == "onnx":
        from llmeq_jax.export.onnx import check_config, write_onnx

        kv = (recipe or {}).get("kv")
        check_config(config, kv)  # a quantized KV cache is refused before the graph is built
        meta = {"recipe": (recipe or {}).get("name", "none"), "source": str(src) if src else "",
                "model_type": config.model_type}
        return write_onnx(config, params, out, kv=kv, metadata=meta, overwrite=overwrite)
    if fmt == "gguf":
        from llmeq_jax.export.gguf import write_gguf

        if src is not None and src.suffix == ".gguf":  # the source file's own tokenizer keys, copied as they are
            return write_gguf(config, params, out, source=src, overwrite=overwrite)
        if tokenizer is None:
            raise ExportError(f"GGUF export needs a tokenizer: {str(ckpt)!r} holds none and came from no GGUF file "
                              "on disk; give one with --source FILE.gguf")
        return write_gguf(config, params, out, tokenizer=tokenizer, overwrite=overwrite)
    from llmeq_jax.export.compressed_tensors import write_compressed_tensors

    return write_compressed_tensors(config, params, out, tokenizer=tokenizer, overwrite=overwrite)


__all__ = ["ExportError", "FORMATS", "export_checkpoint", "source_of"]
