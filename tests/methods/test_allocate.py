"""Bit allocation: byte costs, both solvers on constructed cases, measured sensitivities, CLI -> quantize round trip."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.quantize import Spec, quantize, quantize_dequantize
from llmeq_jax.core.rules import get_path, load_recipe, set_path
from llmeq_jax.methods import allocate as A
from llmeq_jax.methods import sensitivity as S
from tests.shared_data import shared_data_path

REPO = Path(__file__).resolve().parents[2]


def test_costs_are_the_bytes_a_qarray_stores():
    w = jnp.zeros((300, 64))
    for b in (2, 3, 4, 8):
        spec = A.candidate_spec(b, 128)
        assert A.spec_bytes((300, 64), spec) == quantize(w, spec).nbytes
    # symmetric 4-bit: 150 packed rows x 64 + 3 groups x 64 float32 scales; symmetric 3-bit: 38 chunks of
    # eight values in three bytes; 5-bit values take int8 slots
    assert A.spec_bytes((300, 64), A.candidate_spec(4, 128, symmetric=True)) == 150 * 64 + 3 * 64 * 4
    assert A.spec_bytes((300, 64), A.candidate_spec(3, 128, symmetric=True)) == 38 * 3 * 64 + 3 * 64 * 4
    assert A.spec_bytes((300, 64), A.candidate_spec(5, 128)) == A.spec_bytes((300, 64), A.candidate_spec(8, 128))
    # the default candidates are asymmetric (4 levels at 2 bits, not a ternary grid), and their zero points count
    assert not A.candidate_spec(2, 128).symmetric
    assert A.spec_bytes((300, 64), A.candidate_spec(4, 128)) > A.spec_bytes((300, 64), A.candidate_spec(4, 128, True))


def test_guards_take_narrow_widths_off_the_edges_and_off_catastrophic_layers():
    paths = ["layers_0/a/kernel", "layers_1/a/kernel", "layers_1/b/kernel", "layers_2/a/kernel"]
    assert A.edge_paths(paths, 3) == ["layers_0/a/kernel", "layers_2/a/kernel"]
    cost = {p: {2: 10, 4: 20, 8: 40} for p in paths}
    table = {p: {2: 0.1, 4: 0.01, 8: 0.0} for p in paths}
    table["layers_1/b/kernel"] = {2: 3.0, 4: 0.9, 8: 0.001}  # both narrow widths beyond the limit
    out = A.restrict(cost, table, edges=A.edge_paths(paths, 3), edge_min_bits=4, max_delta=0.5)
    assert sorted(out["layers_0/a/kernel"]) == [4, 8] and sorted(out["layers_2/a/kernel"]) == [4, 8]
    assert sorted(out["layers_1/a/kernel"]) == [2, 4, 8]
    assert sorted(out["layers_1/b/kernel"]) == [8]  # the widest stays even if it were over the limit
    # and the solver then keeps those layers wide even under a budget that would rather crush them
    choice = A.greedy(out, table, budget=10 + 20 + 20 + 40)
    assert choice["layers_1/b/kernel"] == 8 and choice["layers_0/a/kernel"] >= 4 and choice["layers_2/a/kernel"] >= 4
    assert A.restrict(cost, table) == cost  # no guards: nothing removed


def _case():
    shapes = {"layers_0/a/kernel": (256, 64), "layers_0/b/kernel": (256, 64), "layers_1/c/kernel": (256, 128)}
    cost = A.cost_table(shapes, (2, 4, 8), 128, symmetric=True)  # budgets below are in symmetric bits
    # the high-rate model D = n * c * 4^-b, with layer a 1000x as sensitive
    c = {"layers_0/a/kernel": 1000.0, "layers_0/b/kernel": 1.0, "layers_1/c/kernel": 1.0}
    dist = {p: {b: math.prod(shapes[p]) * c[p] * 4.0 ** -b for b in (2, 4, 8)} for p in shapes}
    return shapes, cost, dist, c


def _used(choice, cost):
    return sum(cost[p][b] for p, b in choice.items())


def test_greedy_meets_the_budget_and_no_upgrade_fits():
    shapes, cost, dist, _ = _case()
    for budget_bits in (2.3, 3.0, 4.25, 5.0, 6.0, 8.25):
        budget = A.budget_bytes(shapes, budget_bits, None)
        choice = A.greedy(cost, dist, budget)
        used = _used(choice, cost)
        assert used <= budget
        for p, b in choice.items():  # maximal: every wider width of any single layer would break the budget
            assert all(used - cost[p][b] + cost[p][w] > budget for w in cost[p] if w > b)


def test_both_solvers_give_the_sensitive_layer_more_bits():
    shapes, cost, dist, c = _case()
    budget = A.budget_bytes(shapes, 4.25, None)  # the size of uniform int4 g128
    for choice in (A.greedy(cost, dist, budget), A.lagrange(cost, c, budget)[0]):
        assert _used(choice, cost) <= budget
        assert choice["layers_0/a/kernel"] == 8 and choice["layers_1/c/kernel"] < 4, choice
    # equal sensitivities at exactly the int4 size: everything int4
    equal = {p: 1.0 for p in shapes}
    assert set(A.lagrange(cost, equal, _used({p: 4 for p in shapes}, cost))[0].values()) == {4}


def test_lagrange_coefficients_recover_the_model():
    shapes, _, dist, c = _case()
    coef = S.lagrange_coefficients(dist, {p: math.prod(s) for p, s in shapes.items()})
    for p in shapes:
        assert np.isclose(coef[p], c[p])


def test_lagrange_never_picks_a_width_that_costs_as_much_as_a_wider_one():
    shapes = {"layers_0/a/kernel": (256, 64)}
    cost = A.cost_table(shapes, (2, 3, 4), 128)
    choice, _ = A.lagrange(cost, {"layers_0/a/kernel": 4.0 ** 3}, cost["layers_0/a/kernel"][3])
    assert choice["layers_0/a/kernel"] == 3  # b* = 3 exactly, and packed 3-bit is cheaper than 4-bit
    cost = A.cost_table(shapes, (4, 5, 8), 128)
    for coef in (4.0 ** 5, 4.0 ** 5.4, 4.0 ** 4.6):  # b* near 5: 5-bit costs 8-bit's bytes
        choice, _ = A.lagrange(cost, {"layers_0/a/kernel": coef}, cost["layers_0/a/kernel"][8])
        assert choice["layers_0/a/kernel"] in (4, 8)


@pytest.mark.parametrize("kw,match", [
    (dict(budget_bits=4.0, budget_mb=1.0), "exactly one of"),
    (dict(budget_bits=None, budget_mb=None), "exactly one of"),
    (dict(budget_bits=-1.0, budget_mb=None), "finite number > 0"),
])
def test_bad_budgets_are_named(kw, match):
    with pytest.raises(A.AllocationError, match=match):
        A.budget_bytes({"layers_0/a/kernel": (4, 4)}, **kw)


def test_group_size_variants_are_candidates_with_their_own_bytes():
    keys = A.parse_candidates("8,4g64,2,4,4c,4g256")
    assert keys[0] == 2 and keys[-1] == 8 and set(keys) == {2, 4, "4g64", "4c", "4g256", 8}
    assert A.candidate_spec("4g64", 128) == Spec(4, "group", group_size=64, symmetric=False)
    assert A.candidate_spec("4c", 128) == Spec(4, "channel", symmetric=False)
    assert A.candidate_bits("4g64") == 4 and A.candidate_bits(8) == 8
    shapes = {"layers_0/a/kernel": (576, 64)}
    cost = A.cost_table(shapes, keys, 128)["layers_0/a/kernel"]
    assert cost["4c"] < cost["4g256"] < cost[4] < cost["4g64"] < cost[8]  # finer groups: more scales
    # measured: one per width the solver could pick, not the widest (variants carried by the proxy's ratio)
    # (5-bit values take int8 slots: never worth measuring)
    full = A.cost_table(shapes, A.parse_candidates("2,3,4g64,4,5,8"), 128)
    assert A.measured_candidates(full, A.parse_candidates("2,3,4g64,4,5,8")) == [2, 3, 4]
    # the edge guard reads a variant's width
    out = A.restrict({"layers_0/a/kernel": cost}, {"layers_0/a/kernel": {k: 0.0 for k in keys}},
                     edges=["layers_0/a/kernel"], edge_min_bits=4)
    assert 2 not in out["layers_0/a/kernel"] and "4c" in out["layers_0/a/kernel"]


def test_combine_table_carries_measurements_by_the_proxy_ratio():
    proxy = {"p": {2: 100.0, "4c": 8.0, 4: 4.0, "4g64": 2.0, 8: 0.01}}
    table = S.combine_table({"p": {2: 0.5, 4: 0.02}}, proxy, A.candidate_bits)["p"]
    assert table[2] == 0.5 and table[4] == 0.02
    assert np.isclose(table["4c"], 0.04) and np.isclose(table["4g64"], 0.01) and np.isclose(table[8], 0.02 * 0.01 / 4)
    # two anchors of one width: a variant takes the one with the nearest proxy value
    table = S.combine_table({"p": {2: 0.5, "4c": 0.06, 4: 0.02}}, proxy, A.candidate_bits)["p"]
    assert table["4c"] == 0.06 and np.isclose(table["4g64"], 0.01)


@pytest.mark.parametrize("text", ["2,x", "4", "4,4", "1,4", "4,9", "4g0,8", "4q,8"])
def test_bad_candidates_are_named(text):
    with pytest.raises(A.AllocationError, match="--candidates"):
        A.parse_candidates(text)


def test_budget_below_the_floor_is_an_error():
    shapes, cost, dist, _ = _case()
    with pytest.raises(A.AllocationError, match="below the smallest allocation"):
        A.greedy(cost, dist, 100)


@pytest.fixture(scope="module")
def stories():
    from llmeq_jax import evaluate
    from llmeq_jax.models import load_model

    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    ids = evaluate.tokenize_text(tok, shared_data_path("wikitext2_valid.txt").read_text()[:40000])
    return config, params, evaluate.make_windows(ids, 64, 4)


def test_measured_delta_equals_a_full_forward_with_that_layer_quantized(stories):
    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.models import forward

    config, params, wins = stories
    spec = Spec(2, "group", group_size=32)
    paths = ["layers_0/attn/q_proj/kernel", "layers_3/mlp/down_proj/kernel"]
    deltas = S.measured_deltas(config, params, wins, paths, spec)
    toks = jnp.asarray(wins)
    base = float(jnp.mean(token_nll(forward(config, params, toks), toks)))
    for p in paths:
        layer, _, rel = p.partition("/")
        q = set_path(params, p, quantize_dequantize(get_path(params, p), spec))
        direct = float(jnp.mean(token_nll(forward(config, q, toks), toks))) - base
        assert np.isclose(deltas[p], direct, rtol=1e-3, atol=1e-5), (p, deltas[p], direct)
        assert abs(direct) > 1e-3  # a real change (stories260K on wikitext can even gain from noise: no sign test)


def test_measured_kl_equals_a_full_forward_with_that_layer_quantized(stories):
    import jax

    from llmeq_jax.models import forward

    config, params, wins = stories
    specs = {2: Spec(2, "group", group_size=32, symmetric=False), "4c": Spec(4, "channel", symmetric=False)}
    paths = ["layers_0/attn/q_proj/kernel", "layers_3/mlp/down_proj/kernel"]
    kl = S.measured_kl(config, params, wins, paths, specs, top_k=None)
    approx = S.measured_kl(config, params, wins, paths, specs, top_k=8)  # the default's truncated vocabulary
    toks = jnp.asarray(wins)
    ref = jax.nn.log_softmax(forward(config, params, toks).astype(jnp.float32), axis=-1)
    for p in paths:
        for k, spec in specs.items():
            q = set_path(params, p, quantize_dequantize(get_path(params, p), spec))
            logp = jax.nn.log_softmax(forward(config, q, toks).astype(jnp.float32), axis=-1)
            direct = float(jnp.mean(jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)))
            assert np.isclose(kl[p][k], direct, rtol=1e-3, atol=1e-7), (p, k, kl[p][k], direct)
            assert kl[p][k] > 0
            assert np.isclose(approx[p][k], kl[p][k], rtol=0.3), (p, k, approx[p][k], kl[p][k])
        assert kl[p][2] > kl[p]["4c"]  # 2 bits hurts more than 4


def test_measured_kl_around_a_reference_model_keeps_the_other_layers_at_the_reference(stories):
    import jax

    from llmeq_jax.models import forward

    config, params, wins = stories
    paths = list(A.block_kernels(params))
    ref = S.reference_params(params, paths, Spec(4, "group", group_size=32, symmetric=False))
    spec = Spec(8, "channel", symmetric=False)
    p = "layers_2/mlp/up_proj/kernel"
    kl = S.measured_kl(config, params, wins, [p], {"8c": spec}, reference=ref, top_k=None)[p]["8c"]
    toks = jnp.asarray(wins)
    logp = lambda q: jax.nn.log_softmax(forward(config, q, toks).astype(jnp.float32), axis=-1)  # noqa: E731
    lr = logp(ref)
    moved = set_path(ref, p, quantize_dequantize(get_path(params, p), spec))  # quantized from the float kernel
    direct = float(jnp.mean(jnp.sum(jnp.exp(lr) * (lr - logp(moved)), axis=-1)))
    assert np.isclose(kl, direct, rtol=1e-3, atol=1e-7) and direct > 0, (kl, direct)


def test_nll_gradient_is_the_mean_nll_gradient_over_every_window(stories):
    import jax

    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.models import forward

    config, params, wins = stories
    paths = ["layers_0/attn/v_proj/kernel", "layers_4/mlp/gate_proj/kernel"]
    got = S.nll_gradient(config, params, wins, paths, batch=3)  # batches of 3 and 1 windows
    toks = jnp.asarray(wins)
    want = jax.grad(lambda q: jnp.mean(token_nll(forward(config, q, toks), toks)))(params)
    for p in paths:
        w = get_path(want, p)
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 0 and np.allclose(got[p], w, rtol=1e-3, atol=1e-4 * scale), p


def test_nll_table_predicts_the_real_nll_change_of_each_move_from_the_reference(stories):
    """Second order around the uniform model: KL + first-order term tracks the measured change layer by layer."""
    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.models import forward

    config, params, wins = stories
    paths = list(A.block_kernels(params))
    specs = {4: A.candidate_spec(4, 32), "8c": A.candidate_spec("8c", 32), "4g16": A.candidate_spec("4g16", 32)}
    table = S.local_nll_table(config, params, wins, wins, paths, specs, 4, first_order=1.0, top_k=None)
    half = S.local_nll_table(config, params, wins, wins, paths, {4: specs[4], "8c": specs["8c"]}, 4, first_order=0.5,
                             top_k=None)
    ref = S.reference_params(params, paths, specs[4])
    toks = jnp.asarray(wins)
    nll = lambda q: float(jnp.mean(token_nll(forward(config, q, toks), toks)))  # noqa: E731
    base = nll(ref)
    for key in ("8c", "4g16"):
        est = np.array([table[p][key] for p in paths])
        real = np.array([nll(set_path(ref, p, quantize_dequantize(get_path(params, p), specs[key]))) - base
                         for p in paths])
        # stories260K (width 64, 4-bit g32 reference): correlation 0.92, mean error 0.6 of the mean change
        assert np.corrcoef(est, real)[0, 1] > 0.85, (key, est, real)
        assert np.mean(np.abs(est - real)) < 0.75 * np.mean(np.abs(real)), (key, est, real)
    for p in paths:
        assert table[p][4] == 0.0
    kl = S.measured_kl(config, params, wins, paths[:3], {"8c": specs["8c"]}, reference=ref, top_k=None)
    for p in paths[:3]:  # D = KL + w * first order: halving w moves D halfway to the KL
        assert np.isclose(half[p]["8c"], 0.5 * (table[p]["8c"] + kl[p]["8c"]), rtol=1e-4, atol=1e-8)


def test_nll_allocation_refuses_the_lagrange_solver_and_measure(stories):
    config, params, wins = stories
    with pytest.raises(A.AllocationError, match="greedy"):
        A.allocate(config, params, wins, candidates="3,4,8c", budget_bits=4.5, group_size=32, solver="lagrange",
                   sensitivity="nll")
    with pytest.raises(A.AllocationError, match="--measure"):
        A.allocate(config, params, wins, candidates="3,4,8c", budget_bits=4.5, group_size=32, sensitivity="nll",
                   measure=[3])
    with pytest.raises(A.AllocationError, match="reference"):
        A.allocate(config, params, wins, candidates="3,4,8c", budget_bits=4.5, group_size=32, sensitivity="nll",
                   reference="4g64")


def test_reference_is_the_largest_uniform_candidate_within_the_budget():
    cost = {"a": {3: 30, 4: 40, "4g64": 46, "8c": 80}, "b": {3: 3, 4: 4, "4g64": 5, "8c": 8}}
    assert A.reference_candidate(cost, 44) == 4
    assert A.reference_candidate(cost, 51) == "4g64"
    assert A.reference_candidate(cost, 10) == 3  # nothing fits: the cheapest


def test_cli_allocate_nll_writes_a_recipe_within_the_budget(tmp_path):
    model = str(shared_data_path("stories260K.gguf"))
    out = tmp_path / "alloc.yaml"
    run = lambda *a: subprocess.run([sys.executable, "-m", "llmeq_jax.cli", "allocate", model, *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=REPO, timeout=900)
    proc = run("--budget-bits", "4.6", "--group-size", "32", "--candidates", "3,4c,4,4g16,8c", "--sensitivity", "nll",
               "--calib-samples", "1", "--calib-seq-len", "64", "--grad-samples", "4", "--grad-seq-len", "64",
               "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["sensitivity"] == "nll" and info["bytes"] <= info["budget_bytes"]
    assert len(info["widths"]) > 1  # not the uniform reference
    assert "(nll sensitivity around uniform " in out.read_text()  # the header says what it was measured around
    specs = [r.weight for r in load_recipe(out).rules[2:]]
    assert len(specs) == 35
    bad = run("--budget-bits", "4.6", "--reference", "4", "--out", str(tmp_path / "b.yaml"))
    assert bad.returncode == 2 and "--sensitivity nll" in bad.stderr
    bad = run("--budget-bits", "4.6", "--sensitivity", "nll", "--reference", "4x", "--out", str(tmp_path / "b.yaml"))
    assert bad.returncode == 2 and "not a candidate" in bad.stderr


def test_cli_allocate_writes_a_recipe_that_quantize_runs(tmp_path):
    model = str(shared_data_path("stories260K.gguf"))
    out = tmp_path / "alloc.yaml"
    run = lambda *a: subprocess.run([sys.executable, "-m", "llmeq_jax.cli", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=REPO, timeout=900)
    proc = run("allocate", model, "--budget-bits", "4.5", "--group-size", "32", "--sensitivity", "proxy",
               "--calib-samples", "2", "--calib-seq-len", "64", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["bytes"] <= info["budget_bytes"] and 2 <= info["avg_bits"] <= 4.5
    recipe = load_recipe(out)
    widths = {r.pattern.replace("\\", ""): r.weight.bits for r in recipe.rules[2:]}
    assert len(widths) == 35 and set(widths.values()) <= {2, 3, 4, 8} and len(set(widths.values())) > 1
    assert not any(r.weight.symmetric for r in recipe.rules[2:])  # asymmetric candidates by default
    edges = ("layers_0/", "layers_4/")  # stories260K has 5 blocks; the default floor keeps their linears >= 4 bits
    assert all(b >= 4 for p, b in widths.items() if p.startswith(edges))
    proc = run("quantize", model, "--recipe", str(out), "--out", str(tmp_path / "ckpt"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    from llmeq_jax import checkpoint

    _, qp, _, _ = checkpoint.load_model_checkpoint(tmp_path / "ckpt")
    stored = 0
    for path, bits in widths.items():
        node = qp
        for k in path.split("/"):
            node = node[k]
        assert node.bits == bits
        stored += node.nbytes
    assert stored == info["bytes"]  # the allocator's byte count is what the checkpoint's QArrays hold
    # the same file again without --overwrite: one clear error, nothing replaced
    again = run("allocate", model, "--budget-bits", "3.5", "--out", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_cli_allocate_measured_with_group_size_variants(tmp_path):
    model = str(shared_data_path("stories260K.gguf"))
    out = tmp_path / "alloc.yaml"
    proc = subprocess.run([sys.executable, "-m", "llmeq_jax.cli", "allocate", model, "--budget-bits", "4.5",
                           "--group-size", "32", "--candidates", "2,4c,4,8c", "--measure", "2,4",
                           "--calib-samples", "1", "--calib-seq-len", "64", "--out", str(out), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["bytes"] <= info["budget_bytes"] and info["sensitivity"] == "measured"
    specs = [r.weight for r in load_recipe(out).rules[2:]]
    assert len(specs) == 35 and all(s.bits in (2, 4, 8) and not s.symmetric for s in specs)
    assert all((s.granularity == "channel") == (s.bits == 8 or s.group_size is None) for s in specs)
    assert set(info["widths"]) <= {"2", "4c", "4", "8c"}


def test_allocated_recipes_quantize_like_the_ready_recipe_of_their_method():
    from llmeq_jax.pipeline import read_recipe

    ready = read_recipe("gptq-w4-g128")
    args, clip = A.method_settings("gptq")
    assert args == dict(ready.method_args) and args["act_order"] and clip == "mse"
    assert A.method_settings("rtn") == ({}, None) and A.method_settings("no-such-method") == ({}, None)
    recipe = A.allocation_recipe({"layers_0/mlp/down_proj/kernel": 3}, "gptq", 128, "r", args, clip=clip)
    rule = recipe.rule_for("layers_0/mlp/down_proj/kernel")
    assert rule.weight == Spec(3, "group", group_size=128, symmetric=False, clip="mse")
    assert dict(recipe.method_args) == args


def test_an_allocation_built_on_a_ready_recipe_keeps_its_steps_and_measures_the_rotated_model(stories):
    import dataclasses

    from llmeq_jax.methods import quantize_model, rotate
    from llmeq_jax.pipeline import read_recipe

    config, params, wins = stories
    base = read_recipe("quarot-gptq-w3-g128-distill")
    recipe, info = A.allocate(config, params, wins, candidates=(2, 3, 4), budget_bits=3.4, group_size=32,
                              base=base, edge_min_bits=None, max_delta=None, method="rtn")
    assert info["base"] == base.name and info["bytes"] <= info["budget_bytes"]
    assert recipe.method == "gptq" and dict(recipe.method_args) == dict(base.method_args)
    assert recipe.rotate == base.rotate and recipe.finetune == base.finetune
    assert recipe.calibration == base.calibration == {"sampled": 48, "seed": 0}
    for path in A.OUTSIDE_BLOCKS:  # the table and the head keep the base's rules
        assert recipe.rule_for(path).weight == base.rule_for(path).weight
    assert recipe.rule_for("layers_2/attn/o_proj/kernel").weight.clip == "mse"  # the base's clip search
    # the sensitivities are the rotated model's (what GPTQ quantizes), not the plain one's
    path = "layers_2/attn/o_proj/kernel"
    spec = {2: A.candidate_spec(2, 32)}
    rotated = S.measured_kl(config, rotate.rotate_params(config, params, base.rotate), wins, [path], spec)
    plain = S.measured_kl(config, params, wins, [path], spec)
    assert np.isclose(info["table"][path][2], rotated[path][2], rtol=1e-5)
    assert not np.isclose(rotated[path][2], plain[path][2], rtol=1e-2)
    # and the written recipe runs the base's pipeline: rotation, GPTQ, fine-tuning
    short = dataclasses.replace(recipe, finetune={**recipe.finetune, "steps": 2, "seq_len": 32},
                                calibration={"sampled": 2, "seed": 0})
    q, qinfo = quantize_model(config, params, short, wins)
    # every allocated linear and the head the rotation unties are fine-tuned
    assert qinfo["rotate"] == base.rotate and qinfo["finetune"]["kernels"] == len(info["choice"]) + 1
    for p, bits in info["choice"].items():
        node = q
        for k in p.split("/"):
            node = node[k]
        assert node.bits == A.candidate_bits(bits)
