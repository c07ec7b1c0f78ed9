"""Orbax checkpoints of (quantized) parameter trees (DESIGN §5).

On disk a checkpoint directory holds:

* ``arrays/``        an Orbax checkpoint of plain arrays only: for every QArray
                     its integer values, scales, zero points (and static
                     activation scale); float leaves as they are.
* ``manifest.json``  format version, the tree layout (each leaf's path, kind,
                     shapes/dtypes and the QArray static fields), the recipe
                     and any caller metadata (model config, ...).
* ``tokenizer/``     optional, written by the tokenizer's ``save_pretrained``.
* ``manifest.sha256`` the sha256 of ``manifest.json``, whose ``files`` entry holds
                     the sha256 and size of every other file: :func:`verify`
                     names the first file that was edited, truncated or deleted.

Everything is written under a temporary sibling name and moved into place at
the end, so a failed save leaves nothing half-written. The move is atomic and
exclusive: without ``overwrite`` it never replaces a directory that appeared in
the meantime, and with it only a directory that is itself one of our
checkpoints, swapped in one step. Temporary directories that a killed save left
behind are removed by the next save to the same path. In a multi-process
run every process calls :func:`save` with the same path (arrays sharded over
a mesh spanning the processes): each writes its own shards through Orbax,
process 0 writes the manifest and tokenizer and moves the directory into
place, and all processes return only once it is there. Restoring needs no
float model: :func:`abstract_tree` rebuilds the shapes from the manifest, and
:func:`restore` fills them (optionally with shardings).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from llmeq_jax.core.qarray import QArray, check_bits, is_qarray, packed_length, scale_shape
from llmeq_jax.core.quantize import GRIDS, Spec
from llmeq_jax.core.rules import path_str

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_HASH = "manifest.sha256"
ARRAYS = "arrays"
TOKENIZER = "tokenizer"
WRITER = ".llmeq-writer"  # in a temporary directory: host and pid of the save writing it
_HASH_CHUNK = 1 << 20
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
        "grid": q.grid,
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
        grid=str(static.get("grid", "uniform")),  # checkpoints from before log2 grids hold uniform codes
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
    path = Path(os.path.abspath(path))  # normalises "." and ".." (a name is needed for the sibling temp dir)
    _check_replaceable(path, overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the parent directory of {str(path)!r}: {e}") from None
    primary = jax.process_index() == 0
    if primary:
        remove_stale_temporaries(path)
    tmp = path.parent / f".{path.name}.tmp-{_shared_token()}"
    try:
        arrays, layout = split_tree(params)
        for p, leaf in layout.items():
            if leaf["kind"] == "array" and not jnp.issubdtype(jnp.dtype(leaf["dtype"]), jnp.number):
                raise CheckpointError(f"leaf {p!r} has dtype {leaf['dtype']}; expected a numeric array")
        if primary:
            tmp.mkdir()
            (tmp / WRITER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        _barrier("llmeq_checkpoint_tmp_created")
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / ARRAYS, arrays)  # every process writes its shards; Orbax syncs them
        checkpointer.wait_until_finished()
        _barrier("llmeq_checkpoint_arrays_written")  # every shard is complete before process 0 hashes it
        if not primary:
            _barrier("llmeq_checkpoint_in_place")
            return path
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / TOKENIZER))
        manifest = {
            "format_version": FORMAT_VERSION,
            "layout": layout,
            "recipe": recipe.to_dict() if hasattr(recipe, "to_dict") else recipe,
            "metadata": metadata or {},
            "files": _file_hashes(tmp),
        }
        text = json.dumps(manifest, indent=1, default=_json_default)
        (tmp / MANIFEST).write_text(text)
        (tmp / MANIFEST_HASH).write_text(_sha256_bytes(text.encode()) + "\n")
        (tmp / WRITER).unlink()
        _move_into_place(tmp, path, overwrite)
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


def is_checkpoint(path: str | Path) -> bool:
    """True for a directory holding one of our manifests (the only kind ``overwrite`` may replace)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "format_version" in manifest and "layout" in manifest


