"""Orbax checkpoints of (quantized) parameter trees (DESIGN §5).

On disk a checkpoint directory holds:

* ``arrays/``        an Orbax checkpoint of plain arrays only: for every QArray
                     its integer values, scales, zero points (and static
                     activation scale); float leaves as they are.
* ``manifest.json``  format version, the tree layout (each leaf's path, kind,
                     shapes/dtypes and the QArray static fields), the recipe
                     and any caller metadata (model config, ...).
* ``tokenizer/``     optional, written by the tokenizer's ``save_pretrained``.

Everything is written under a temporary sibling name and moved into place at
the end, so a failed save leaves nothing half-written. In a multi-process
run every process calls :func:`save` with the same path (arrays sharded over
a mesh spanning the processes): each writes its own shards through Orbax,
process 0 writes the manifest and tokenizer and moves the directory into
place, and all processes return only once it is there. Restoring needs no
float model: :func:`abstract_tree` rebuilds the shapes from the manifest, and
:func:`restore` fills them (optionally with shardings).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import path_str

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = "arrays"
TOKENIZER = "tokenizer"
_QARRAY_CHILDREN = ("qvalue", "scale", "zero_point", "act_scale")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read, with the reason."""


# --------------------------------------------------------------------------- tree <-> (arrays, layout)


def _array_meta(a: Any) -> dict:
    return {"shape": [int(s) for s in a.shape], "dtype": jnp.dtype(a.dtype).name}


def _qarray_static(q: QArray) -> dict:
    return {
        "bits": q.bits,
        "shape": list(q.shape),
        "tile": list(q.tile),
        "dtype": jnp.dtype(q.dtype).name,
        "pack_axis": q.pack_axis,
        "act_spec": None if q.act_spec is None else dataclasses.asdict(q.act_spec),
    }


def split_tree(params: Any) -> tuple[dict, dict]:
    """-> (flat dict path -> array or {child: array}, layout dict path -> leaf description)."""
    arrays: dict[str, Any] = {}
    layout: dict[str, dict] = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_qarray):
        path = path_str(key_path)
        if isinstance(leaf, QArray):
            children = {c: getattr(leaf, c) for c in _QARRAY_CHILDREN if getattr(leaf, c) is not None}
            arrays[path] = children
            layout[path] = {
                "kind": "qarray",
                "static": _qarray_static(leaf),
                "children": {c: _array_meta(a) for c, a in children.items()},
            }
        else:
            arrays[path] = leaf
            layout[path] = {"kind": "array", **_array_meta(leaf)}
    return arrays, layout


def _nest(flat: dict[str, Any]) -> dict:
    """{"a/b/c": x} -> {"a": {"b": {"c": x}}} (the param-dict shape models use)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _abstract(meta: dict, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(meta["shape"]), jnp.dtype(meta["dtype"]), sharding=sharding)


def _qarray_from(static: dict, children: dict) -> QArray:
    act = static.get("act_spec")
    return QArray(
        qvalue=children["qvalue"],
        scale=children["scale"],
        zero_point=children.get("zero_point"),
        act_scale=children.get("act_scale"),
        bits=int(static["bits"]),
        shape=tuple(static["shape"]),
        tile=tuple(static["tile"]),
        dtype=jnp.dtype(static["dtype"]),
        pack_axis=int(static["pack_axis"]),
        act_spec=None if act is None else Spec(**act),
    )


# --------------------------------------------------------------------------- save


def save(
    path: str | Path,
    params: Any,
    *,
    recipe: Any = None,
    metadata: dict | None = None,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Save ``params`` (float leaves and QArrays) to the directory ``path``.

    ``recipe`` (a Recipe or its dict) and ``metadata`` (JSON-serialisable,
    e.g. the model config) are stored in the manifest; ``tokenizer`` (a
    transformers tokenizer) under ``tokenizer/``.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"checkpoint directory {str(path)!r} already exists; pass overwrite=True to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the parent directory of {str(path)!r}: {e}") from None
    primary = jax.process_index() == 0
    tmp = path.parent / f".{path.name}.tmp-{_shared_token()}"
    try:
        arrays, layout = split_tree(params)
        for p, leaf in layout.items():
            if leaf["kind"] == "array" and not jnp.issubdtype(jnp.dtype(leaf["dtype"]), jnp.number):
                raise CheckpointError(f"leaf {p!r} has dtype {leaf['dtype']}; expected a numeric array")
        if primary:
            tmp.mkdir()
        _barrier("llmeq_checkpoint_tmp_created")
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / ARRAYS, arrays)  # every process writes its shards; Orbax syncs them
        checkpointer.wait_until_finished()
        if not primary:
            _barrier("llmeq_checkpoint_in_place")
            return path
        manifest = {
            "format_version": FORMAT_VERSION,
            "layout": layout,
            "recipe": recipe.to_dict() if hasattr(recipe, "to_dict") else recipe,
            "metadata": metadata or {},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=_json_default))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / TOKENIZER))
        if path.exists():
            trash = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(trash)
            tmp.rename(path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(path)
    except OSError as e:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {str(path)!r}: {e}") from None
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier("llmeq_checkpoint_in_place")
    return path


def _shared_token() -> str:
    """A random suffix for the temporary directory, the same on every process (process 0's)."""
    token = uuid.uuid4().int % (2**31)
    if jax.process_count() > 1:
        token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    return f"{token:08x}"


def _barrier(name: str) -> None:
    """Wait for every process (no-op in a single-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, (jnp.dtype, type)):
        return jnp.dtype(o).name
    raise TypeError(f"metadata value {o!r} of type {type(o).__name__} is not JSON-serialisable")


# --------------------------------------------------------------------------- restore


def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint directory, after checking it is one we can read."""
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    if not mf.is_file() or not (path / ARRAYS).is_dir():
        raise CheckpointError(f"{str(path)!r} is not an llmeq_jax checkpoint (expected {MANIFEST} and {ARRAYS}/ in it)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(mf)!r} is not valid JSON: {e}") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {version!r}; this llmeq_jax reads version {FORMAT_VERSION}"
        )
    return manifest


