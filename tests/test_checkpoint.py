import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import checkpoint as ck
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, Rule, quantize_params


def _params(k=512, n=1024):
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    return {
        "layers_0": {
            "q_proj": {"kernel": jax.random.normal(k1, (k, n)), "bias": jax.random.normal(k2, (n,))},
            "o_proj": {"kernel": jax.random.normal(k2, (n, k)).astype(jnp.bfloat16)},
        },
        "norm": {"scale": jnp.ones((k,))},
    }


def _recipe(spec, act=None, act_static=False):
    return Recipe((Rule(".*/kernel", weight=spec, act=act, act_static=act_static),), name="t")


def _tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: isinstance(x, QArray))
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: isinstance(x, QArray))
    assert ta == tb
    for x, y in zip(la, lb):
        if isinstance(x, QArray):
            assert isinstance(y, QArray) and (x.bits, x.shape, x.tile, x.dtype, x.pack_axis, x.act_spec) == (
                y.bits, y.shape, y.tile, y.dtype, y.pack_axis, y.act_spec)
            for c in ("qvalue", "scale", "zero_point", "act_scale"):
                cx, cy = getattr(x, c), getattr(y, c)
                assert (cx is None) == (cy is None)
                if cx is not None:
                    assert cx.dtype == cy.dtype and np.array_equal(np.asarray(cx), np.asarray(cy))
        else:
            assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "spec,act,static",
    [
        (Spec(8), None, False),
        (Spec(4, "group", group_size=128), None, False),
        (Spec(4, "group", group_size=100, symmetric=False), None, False),
        (Spec(2, "group", group_size=64), None, False),
        (Spec(3, "group", group_size=64, symmetric=False), None, False),
        (Spec(8), Spec(8, "token"), False),
        (Spec(8), Spec(8, "tensor"), True),
    ],
)
def test_round_trip_is_bit_exact(tmp_path, spec, act, static):
    params = _params()
    stats = {p: {"absmax": jnp.full((params["layers_0"][m]["kernel"].shape[0],), 3.0)}
             for m in ("q_proj", "o_proj") for p in [f"layers_0/{m}/kernel"]}
    qp = quantize_params(params, _recipe(spec, act, static), stats=stats)
    out = ck.save(tmp_path / "ckpt", qp, recipe=_recipe(spec, act, static), metadata={"model_type": "llama"})
    back = ck.restore(out)
    _tree_equal(qp, back)
    meta = ck.metadata(out)
    assert meta["metadata"] == {"model_type": "llama"}
    assert meta["recipe"]["rules"][0]["weight"]["bits"] == spec.bits
    if static:
        assert back["layers_0"]["q_proj"]["kernel"].act_scale is not None


def test_disk_ratios(tmp_path):
    params = {"l": {"kernel": jax.random.normal(jax.random.key(1), (1024, 1024))}}
    fp = ck.disk_bytes(ck.save(tmp_path / "fp", params))
    w8 = ck.disk_bytes(ck.save(tmp_path / "w8", quantize_params(params, _recipe(Spec(8)))))
    w4 = ck.disk_bytes(ck.save(tmp_path / "w4", quantize_params(params, _recipe(Spec(4, "group", group_size=128)))))
    # int8 ~ 1/4 of fp32; int4 g128 ~ 1/8 plus one fp32 scale per 128 values (+3%).
    assert 0.20 <= w8 / fp <= 0.27, w8 / fp
    assert 0.10 <= w4 / fp <= 0.145, w4 / fp


def test_restore_into_abstract_tree_with_sharding(tmp_path):
    qp = quantize_params(_params(), _recipe(Spec(4, "group", group_size=128)))
    out = ck.save(tmp_path / "c", qp)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = ck.abstract_tree(out, shardings=sharding)
    k = abstract["layers_0"]["q_proj"]["kernel"]
    assert isinstance(k, QArray) and isinstance(k.qvalue, jax.ShapeDtypeStruct)
    assert k.qvalue.shape == (256, 1024) and k.qvalue.dtype == jnp.uint8
    back = ck.restore(out, abstract)
    _tree_equal(qp, back)
    assert back["layers_0"]["q_proj"]["kernel"].qvalue.sharding == sharding