def _check_replaceable(path: Path, overwrite: bool) -> None:
    """Refuse to touch anything at ``path`` that a save may not replace."""
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise CheckpointError(f"checkpoint directory {str(path)!r} already exists; pass overwrite=True to replace it")
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{str(path)!r} exists and is not a directory; overwrite replaces only a checkpoint "
                              "directory")
    if not is_checkpoint(path):
        raise CheckpointError(f"{str(path)!r} exists and is not an llmeq_jax checkpoint (no {MANIFEST}); "
                              "overwrite replaces only a checkpoint, never another directory")
    cwd = Path.cwd()
    if path == cwd or path in cwd.parents:
        raise CheckpointError(f"{str(path)!r} holds the current directory; refusing to replace it")


# renameat2 flags (linux/fs.h): fail if the target exists / swap source and target atomically.
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """rename(2) with flags; False where the system has no renameat2 (the caller falls back)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # no such call, or a filesystem without the flag
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Atomically publish ``tmp`` as ``path``.

    New path: an exclusive rename, so a directory created meanwhile (another writer) is
    never replaced. Overwrite: the target is checked to be ours again, then swapped with
    ``tmp`` in one step, so ``path`` always holds a complete checkpoint.
    """
    if not path.exists():
        if _renameat2(tmp, path, _RENAME_NOREPLACE):
            return
        if path.exists():
            raise FileExistsError(errno.EEXIST, "appeared while saving", str(path))
        os.rename(tmp, path)  # POSIX rename onto a non-empty directory fails too
        return
    if not overwrite:
        raise CheckpointError(f"checkpoint directory {str(path)!r} appeared while saving; not replacing it")
    _check_replaceable(path, overwrite)
    if _renameat2(tmp, path, _RENAME_EXCHANGE):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old checkpoint
        return
    trash = path.parent / f".{path.name}.tmp-old{uuid.uuid4().hex[:8]}"
    path.rename(trash)
    tmp.rename(path)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove ``.NAME.tmp-*`` siblings of ``path`` left by killed saves of ours; returns them.

    Only directories whose writer marker names this host and a process that is gone (or
    that are complete checkpoints, i.e. swapped-out old versions) are removed: another
    live save's temporary directory is left alone, and so is anything not ours.
    """
    path = Path(os.path.abspath(path))
    removed = []
    for cand in path.parent.glob(f".{glob_escape(path.name)}.tmp-*"):
        if cand.is_dir() and not cand.is_symlink() and _is_stale(cand):
            shutil.rmtree(cand, ignore_errors=True)
            removed.append(cand)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


_FINISHED_GRACE_S = 60.0


def _is_stale(tmp: Path) -> bool:
    if not (tmp / WRITER).exists() and is_checkpoint(tmp):
        # Finished under a temp name: the old side of an interrupted swap, or a live save in
        # the instant between finishing and its rename -- hence the grace period.
        return time.time() - (tmp / MANIFEST).stat().st_mtime > _FINISHED_GRACE_S
    try:
        writer = json.loads((tmp / WRITER).read_text())
        host, pid = writer["host"], int(writer["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not written by us (or being created this instant): leave it
    if host != socket.gethostname():
        return False  # cannot tell whether a process on another host is alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_hashes(root: Path) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} of every file under ``root`` (sorted, "/"-separated)."""
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != WRITER:
            out[f.relative_to(root).as_posix()] = {"sha256": _sha256_file(f), "bytes": f.stat().st_size}
    return out


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
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{str(mf)!r} is not a checkpoint manifest (expected a JSON object)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {version!r}; this llmeq_jax reads version {FORMAT_VERSION}"
        )
    try:
        validate_manifest(manifest)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: malformed manifest ({type(e).__name__}: {e})") from None
    return manifest


def _check_meta(where: str, meta: dict) -> None:
    shape = meta["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes >= 0")
    try:
        jnp.dtype(meta["dtype"])
    except TypeError:
        raise CheckpointError(f"{where}: dtype {meta['dtype']!r} is not a dtype") from None


