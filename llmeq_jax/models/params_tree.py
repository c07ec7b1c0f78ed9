"""Filling a param tree tensor by tensor, checked against the shapes the config implies.

Both loaders (safetensors, GGUF) translate file tensor names into our ``/``-joined
param paths and hand each converted tensor to :class:`TreeBuilder`, which
checks its shape (naming the file tensor on mismatch), casts it to the target
dtype at once (so the float32/float16 source copy is dropped tensor by tensor)
and finally reports any param the file did not provide.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray
from llmeq_jax.models.config import ModelConfig


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded into the model its config describes."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``path -> shape`` of every param the model with ``config`` has."""
    from llmeq_jax.models.model import init_params

    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


class TreeBuilder:
    def __init__(self, config: ModelConfig, dtype: Any, source: str):
        self.shapes = expected_shapes(config)
        self.dtype = dtype
        self.source = source
        self.flat: dict[str, jax.Array] = {}

    def wants(self, path: str) -> bool:
        return path in self.shapes

    def put(self, path: str, value: np.ndarray | QArray, file_name: str) -> None:
        want = self.shapes.get(path)
        if want is None:
            raise ModelLoadError(f"{self.source}: tensor {file_name!r} maps to {path!r}, which this model has no use for")
        if tuple(value.shape) != want:
            raise ModelLoadError(
                f"{self.source}: tensor {file_name!r} has shape {tuple(value.shape)} but the config implies "
                f"{want} for {path!r} (after conversion to our (in, out) layout)"
            )
        if isinstance(value, QArray):  # a kernel kept quantized as the file stores it: dequantizes to `dtype`
            self.flat[path] = dataclasses.replace(value, dtype=jnp.dtype(self.dtype))
            return
        # Norm scales and biases stay float32: they are tiny and precision-sensitive.
        dtype = self.dtype if value.ndim >= 2 else jnp.float32
        self.flat[path] = jnp.asarray(value, dtype=dtype)

    def finish(self) -> dict:
        missing = sorted(set(self.shapes) - set(self.flat))
        if missing:
            raise ModelLoadError(f"{self.source}: missing tensors for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        tree: dict = {}
        for path, value in self.flat.items():
            node = tree
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return tree