def test_existing_directory_is_not_overwritten_silently(tmp_path):
    params = _params(64, 32)
    ck.save(tmp_path / "c", params)
    with pytest.raises(ck.CheckpointError, match="already exists"):
        ck.save(tmp_path / "c", params)
    ck.save(tmp_path / "c", quantize_params(params, _recipe(Spec(8))), overwrite=True)
    assert isinstance(ck.restore(tmp_path / "c")["layers_0"]["q_proj"]["kernel"], QArray)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        ck.save(tmp_path / "c", _params(64, 32), metadata={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_unwritable_parent_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ck.CheckpointError, match="cannot create"):
        ck.save(blocker / "c", _params(64, 32))


def test_other_format_version_is_refused(tmp_path):
    out = ck.save(tmp_path / "c", _params(64, 32))
    manifest = json.loads((out / ck.MANIFEST).read_text())
    manifest["format_version"] = ck.FORMAT_VERSION + 1
    (out / ck.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match=r"format version 2.*reads version 1"):
        ck.restore(out)


def test_missing_or_foreign_directory(tmp_path):
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.restore(tmp_path / "nope")
    (tmp_path / "foreign").mkdir()
    with pytest.raises(ck.CheckpointError, match="not an llmeq_jax checkpoint"):
        ck.restore(tmp_path / "foreign")


# --------------------------------------------------------------------------- content hashes, safe replacement


def _array_files(out):
    return sorted(f for f in (out / ck.ARRAYS).rglob("*") if f.is_file() and f.stat().st_size > 0)


def test_every_file_is_hashed_and_verified(tmp_path):
    out = ck.save(tmp_path / "c", quantize_params(_params(64, 32), _recipe(Spec(4, "group", group_size=16))))
    manifest = json.loads((out / ck.MANIFEST).read_text())
    on_disk = {f.relative_to(out).as_posix() for f in out.rglob("*") if f.is_file()}
    assert set(manifest["files"]) == on_disk - {ck.MANIFEST, ck.MANIFEST_HASH}
    assert ck.verify(out) == len(manifest["files"]) + 1


@pytest.mark.parametrize("damage", ["flip one bit", "truncate", "delete"])
def test_damaged_array_file_is_one_error_naming_it(tmp_path, damage):
    out = ck.save(tmp_path / "c", _params(64, 32))
    victim = max(_array_files(out), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    if damage == "flip one bit":
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    rel = victim.relative_to(out).as_posix()
    for check in (ck.verify, ck.restore):
        with pytest.raises(ck.CheckpointError, match=re.escape(rel)) as e:
            check(out)
        assert "\n" not in str(e.value)
    with pytest.raises(ck.CheckpointError, match=re.escape(rel)):
        ck.check_files_present(out) if damage != "flip one bit" else ck.verify(out)


def test_restore_without_verification_still_fails_as_one_error(tmp_path):
    out = ck.save(tmp_path / "c", _params(64, 32))
    for f in _array_files(out):
        f.write_bytes(b"\0" * 7)
    with pytest.raises(ck.CheckpointError, match="could not restore the arrays") as e:
        ck.restore(out, verify_hashes=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["metadata"]["model_config"].update(num_layers=1), "num_layers=1 but the arrays hold 2 layers"),
        (lambda m: m["layout"]["layers_0/q_proj/kernel"]["static"].update(bits=9), "bits=9"),
        (lambda m: m["layout"]["layers_0/q_proj/kernel"]["static"].update(bits=4), "qvalue shape"),
        (lambda m: m["layout"]["layers_0/q_proj/kernel"]["static"].update(shape=[64, 16]), "scale shape"),
        (lambda m: m["layout"]["norm/scale"].update(shape=[-1]), "not a list of sizes"),
        (lambda m: m["layout"]["norm/scale"].update(kind="tensor"), "expected 'array' or 'qarray'"),
        (lambda m: m.update(layout=[]), "layout is not a mapping"),
    ],
)
def test_edited_manifest_is_caught_by_its_hash_and_by_validation(tmp_path, edit, match):
    params = quantize_params(_params(64, 32), _recipe(Spec(8)))
    params["layers_1"] = params["layers_0"]
    out = ck.save(tmp_path / "c", params, metadata={"model_config": {"num_layers": 2}})
    manifest = json.loads((out / ck.MANIFEST).read_text())
    edit(manifest)
    (out / ck.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match=match):  # checked even without the hashes
        ck.restore(out, verify_hashes=False)