def abstract_tree(path: str | Path, shardings: Any = None) -> Any:
    """The checkpoint's tree with ``jax.ShapeDtypeStruct`` leaves (QArrays keep their static fields).

    ``shardings``: None, one Sharding for every array, or a callable
    ``(path, child_name, meta) -> Sharding`` (child_name is None for float leaves).
    """
    layout = read_manifest(path)["layout"]

    def shard(p, child, meta):
        return shardings(p, child, meta) if callable(shardings) else shardings

    flat: dict[str, Any] = {}
    for p, leaf in layout.items():
        if leaf["kind"] == "qarray":
            children = {c: _abstract(m, shard(p, c, m)) for c, m in leaf["children"].items()}
            flat[p] = _qarray_from(leaf["static"], children)
        else:
            flat[p] = _abstract(leaf, shard(p, None, leaf))
    return _nest(flat)


def restore(path: str | Path, target: Any = None) -> Any:
    """Load a checkpoint's tree; ``target`` is an abstract tree (e.g. from :func:`abstract_tree`
    with shardings) or None to restore onto the default device."""
    path = Path(path).absolute()
    if target is None:
        # An explicit device: without one Orbax reuses the saved shardings, which fail
        # when the checkpoint was written by another topology (e.g. several processes).
        target = abstract_tree(path, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    else:
        read_manifest(path)
    arrays_target, _ = split_tree(target)
    try:
        arrays = ocp.StandardCheckpointer().restore(path / ARRAYS, arrays_target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"could not restore the arrays of {str(path)!r}: {e}") from None
    flat = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(target, is_leaf=is_qarray):
        p = path_str(key_path)
        flat[p] = dataclasses.replace(leaf, **arrays[p]) if isinstance(leaf, QArray) else arrays[p]
    return _nest(flat)


def metadata(path: str | Path) -> dict:
    """(recipe, metadata) stored with the checkpoint, as a dict with those two keys."""
    m = read_manifest(path)
    return {"recipe": m.get("recipe"), "metadata": m.get("metadata", {})}


def disk_bytes(path: str | Path) -> int:
    """Bytes on disk of everything under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# --------------------------------------------------------------------------- whole models


def _tuplify(v: Any) -> Any:
    """JSON lists back to the tuples frozen config dataclasses hold."""
    return tuple(_tuplify(x) for x in v) if isinstance(v, list) else v


def save_model_checkpoint(
    path: str | Path,
    config: Any,
    params: Any,
    tokenizer: Any = None,
    *,
    recipe: Any = None,
    overwrite: bool = False,
    extra: dict | None = None,
) -> Path:
    """A servable model: params + model config (+ tokenizer, recipe) in one checkpoint directory."""
    meta = {"model_config": dataclasses.asdict(config), **(extra or {})}
    return save(path, params, recipe=recipe, metadata=meta, tokenizer=tokenizer, overwrite=overwrite)


def load_model_checkpoint(path: str | Path, target: Any = None):
    """(config, params, tokenizer or None, recipe dict or None) from :func:`save_model_checkpoint`'s output."""
    from llmeq_jax.models.config import ModelConfig

    path = Path(path)
    manifest = read_manifest(path)
    cfg = manifest.get("metadata", {}).get("model_config")
    if cfg is None:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model config; it was not saved as a model")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{k: _tuplify(v) for k, v in cfg.items() if k in fields})
    tokenizer = None
    if (path / TOKENIZER).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path / TOKENIZER))
    return config, restore(path, target), tokenizer, manifest.get("recipe")


def describe_layout(layout: dict) -> list[dict]:
    """One row per leaf: path, kind, bits, granularity, logical shape, stored bytes."""
    from llmeq_jax.core.qarray import granularity_name

    rows = []
    for p, leaf in layout.items():
        if leaf["kind"] == "qarray":
            st = leaf["static"]
            nbytes = sum(math.prod(m["shape"]) * jnp.dtype(m["dtype"]).itemsize for m in leaf["children"].values())
            gran = granularity_name(tuple(st["shape"]), tuple(st["tile"]))
            rows.append({"path": p, "kind": "qarray", "bits": st["bits"], "granularity": gran,
                         "symmetric": "zero_point" not in leaf["children"], "shape": st["shape"], "bytes": nbytes})
        else:
            nbytes = math.prod(leaf["shape"]) * jnp.dtype(leaf["dtype"]).itemsize
            rows.append({"path": p, "kind": "float", "bits": None, "granularity": leaf["dtype"],
                         "symmetric": None, "shape": leaf["shape"], "bytes": nbytes})
    return rows