def _check_qarray_leaf(p: str, leaf: dict) -> None:
    """A QArray's static fields against its children's shapes (what restoring builds on)."""
    st, children = leaf["static"], leaf["children"]
    try:
        check_bits(st["bits"])
    except ValueError as e:
        raise CheckpointError(f"leaf {p!r}: {e}") from None
    if st.get("grid", "uniform") not in GRIDS:
        raise CheckpointError(f"leaf {p!r}: grid {st['grid']!r} is not one of {list(GRIDS)}")
    shape, tile = tuple(st["shape"]), tuple(st["tile"])
    _check_meta(f"leaf {p!r}", {"shape": list(shape), "dtype": st["dtype"]})
    if len(tile) != len(shape) or not all(isinstance(t, int) and t >= 1 for t in tile):
        raise CheckpointError(f"leaf {p!r}: tile {list(tile)} does not fit shape {list(shape)}")
    for c, m in children.items():
        if c not in _QARRAY_CHILDREN:
            raise CheckpointError(f"leaf {p!r}: unknown child {c!r}")
        _check_meta(f"leaf {p!r} {c}", m)
    if "qvalue" not in children or "scale" not in children:
        raise CheckpointError(f"leaf {p!r}: a quantized leaf needs qvalue and scale")
    expected_scale = list(scale_shape(shape, tile))
    for c in ("scale", "zero_point"):
        if c in children and children[c]["shape"] != expected_scale:
            raise CheckpointError(f"leaf {p!r}: {c} shape {children[c]['shape']} does not match shape "
                                  f"{list(shape)} with tile {list(tile)} (expected {expected_scale})")
    packed = list(shape)
    if packed:
        axis = int(st["pack_axis"]) % len(packed)
        packed[axis] = packed_length(packed[axis], st["bits"])
    if children["qvalue"]["shape"] != packed:
        raise CheckpointError(f"leaf {p!r}: qvalue shape {children['qvalue']['shape']} does not match "
                              f"{st['bits']}-bit values of shape {list(shape)} (expected {packed})"
                              + ("; 3-bit values are packed eight per three bytes now, this checkpoint holds them "
                                 "in 4-bit slots (written by an older llmeq_jax): quantize the model again"
                                 if st["bits"] == 3 else ""))


def validate_manifest(manifest: dict) -> None:
    """Every field restoring relies on: leaf kinds, shapes, dtypes, bits, and the model config's layer count."""
    layout = manifest["layout"]
    if not isinstance(layout, dict):
        raise CheckpointError("layout is not a mapping of leaf paths")
    for p, leaf in layout.items():
        if leaf.get("kind") == "qarray":
            _check_qarray_leaf(p, leaf)
        elif leaf.get("kind") == "array":
            _check_meta(f"leaf {p!r}", leaf)
        else:
            raise CheckpointError(f"leaf {p!r} has kind {leaf.get('kind')!r}; expected 'array' or 'qarray'")
    files = manifest.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in files.values())):
        raise CheckpointError("files is not a mapping of file -> {sha256, bytes}")
    config = (manifest.get("metadata") or {}).get("model_config")
    if config is not None:
        layers = {m.group(1) for p in layout if (m := re.match(r"layers_(\d+)/", p))}
        if layers and config.get("num_layers") != len(layers):
            raise CheckpointError(f"model_config num_layers={config.get('num_layers')!r} but the arrays hold "
                                  f"{len(layers)} layers")


def verify(path: str | Path) -> int:
    """Check every file of the checkpoint against the hashes written at save; returns the number checked.

    Raises a one-line :class:`CheckpointError` naming the first file that is missing,
    truncated or whose content changed (the manifest itself included).
    """
    path = Path(path)
    manifest = read_manifest(path)
    files = _listed_files(path, manifest)
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} is missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} has {f.stat().st_size} bytes; "
                                  f"{want['bytes']} were written (truncated or replaced)")
        if _sha256_file(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} does not match its sha256 (corrupted or edited)")
    return len(files) + 1


