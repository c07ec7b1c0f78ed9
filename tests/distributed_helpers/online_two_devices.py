"""Run with 2 fake CPU devices: online activation scales inside shard_map (batch split over 'data')
track the same state, and give the same logits, as one device on the whole batch."""


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from llmeq_jax import distributed as dist, evaluate, online
from llmeq_jax.core.rules import quantize_params
from llmeq_jax.pipeline import read_recipe
from llmeq_jax.models import forward, load_model
from tests.shared_data import SHARED_DATA

assert jax.device_count() == 2, jax.devices()
config, params, tok = load_model(str(SHARED_DATA / "stories260K.gguf"))
recipe = read_recipe("rtn-w8a8-online")
qp = quantize_params(params, recipe)
alphas = online.decays(qp, recipe)
ids = evaluate.tokenize_text(tok, (SHARED_DATA / "wikitext2_valid.txt").read_text()[:40000])
wins = jnp.asarray(evaluate.make_windows(ids, 64, 8))

mesh = Mesh(np.array(jax.devices()), ("data",))


def body(p, toks, state):
    return online.run_tracked(lambda: forward(config, p, toks), state, alphas, axis_name="data")


sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=(P("data"), P())))
s1 = s2 = online.init_state(alphas)
for start in (0, 4):
    toks = wins[start:start + 4]
    l1, s1 = online.forward(config, qp, toks, s1, alphas)
    l2, s2 = sharded(qp, toks, s2)
for p in alphas:
    assert np.isclose(float(s1[p]), float(s2[p]), rtol=1e-6), (p, float(s1[p]), float(s2[p]))
np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-4, atol=1e-4)
# distributed.online_quantize_sharded (now on core/ema) against the one-device formula
x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
q, st, sc = dist.online_quantize_sharded(x, None, mesh, axis="data", alpha=0.8, per_channel=False)
q, st, sc = dist.online_quantize_sharded(x * 2, st, mesh, axis="data", alpha=0.8, per_channel=False)
a = float(jnp.max(jnp.abs(x)))
assert np.isclose(float(st), 0.8 * a + 0.2 * 2 * a), float(st)
print("OK")
