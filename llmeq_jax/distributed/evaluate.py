"""Running a model on a mesh: logits and perplexity with each batch split over the data axis."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.distributed.mesh import DATA, DistributedError, global_array
from llmeq_jax.evaluate import perplexity
from llmeq_jax.models.model import forward


def forward_on_mesh(config: Any, params: Any, tokens: Any, mesh: Mesh, attention_mask: Any = None) -> jax.Array:
    """Logits of (sharded) ``params`` on ``tokens`` split over the data axis, under ``jit``."""
    batch = NamedSharding(mesh, P(DATA))
    tokens = global_array(np.asarray(tokens, np.int32), batch)
    mask = None if attention_mask is None else global_array(np.asarray(attention_mask, np.int32), batch)
    return _jit_forward(config, params, tokens, mask)


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(config, params, tokens, mask):
    return forward(config, params, tokens, mask)


def perplexity_on_mesh(config: Any, params: Any, windows: np.ndarray, mesh: Mesh, batch_size: int | None = None) -> dict:
    """``evaluate.perplexity`` with each batch split over the data axis (DESIGN §6 protocol)."""
    batch_size = mesh.shape[DATA] if batch_size is None else batch_size
    if batch_size % mesh.shape[DATA]:
        raise DistributedError(f"batch_size={batch_size} must be a multiple of the data axis ({mesh.shape[DATA]})")
    batch = NamedSharding(mesh, P(DATA))

    def logits(toks):
        toks = jax.lax.with_sharding_constraint(toks, batch)
        return forward(config, params, toks)

    return perplexity(logits, windows, batch_size=batch_size)