def test_a_3_bit_checkpoint_in_4_bit_slots_is_refused_with_the_reason(tmp_path):
    """Older llmeq_jax stored 3-bit values two per byte, as int4: such a leaf is a clear error, not garbage."""
    out = ck.save(tmp_path / "c", quantize_params(_params(64, 32), _recipe(Spec(4, "group", group_size=32))))
    manifest = json.loads((out / ck.MANIFEST).read_text())
    manifest["layout"]["layers_0/q_proj/kernel"]["static"]["bits"] = 3  # what an old 3-bit leaf looks like
    (out / ck.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match="eight per three bytes.*4-bit slots.*quantize the model again"):
        ck.restore(out, verify_hashes=False)


def test_edited_manifest_that_still_validates_fails_its_hash(tmp_path):
    out = ck.save(tmp_path / "c", _params(64, 32), recipe={"name": "a"})
    (out / ck.MANIFEST).write_text((out / ck.MANIFEST).read_text().replace('"a"', '"b"'))
    with pytest.raises(ck.CheckpointError, match="manifest.json does not match its sha256"):
        ck.restore(out)


def test_overwrite_replaces_only_our_checkpoints(tmp_path):
    other = tmp_path / "data"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(ck.CheckpointError, match="not an llmeq_jax checkpoint"):
        ck.save(other, _params(64, 32), overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointError, match="not a directory"):
        ck.save(tmp_path / "file", _params(64, 32), overwrite=True)
    assert (other / "precious.txt").read_text() == "keep me" and (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "file"]


def test_final_rename_never_replaces_a_directory_that_appeared_meanwhile(tmp_path, monkeypatch):
    """Two writers both pass the existence check: the second must fail, not replace the first."""
    first = tmp_path / "c"
    real_move = ck._move_into_place

    def other_writer_finishes_first(tmp, path, overwrite):
        monkeypatch.setattr(ck, "_move_into_place", real_move)
        ck.save(first, {"w": jnp.zeros(3)})  # the other writer's checkpoint lands now
        return real_move(tmp, path, overwrite)

    monkeypatch.setattr(ck, "_move_into_place", other_writer_finishes_first)
    with pytest.raises(ck.CheckpointError, match="could not write checkpoint|appeared while saving"):
        ck.save(first, _params(64, 32))
    monkeypatch.undo()
    assert set(ck.restore(first)) == {"w"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the loser's temp dir is gone


def test_stale_temporaries_of_killed_saves_are_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / ".c.tmp-dead"
    stale.mkdir()
    (stale / ck.WRITER).write_text(json.dumps({"host": ck.socket.gethostname(), "pid": dead.pid}))
    live = tmp_path / ".c.tmp-live"
    live.mkdir()
    (live / ck.WRITER).write_text(json.dumps({"host": ck.socket.gethostname(), "pid": ck.os.getpid()}))
    foreign = tmp_path / ".c.tmp-foreign"  # not ours: no writer marker
    foreign.mkdir()
    ck.save(tmp_path / "c", _params(64, 32))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.tmp-foreign", ".c.tmp-live", "c"]
