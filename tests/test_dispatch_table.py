"""The measured dispatch table (llmeq_jax/dispatch_table.py) and how kernel_dispatch follows it (interpret mode)."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import dispatch_table as dt
from llmeq_jax import kernel_dispatch, ops
from llmeq_jax.core.quantize import Spec, quantize
from pallas_kernels import config

DEVICE = jax.devices()[0].device_kind
W4 = Spec(bits=4, granularity="group", group_size=128)
TIMES = {"pallas_s": 2e-5, "xla_s": 1e-5, "bf16_s": 3e-5}


def _key(rows=4, **kw):
    base = dict(device=DEVICE, kernel="weight_only", bits=4, group=128, k=256, n=64, rows=rows, dtype="float32")
    return dt.Key(**(base | kw))


def _table(times, *keys):
    return dt.from_json(dt.to_json(DEVICE, [(k, times) for k in keys] or [(_key(), times)], jax="test"))


@pytest.mark.parametrize("m, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (4096, 4096)])
def test_row_bucket(m, bucket):
    assert dt.row_bucket(m) == bucket


def test_a_kernel_found_wrong_where_it_was_timed_is_never_chosen(tmp_path):
    """An entry marked "wrong" (the benchmark's check of the kernel's output failed) chooses XLA however fast the
    kernel was, keeps the mark through a file, and sends its unmeasured neighbours to XLA too; a mark that is not a
    boolean is one clear error."""
    fast, wrong = TIMES | {"pallas_s": 5e-6}, TIMES | {"pallas_s": 5e-6, "wrong": True}
    assert _table(fast).choice(_key()) == "pallas"
    table = _table(wrong, _key(), _key(k=512), _key(k=1024))
    assert table.choice(_key()) == "xla"
    assert table.choice(_key(k=768)) == "xla"  # inferred from the three
    path = tmp_path / "t.json"
    dt.write(path, table)
    assert dt.load(path).entries[_key()] == wrong and dt.load(path).choice(_key()) == "xla"
    assert "wrong" not in dt.to_json(DEVICE, [(_key(), fast)])["entries"][0]
    data = dt.to_json(DEVICE, [(_key(), fast)])
    data["entries"][0]["wrong"] = "yes"
    with pytest.raises(dt.DispatchTableError, match=r"entries\[0\]: wrong must be true or false, got 'yes'"):
        dt.from_json(data)


def test_json_round_trip_and_choice(tmp_path):
    slow_kernel, fast_kernel = _key(rows=1), _key(rows=512, kernel="w8a8", bits=8, group=None)
    data = dt.to_json(DEVICE, [(slow_kernel, TIMES), (fast_kernel, TIMES | {"pallas_s": 5e-6})], jax="x")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    table = dt.load(path)
    assert table.device == DEVICE and set(table.entries) == {slow_kernel, fast_kernel}
    assert table.choice(slow_kernel) == "xla" and table.choice(fast_kernel) == "pallas"
    assert table.choice(_key(rows=2)) is None


def test_merge_adds_and_replaces_measurements(tmp_path):
    old, both, new = _key(rows=1), _key(rows=16), _key(rows=16, kernel="int4_words")
    base = _table(TIMES, old, both)
    newer = _table(TIMES | {"pallas_s": 5e-6}, both, new)
    merged = dt.merge(base, newer)
    assert set(merged.entries) == {old, both, new}
    assert merged.choice(old) == "xla" and merged.choice(both) == "pallas" and merged.choice(new) == "pallas"
    assert base.choice(both) == "xla"  # the tables merged are left as they were
    other = dt.Table("another GPU", {}, "other.json")
    with pytest.raises(dt.DispatchTableError, match="measured on 'another GPU'"):
        dt.merge(base, other)
    # the command line: the header's metadata is kept, entries come out sorted, later files win
    into, measured = tmp_path / "shipped.json", tmp_path / "new.json"
    into.write_text(json.dumps(dt.to_json(DEVICE, [(both, TIMES), (old, TIMES)], jax="0.1")))
    measured.write_text(json.dumps(dt.to_json(DEVICE, [(both, TIMES | {"pallas_s": 5e-6}), (new, TIMES)])))
    dt.main(["merge", str(measured), "--into", str(into)])
    data = json.loads(into.read_text())
    assert data["jax"] == "0.1" and [e["rows"] for e in data["entries"] if e["kernel"] == "weight_only"] == [1, 16]
    assert dt.load(into).entries == dt.merge(_table(TIMES, both, old), dt.load(measured)).entries


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d.pop("device"), "device"),
    (lambda d: d["entries"][0].pop("xla_s"), r"missing \['xla_s'\]"),
    (lambda d: d["entries"][0].update(kernel="fp8"), "kernel must be one of"),
    (lambda d: d["entries"][0].update(rows=3), "power of two"),
    (lambda d: d["entries"][0].update(bits="4"), "bits must be a int"),
    (lambda d: d["entries"][0].update(group=0), "group must be"),
    (lambda d: d["entries"][0].update(pallas_s=-1.0), "pallas_s must be a positive"),
    (lambda d: d.update(entries={}), "entries"),
    (lambda d: d.update(compute_capability="9.0"), "go together"),
    (lambda d: d.update(compute_capability=9.0, core_count=132), "go together"),
    (lambda d: d.update(compute_capability="9.0", core_count=0), "go together"),
])
def test_bad_table_is_one_clear_error(edit, message):
    data = dt.to_json(DEVICE, [(_key(), TIMES)])
    edit(data)
    with pytest.raises(dt.DispatchTableError, match=message):
        dt.from_json(data, "t.json")


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(dt.DispatchTableError, match="does not exist"):
        dt.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(dt.DispatchTableError, match="not JSON"):
        dt.load(tmp_path / "bad.json")


def _product(rows=4):
    w = quantize(jax.random.normal(jax.random.key(0), (256, 64)) * 0.1, W4)
    return jax.random.normal(jax.random.key(1), (rows, 256)), w


def _uses_kernel(x, w):
    return "pallas_call" in str(jax.make_jaxpr(lambda x: ops.linear(x, w))(x))


def test_the_table_sends_a_product_to_the_measured_faster_path():
    x, w = _product(rows=3)  # looked up at the 4-row bucket
    with config.interpret(True):
        assert _uses_kernel(x, w)  # static rule: the kernel takes it
        with dt.use(_table(TIMES)):  # measured: XLA faster
            assert kernel_dispatch.linear(x, w) is None and not _uses_kernel(x, w)
            np.testing.assert_allclose(ops.linear(x, w), ops.linear(x, w, backend="xla"), atol=1e-5)
            assert kernel_dispatch.linear(x, w, require=True) is not None  # backend="pallas" still gets it
            x8 = jnp.ones((8, 256))  # another bucket: not measured, static rule
            assert _uses_kernel(x8, w)
        with dt.use(_table(TIMES | {"pallas_s": 5e-6})):
            assert _uses_kernel(x, w)


XLA_FASTER, KERNEL_FASTER = TIMES, TIMES | {"pallas_s": 5e-6}


def test_an_unmeasured_product_follows_its_measured_neighbours():
    """Two shapes measured at 512 and 2048 rows, XLA faster on both: a third shape takes XLA at those buckets,
    between them and past them; one shape's dissent, a single shape, or another kernel / width / dtype: no
    inference (the static rule)."""
    measured = [(_key(rows=r, k=k), XLA_FASTER) for r in (512, 2048) for k in (256, 512)]
    table = dt.from_json(dt.to_json(DEVICE, measured))
    for rows in (2048, 1024, 512, 8192, 4):
        assert table.choice(_key(rows=rows, k=1024, n=128)) == "xla", rows
    assert table.choice(_key(rows=2048, k=256)) == "xla"  # measured itself
    dissent = dt.from_json(dt.to_json(DEVICE, measured + [(_key(rows=2048, k=768), KERNEL_FASTER)]))
    assert dissent.choice(_key(rows=2048, k=1024)) is None and dissent.choice(_key(rows=1024, k=1024)) is None
    assert dissent.choice(_key(rows=512, k=1024)) == "xla"  # the dissenting shape was not measured at 512 rows
    lone = dt.from_json(dt.to_json(DEVICE, [(_key(rows=2048, k=256), XLA_FASTER)]))
    assert lone.choice(_key(rows=2048, k=1024)) is None
    for other in (dict(kernel="w8a8", bits=8), dict(bits=8), dict(dtype="bfloat16")):
        assert table.choice(_key(rows=2048, k=1024, **other)) is None, other
    agree = dt.from_json(dt.to_json(DEVICE, [(_key(rows=16, k=k), KERNEL_FASTER) for k in (256, 512)]))
    assert agree.choice(_key(rows=8, k=4096, group=None)) == "pallas"


def test_dispatch_follows_the_inferred_path():
    x, w = _product(rows=3)
    neighbours = [(_key(k=k, n=n), XLA_FASTER) for k, n in ((512, 64), (256, 128))]
    with config.interpret(True):
        with dt.use(dt.from_json(dt.to_json(DEVICE, neighbours))):
            assert not _uses_kernel(x, w)
        with dt.use(dt.from_json(dt.to_json(DEVICE, neighbours[:1]))):
            assert _uses_kernel(x, w)


def test_k_major_products_are_measured_apart_from_the_n_major_kernel():
    """An int8 product stored K-major (the decode layout on a GPU) is another kernel: the (K, N) kernel's
    verdict does not send it to XLA; its own ("weight_only_nk") does."""
    from llmeq_jax import decode_layout

    w = quantize(jax.random.normal(jax.random.key(0), (256, 64)) * 0.1, Spec(bits=8, granularity="channel"))
    x, w_nk = jnp.ones((3, 256)), decode_layout.transpose_kernel(w)
    with config.interpret(True):
        with dt.use(_table(XLA_FASTER, _key(bits=8, group=None))):
            assert kernel_dispatch.linear(x, w) is None
            assert kernel_dispatch.linear(x, w_nk, w_layout="nk") is not None
        with dt.use(_table(XLA_FASTER, _key(kernel="weight_only_nk", bits=8, group=None))):
            assert kernel_dispatch.linear(x, w) is not None
            assert kernel_dispatch.linear(x, w_nk, w_layout="nk") is None


def test_a_table_of_another_device_is_ignored_with_a_warning():
    x, w = _product()
    other = dt.from_json(dt.to_json("Other GPU", [(_key(device="Other GPU"), TIMES)]), "other.json")
    with config.interpret(True), dt.use(other), pytest.warns(UserWarning, match="measured on 'Other GPU'"):
        assert _uses_kernel(x, w)


def test_the_environment_variable_activates_a_table(tmp_path, monkeypatch):
    x, w = _product()
    path = tmp_path / "table.json"
    path.write_text(json.dumps(dt.to_json(DEVICE, [(_key(), TIMES)])))
    monkeypatch.setenv(dt.ENV, str(path))
    assert dt.active().entries == dt.load(path).entries
    with config.interpret(True):
        assert not _uses_kernel(x, w)
    monkeypatch.setenv(dt.ENV, str(tmp_path / "gone.json"))
    with pytest.raises(dt.DispatchTableError, match="does not exist"):
        dt.active()


def test_bench_kernels_writes_a_table_dispatch_reads(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parents[1] / "scripts/bench_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fast, slow = bench.table_key("w4g128", 4096, 4096, 3), bench.table_key("w8a8", 4096, 11008, 2048)
    assert (fast.kernel, fast.bits, fast.group, fast.rows, fast.dtype) == ("weight_only", 4, 128, 4, "bfloat16")
    assert (slow.kernel, slow.bits, slow.group) == ("w8a8", 8, None)
    words = bench.table_key("w4_words", 4096, 14336, 16)  # the word layout: its own kernel in the table
    assert (words.kernel, words.bits, words.group, words.rows) == ("int4_words", 4, 128, 16)
    in_place = bench.table_key("bf16_stack", 4096, 4096, 1)
    assert (in_place.kernel, in_place.bits, in_place.group) == ("float", 16, None)
    path = tmp_path / "dispatch.json"
    bench.write_table(path, [(fast, {"pallas_s": 1.0, "xla_s": 2.0, "bf16_s": 3.0}),
                             (slow, {"pallas_s": 5.0, "xla_s": 4.0, "bf16_s": 3.0})])
    assert "slower than bf16 in 1: w8a8/8 4096x11008 M=2048" in capsys.readouterr().out
    table = dt.load(path)
    assert table.choice(fast) == "pallas" and table.choice(slow) == "xla"


def test_bench_kernels_times_variants_in_turns_each_on_its_own_inputs():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parents[1] / "scripts/bench_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []

    def variant(name):
        def fn(x, w):
            seen.append((name, x.shape, w.shape))  # traced once per variant
            return x @ w
        return fn

    small = [(jnp.ones((1, 8)), jnp.ones((8, 4)))] * 2
    wide = [(jnp.ones((1, 16)), jnp.ones((16, 32)))] * 2
    bench.ROUNDS = 2  # this module instance's own copy: nothing else sees it
    times = bench.timed_round_robin({"a": (variant("a"), small), "b": (variant("b"), wide)}, reps=2)
    assert set(times) == {"a", "b"} and all(0 < t < float("inf") for t in times.values())
    assert {(n, x, w) for n, x, w in seen} == {("a", (1, 8), (8, 4)), ("b", (1, 16), (16, 32))}


def test_a_shipped_table_applies_on_its_device_unless_turned_off(monkeypatch):
    """llmeq_jax/dispatch_tables/<device>.json is read by itself on that device; an active table wins;
    LLMEQ_DISPATCH_TABLE=none turns it off."""
    monkeypatch.delenv(dt.ENV, raising=False)
    h200 = dt.shipped("NVIDIA H200")
    assert h200 is not None and h200.device == "NVIDIA H200" and len(h200.entries) >= 18
    assert dt.shipped_path("NVIDIA H200").name == "NVIDIA_H200.json"
    assert dt.shipped("No Such GPU") is None
    prefill = dt.Key("NVIDIA H200", "weight_only", 4, 128, 4096, 4096, 2048, "bfloat16")
    decode = dataclasses.replace(prefill, rows=1)
    # what the H200 measured: XLA's dequantize + dot beats the int4 kernel at prefill, not at decode
    assert h200.choice(prefill) == "xla" and h200.choice(decode) == "pallas"
    assert dt.choice(prefill) == "xla" and dt.choice(decode) == "pallas"
    assert dt.choice(dataclasses.replace(prefill, device="No Such GPU")) is None
    with dt.use(dt.from_json(dt.to_json("NVIDIA H200", [(prefill, TIMES | {"pallas_s": 1e-9})]))):
        assert dt.choice(prefill) == "pallas"
    monkeypatch.setenv(dt.ENV, dt.OFF)
    assert dt.active() is None and dt.choice(prefill) is None


H100 = "NVIDIA H100 80GB HBM3"


def _gpu(kind, cc="9.0", cores=132):
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc, core_count=cores)


def test_where_no_table_ships_for_a_gpu_the_one_of_its_architecture_applies(monkeypatch):
    """No table ships for the H100: traced for one (compute capability 9.0, 132 SMs, as the H200 table's header
    records), dispatch reads the H200's measurements as the H100's, with one warning naming them; a GPU of
    another SM count or compute capability, or one that does not say, gets none (the static rule)."""
    monkeypatch.delenv(dt.ENV, raising=False)
    assert not dt.shipped_path(H100).exists()  # else this test tests nothing
    assert dt.shipped("NVIDIA H200").architecture == ("9.0", 132)
    prefill = dt.Key(H100, "weight_only", 4, 128, 4096, 4096, 2048, "bfloat16")
    decode = dataclasses.replace(prefill, rows=1)
    dt.shipped.cache_clear()  # its one warning again
    with config.compiling_for(_gpu(H100)), pytest.warns(UserWarning, match=r"NVIDIA_H200.json applies"):
        assert dt.choice(prefill) == "xla" and dt.choice(decode) == "pallas"  # the H200's verdicts
    table = dt.shipped(H100, ("9.0", 132))
    assert table.device == H100 and all(k.device == H100 for k in table.entries)
    assert dt.describe(_gpu(H100)).startswith(f"{dt.shipped_path('NVIDIA H200')} (measured on 'NVIDIA H200'")
    assert dt.describe(_gpu(H100, cores=114)) == "none (the static kernel rule)"
    with dt.use(_table(TIMES)):  # an active table of this (CPU) device: it, and never on the GPU
        assert dt.describe(jax.devices()[0]) == "in memory, 1 products"
        assert dt.describe(_gpu(H100)) == "none (the static kernel rule)"
    assert len(table.entries) == len(dt.shipped("NVIDIA H200").entries) and "NVIDIA H200" in table.source
    for other in (_gpu(H100, cores=114), _gpu(H100, cc="8.0"),
                  types.SimpleNamespace(platform="gpu", device_kind=H100, compute_capability="9.0")):
        with config.compiling_for(other):
            assert dt.choice(prefill) is None
    # a kernel_dispatch decision under it: the H200's verdict on an int8 decode product whose neighbours disagree
    # (XLA at 4096 x 11008), where the static rule takes the kernel for any product of 2**23 weights or more
    w = quantize(jnp.ones((4096, 11008), jnp.float32), Spec(bits=8, granularity="channel"))
    assert dt.shipped("NVIDIA H200").choice(dataclasses.replace(
        kernel_dispatch.table_key("weight_only", 1, jnp.bfloat16, w, None), device="NVIDIA H200")) == "xla"
    with config.compiling_for(_gpu(H100)):  # (the table's one warning was given above)
        assert not kernel_dispatch.kernel_takes("weight_only", 1, jnp.bfloat16, w, None)
    with config.compiling_for(_gpu(H100, cores=114)):
        assert kernel_dispatch.kernel_takes("weight_only", 1, jnp.bfloat16, w, None)


def test_merge_over_the_shipped_table_of_the_measured_gpus_architecture(tmp_path, monkeypatch):
    """``merge --over-shipped`` (gpu_session.sh's e2e step): measurements of a GPU no table ships for, their header
    naming its architecture, go over the table of that architecture, its entries as this GPU's."""
    monkeypatch.delenv(dt.ENV, raising=False)
    h200 = dt.shipped("NVIDIA H200")
    mine = dt.Key(H100, "decode_hopper", 4, 128, 4096, 4096, 1, "bfloat16")
    measured, into = tmp_path / "new.json", tmp_path / "merged.json"
    measured.write_text(json.dumps(dt.to_json(H100, [(mine, TIMES)], compute_capability="9.0", core_count=132)))
    dt.shipped.cache_clear()  # its one warning again
    with pytest.warns(UserWarning, match="NVIDIA_H200.json applies"):
        dt.main(["merge", str(measured), "--over-shipped", "--into", str(into)])
    merged = dt.load(into)
    assert merged.device == H100 and merged.architecture == ("9.0", 132)
    assert set(merged.entries) == {dataclasses.replace(k, device=H100) for k in h200.entries} | {mine}
    into.unlink()  # without the flag, or without the header's record: the measurements alone
    dt.main(["merge", str(measured), "--into", str(into)])
    assert set(dt.load(into).entries) == {mine}


def test_bench_kernels_int4_rows_in_xla_equal_the_dequantized_product():
    """bench_kernels' w4_xla_rows kind: int4 weights K-major as jnp.int4 with group scales, one multiply-reduce."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parents[1] / "scripts/bench_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    w = jax.random.normal(jax.random.key(0), (256, 48), jnp.float32)
    q = quantize(w, Spec(bits=4, granularity="group", group_size=bench.GROUP))
    x = jax.random.normal(jax.random.key(1), (3, 256), jnp.float32)
    got = bench.xla_int4_rows(x, q.values().T.astype(jnp.int4), q.scale.T)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ q.dequantize(jnp.float32)), rtol=1e-5, atol=1e-5)


def test_no_inference_for_a_product_far_smaller_than_those_measured():
    table = dt.from_json(dt.to_json(DEVICE, [(_key(rows=16, k=k, n=256), KERNEL_FASTER) for k in (1024, 2048)]))
    assert table.choice(_key(rows=16, k=512, n=256)) == "pallas"  # half the smallest: still inferred
    assert table.choice(_key(rows=16, k=256, n=256)) is None