def check_files_present(path: str | Path) -> int:
    """The cheap part of :func:`verify`: the manifest's own hash, and every file there with its size."""
    path = Path(path)
    files = _listed_files(path, read_manifest(path))
    for rel, want in files.items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} is missing or has the wrong size")
    return len(files) + 1


def _listed_files(path: Path, manifest: dict) -> dict:
    """The manifest's file list, after checking the manifest against its own hash."""
    files = manifest.get("files")
    if files is None or not (path / MANIFEST_HASH).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} holds no content hashes (saved by an older llmeq_jax); "
                              "re-save it, or skip the check (--no-verify, verify=False)")
    want = (path / MANIFEST_HASH).read_text().strip()
    if _sha256_bytes((path / MANIFEST).read_bytes()) != want:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} does not match its sha256 in {MANIFEST_HASH} "
                              "(corrupted or edited)")
    return files


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


def restore(path: str | Path, target: Any = None, *, verify_hashes: bool = True) -> Any:
    """Load a checkpoint's tree; ``target`` is an abstract tree (e.g. from :func:`abstract_tree`
    with shardings) or None to restore onto the default device. ``verify_hashes``: check every
    file against its sha256 first (:func:`verify`)."""
    path = Path(path).absolute()
    if verify_hashes:
        verify(path)
    if target is None:
        # An explicit device: without one Orbax reuses the saved shardings, which fail
        # when the checkpoint was written by another topology (e.g. several processes).
        target = abstract_tree(path, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    else:
        read_manifest(path)
    arrays_target, _ = split_tree(target)
    try:
        arrays = ocp.StandardCheckpointer().restore(path / ARRAYS, arrays_target)
    except Exception as e:  # noqa: BLE001 -- Orbax/tensorstore raise many types for damaged files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"could not restore the arrays of {str(path)!r} ({type(e).__name__}: {first}); "
                              "the checkpoint is damaged (llmeq inspect --verify names the file)") from None
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


def load_model_checkpoint(path: str | Path, target: Any = None, *, verify_hashes: bool = True):
    """(config, params, tokenizer or None, recipe dict or None) from :func:`save_model_checkpoint`'s output."""
    from llmeq_jax.models.config import ModelConfig

    path = Path(path)
    manifest = read_manifest(path)
    if verify_hashes:  # before anything (the tokenizer included) is read from the files
        verify(path)
    cfg = manifest.get("metadata", {}).get("model_config")
    if cfg is None:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model config; it was not saved as a model")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{k: _tuplify(v) for k, v in cfg.items() if k in fields})
    tokenizer = None
    if (path / TOKENIZER).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path / TOKENIZER))
    return config, restore(path, target, verify_hashes=False), tokenizer, manifest.get("recipe")


def describe_layout(layout: dict) -> list[dict]:
    """One row per leaf: path, kind, bits, value grid (uniform, log2, fp8), granularity, logical shape, stored bytes."""
    from llmeq_jax.core.qarray import granularity_name

    rows = []
    for p, leaf in layout.items():
        if leaf["kind"] == "qarray":
            st = leaf["static"]
            nbytes = sum(math.prod(m["shape"]) * jnp.dtype(m["dtype"]).itemsize for m in leaf["children"].values())
            gran = granularity_name(tuple(st["shape"]), tuple(st["tile"]))
            rows.append({"path": p, "kind": "qarray", "bits": st["bits"], "grid": st.get("grid", "uniform"),
                         "granularity": gran,
                         "symmetric": "zero_point" not in leaf["children"], "shape": st["shape"], "bytes": nbytes})
        else:
            nbytes = math.prod(leaf["shape"]) * jnp.dtype(leaf["dtype"]).itemsize
            rows.append({"path": p, "kind": "float", "bits": None, "grid": None, "granularity": leaf["dtype"],
                         "symmetric": None, "shape": leaf["shape"], "bytes": nbytes})
    return rows
