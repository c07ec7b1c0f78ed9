"""Issue 19 replayed: bad or odd input gives one clear error (exit 2) or a correct result --
never a traceback, never a silent wrong number, never a write or delete outside the named output.

Each test is a row of the README's reliability table. The CLI runs in-process (``cli.main``)
on the real stories260K model; the property-based fuzz at the end throws random recipe
YAML and CLI arguments at it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmeq_jax import checkpoint, cli
from llmeq_jax.core.quantize import Spec, quantize
from tests.shared_data import shared_data_path

MODEL = str(shared_data_path("stories260K.gguf"))
TEXT = str(shared_data_path("wikitext2_test.txt"))
CALIB = str(shared_data_path("wikitext2_valid.txt"))
FAST_EVAL = ["--text", TEXT, "--seq-len", "32", "--windows", "1"]


def run(capsys, *args):
    """(exit status, stdout, stderr) of ``llmeq ARGS`` run in-process."""
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *needles):
    """Exit 2 and one error line, last on stderr (progress lines such as "== recipe" may precede it)."""
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ": error:" in ln]
    assert rc == 2, err
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("llmeq"), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], errors[0]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its content (None for directories): a snapshot to diff."""
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def w8(tmp_path_factory):
    out = tmp_path_factory.mktemp("rel") / "w8"
    assert cli.main(["quantize", MODEL, "--recipe", "rtn-w8", "--out", str(out), "--json"]) == 0
    return out


@pytest.fixture
def ckpt(w8, tmp_path):
    """A private copy of the rtn-w8 checkpoint to damage."""
    return Path(shutil.copytree(w8, tmp_path / "ckpt"))


def _biggest_array_file(ckpt: Path) -> Path:
    return max((f for f in (ckpt / checkpoint.ARRAYS).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


# --------------------------------------------------------------------------- 1, 2: paths


def test_compare_recipe_name_cannot_leave_out_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "ckpt-x"  # what `out/ckpt-../x` used to name, then delete
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "../x", "method": "rtn",
                                      "rules": [{"pattern": ".*/kernel", "weight": {"bits": 8}}]}))
    rc, out, err = run(capsys, "compare", MODEL, "--recipes", recipe, "--out-dir", "out", *FAST_EVAL,
                       "--no-speed", "--keep-checkpoints", "--json")
    assert rc == 0, err
    assert (victim / "precious.txt").read_text() == "keep"
    kept = [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("ckpt-")]
    assert kept == ["ckpt-_x"] and checkpoint.is_checkpoint(tmp_path / "out" / "ckpt-_x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-x", "out", "r.yaml"]


def test_overwrite_never_deletes_the_current_directory_or_foreign_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"\xff\xd8")
    before = tree(tmp_path)
    rc, _, err = run(capsys, "quantize", MODEL, "--recipe", "rtn-w8", "--out", ".", "--overwrite")
    assert_one_line_error(rc, err, "current directory")
    rc, _, err = run(capsys, "quantize", MODEL, "--recipe", "rtn-w8", "--out", "photos", "--overwrite")
    assert_one_line_error(rc, err, "not an llmeq_jax checkpoint")
    rc, _, err = run(capsys, "convert", MODEL, "photos", "--overwrite")
    assert_one_line_error(rc, err, "not an llmeq_jax checkpoint")
    assert tree(tmp_path) == before


def test_overwrite_replaces_a_checkpoint_of_ours(w8, tmp_path, capsys):
    out = Path(shutil.copytree(w8, tmp_path / "c"))
    rc, _, err = run(capsys, "quantize", MODEL, "--recipe", "rtn-w4-g128", "--out", out, "--overwrite", "--json")
    assert rc == 0, err
    assert checkpoint.metadata(out)["recipe"]["name"] == "rtn-w4-g128" and checkpoint.verify(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_compare_error_leaves_no_empty_out_dir(tmp_path, capsys, monkeypatch):
    def fail(*a, **k):
        raise ZeroDivisionError("simulated failure inside the recipe loop")

    monkeypatch.setattr(cli, "run_recipe", fail)  # the name the CLI calls (imported from pipeline)
    out = tmp_path / "new" / "deeper"
    rc, _, err = run(capsys, "compare", MODEL, "--recipes", "rtn-w8", "--out-dir", out, *FAST_EVAL, "--no-speed")
    assert_one_line_error(rc, err, "ZeroDivisionError", "simulated failure")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- 3: damaged checkpoints


@pytest.mark.parametrize("damage", ["flip bytes", "flip one bit", "truncate", "delete"])
def test_damaged_array_file_is_one_error_naming_the_file(ckpt, capsys, damage):
    victim = _biggest_array_file(ckpt)
    data = bytearray(victim.read_bytes())
    if damage == "flip bytes":
        data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
    elif damage == "flip one bit":
        data[len(data) // 3] ^= 0x10
    if damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(bytes(data))
    name = victim.relative_to(ckpt).as_posix()
    rc, _, err = run(capsys, "eval", ckpt, *FAST_EVAL)
    assert_one_line_error(rc, err, name)
    rc, _, err = run(capsys, "generate", ckpt, "--prompt", "Once", "--max-new-tokens", "2")
    assert_one_line_error(rc, err, name)
    rc, _, err = run(capsys, "inspect", ckpt, "--verify")
    assert_one_line_error(rc, err, name)
    if damage in ("truncate", "delete"):  # sizes are checked even without --verify
        rc, _, err = run(capsys, "inspect", ckpt)
        assert_one_line_error(rc, err, name)


@pytest.mark.parametrize("field, value, needle", [("num_layers", 1, "num_layers=1"), ("bits", 9, "bits=9"),
                                                   ("bits", 4, "qvalue shape")])
def test_edited_manifest_is_an_error_with_and_without_verification(ckpt, capsys, field, value, needle):
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    if field == "num_layers":
        manifest["metadata"]["model_config"]["num_layers"] = value
    else:
        leaf = next(v for v in manifest["layout"].values() if v["kind"] == "qarray")
        leaf["static"]["bits"] = value
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    for extra in ([], ["--no-verify"]):
        rc, _, err = run(capsys, "eval", ckpt, *FAST_EVAL, *extra)
        assert_one_line_error(rc, err, needle)
    rc, _, err = run(capsys, "inspect", ckpt)
    assert_one_line_error(rc, err, needle)


def test_intact_checkpoint_verifies_and_evaluates(w8, capsys):
    rc, out, err = run(capsys, "inspect", w8, "--verify")
    assert rc == 0 and "files verified (sha256)" in out, err
    rc, out, err = run(capsys, "eval", w8, *FAST_EVAL, "--json")
    assert rc == 0 and math.isfinite(json.loads(out)["rows"][0]["ppl"]), err


# --------------------------------------------------------------------------- 4, 5: arguments


@pytest.mark.parametrize(
    "args, needles",
    [
        (["eval", MODEL, *FAST_EVAL, "--batch-size", "-2"], ["--batch-size", ">= 1"]),
        (["eval", MODEL, *FAST_EVAL, "--batch-size", "0"], ["--batch-size"]),
        (["eval", MODEL, "--text", TEXT, "--seq-len", "4096"], ["--seq-len 4096", "context of 2048"]),
        (["eval", MODEL, "--text", TEXT, "--seq-len", "1"], ["--seq-len", ">= 2"]),
        (["eval", MODEL, *FAST_EVAL, "--windows", "-1"], ["--windows"]),
        (["eval", MODEL, *FAST_EVAL, "--kv-budget-gb", "nan"], ["--kv-budget-gb", "not finite"]),
        (["generate", MODEL, "--prompt", "a", "--temperature", "nan"], ["--temperature", "not finite"]),
        (["generate", MODEL, "--prompt", "a", "--temperature", "inf"], ["--temperature", "not finite"]),
        (["generate", MODEL, "--prompt", "a", "--temperature", "-1"], ["--temperature"]),
        (["generate", MODEL, "--prompt", "a", "--top-p", "0"], ["--top-p"]),
        (["generate", MODEL, "--prompt", "a", "--top-p", "nan"], ["--top-p"]),
        (["generate", MODEL, "--prompt", "a", "--top-k", "-3"], ["--top-k"]),
        (["generate", MODEL, "--prompt", "a", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["generate", MODEL, "--prompt", "a", "--max-new-tokens", "5000"], ["context of 2048"]),
        (["generate", MODEL, "--prompt", "a", "--seed", "99999999999999999999"], ["--seed", "out of range"]),
        (["generate", MODEL, "--prompt", "a", "--seed", "-1"], ["--seed"]),
        (["generate", MODEL, "--prompt", "", "--no-bos"], ["--prompt is empty"]),
        (["quantize", MODEL, "--recipe", "smoothquant-w8a8", "--out", "x", "--calib-seq-len", "0"],
         ["--calib-seq-len"]),
        (["quantize", MODEL, "--recipe", "smoothquant-w8a8", "--out", "x", "--calib-samples", "0"],
         ["--calib-samples"]),
        (["eval"], ["model"]),
        (["frobnicate"], ["frobnicate"]),
    ],
)
def test_bad_argument_is_one_clear_error_before_any_work(args, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, *args)
    assert_one_line_error(rc, err, *needles)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_temperature_zero_is_greedy(capsys):
    prompt = ["generate", MODEL, "--prompt", "Once upon", "--max-new-tokens", "6", "--json"]
    greedy = run(capsys, *prompt)
    zero = run(capsys, *prompt, "--temperature", "0")
    sampled = run(capsys, *prompt, "--temperature", "5", "--seed", "3")
    assert greedy[0] == zero[0] == sampled[0] == 0
    assert json.loads(greedy[1])["tokens"] == json.loads(zero[1])["tokens"]
    assert json.loads(greedy[1])["tokens"] != json.loads(sampled[1])["tokens"]  # the old 0 -> 1.0 sampled


def test_generated_text_keeps_the_space_after_the_prompt(capsys):
    """The printed text is exactly the prompt followed by the new SentencePiece pieces ("▁" = a space)."""
    from llmeq_jax.models import load_model

    args = ("generate", MODEL, "--prompt", "Once upon", "--max-new-tokens", "3")
    rc, out, err = run(capsys, *args)
    assert rc == 0, err
    rc, js, err = run(capsys, *args, "--json")
    assert rc == 0, err
    tokens = json.loads(js)["tokens"]
    pieces = load_model(MODEL)[2].convert_ids_to_tokens(tokens)
    expected = "Once upon" + "".join(pieces).replace("\u2581", " ")
    assert out == expected + "\n" and json.loads(js)["text"] == expected  # was "Once upona time"
    assert expected.startswith("Once upon a")


@pytest.mark.parametrize("exc", [TypeError, IndexError, OverflowError, ZeroDivisionError, KeyError, RuntimeError])
def test_any_exception_is_one_line_and_exit_2(exc, capsys, monkeypatch):
    def boom(args):
        raise exc("deep inside\nsecond line")

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    rc, _, err = run(capsys, "inspect", "x")
    assert_one_line_error(rc, err, exc.__name__)
    monkeypatch.setenv("LLMEQ_DEBUG", "1")
    rc, _, err = run(capsys, "inspect", "x")
    assert rc == 2 and "Traceback" in err and "second line" in err


# --------------------------------------------------------------------------- 6: quantize()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_rejects_non_finite_input(bad):
    x = np.ones((8, 4), np.float32)
    x[3, 1] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, Spec(8, symmetric=False))
    deq = np.asarray(quantize(x, Spec(8, symmetric=False), nan_policy="propagate").dequantize())
    assert np.isnan(deq[:, 1]).all() and (deq[:, [0, 2, 3]] == 1).all()  # never a silent 0


def test_quantize_empty_and_extreme_input():
    assert quantize(np.zeros((0, 8), np.float32), Spec(8)).dequantize().shape == (0, 8)
    big = float(np.finfo(np.float32).max)
    x = np.array([[big, -big, 0.5]], np.float32).T
    deq = np.asarray(quantize(x, Spec(8, "tensor", symmetric=False)).dequantize())
    assert np.isfinite(deq).all() and abs(float(deq[0, 0]) - big) / big < 0.01


# --------------------------------------------------------------------------- property-based fuzz

FUZZ = settings(max_examples=8, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

odd_text = st.one_of(st.sampled_from(["../x", "/abs", ".", "..", "a/b", ".hidden", "", " ", "rtn-w8", "ok_1",
                                      "é€", "a" * 300, "*?[", "-", "--x"]), st.text(max_size=12))
odd_number = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2, 3, 16, -1, 2048, 2049]),
                       st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["nan", "inf", "-inf",
                                                                                      "1e400", "x", "", "0x10"]))

rule = st.fixed_dictionaries(
    {"pattern": st.sampled_from([".*/kernel", ".*q_proj.*", "nothing", "(", ".*"])},
    optional={
        "weight": st.fixed_dictionaries({}, optional={
            "bits": st.one_of(st.sampled_from([2, 3, 4, 8, 9, 0, -1]), odd_number),
            "granularity": st.sampled_from(["channel", "group", "tensor", "token", "row", 3]),
            "group_size": st.one_of(st.sampled_from([16, 32, 0, -4]), odd_number),
            "symmetric": st.one_of(st.booleans(), st.just("yes")),
            "clip": st.one_of(st.none(), st.sampled_from([0.9, 0, 2, "mse", "p99", "p0", "q"])),
        }),
        "skip": st.booleans(),
    },
)
recipe_doc = st.fixed_dictionaries(
    {"rules": st.one_of(st.lists(rule, min_size=0, max_size=3), odd_text, st.none())},
    optional={"name": odd_text, "method": st.sampled_from(["rtn", "awq", "gptq", "nope", "", 5])},
)


@FUZZ
@example(doc={"name": "../up", "method": "rtn",  # a correct result (and a name that tried to escape)
              "rules": [{"pattern": ".*/kernel", "weight": {"bits": 4, "granularity": "group", "group_size": 16}}]})
@given(doc=st.one_of(recipe_doc, st.just("rules: [unclosed"), st.just("- a list\n- not a mapping\n")))
def test_fuzz_recipe_yaml_gives_clear_error_or_result_and_writes_only_under_out(doc, tmp_path_factory, capsys):
    root = tmp_path_factory.mktemp("fuzz")
    recipe = root / "r.yaml"
    recipe.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, allow_unicode=True))
    before = tree(root)
    rc, out, err = run(capsys, "compare", MODEL, "--recipes", recipe, "--out-dir", root / "out", *FAST_EVAL,
                       "--calib", CALIB, "--calib-samples", "1", "--calib-seq-len", "16", "--no-speed",
                       "--keep-checkpoints", "--json")
    after = {p: c for p, c in tree(root).items() if not (p == "out" or p.startswith("out/"))}
    assert after == before, "compare wrote or deleted outside --out-dir"
    if rc == 2:
        assert_one_line_error(rc, err)
    else:
        assert rc == 0, err
        row = json.loads(out)["rows"][0]
        assert math.isfinite(row["ppl"]) and row["ppl"] > 1
        assert [p.name for p in (root / "out").iterdir() if p.name.startswith("ckpt-")] != []


flag_values = {
    "--seq-len": odd_number, "--batch-size": odd_number, "--kv-budget-gb": odd_number,
    "--max-new-tokens": odd_number, "--temperature": odd_number, "--top-k": odd_number, "--top-p": odd_number,
    "--seed": odd_number, "--prompt": odd_text, "--kv": st.sampled_from(["int8", "int4", "int3", "kv4-w32", "x"]),
}
EVAL_FLAGS = ["--seq-len", "--batch-size", "--kv-budget-gb", "--kv"]  # --windows 0 (= all) would take minutes
GEN_FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--prompt", "--kv"]


@st.composite
def cli_args(draw):
    command = draw(st.sampled_from(["eval", "generate"]))
    flags = draw(st.lists(st.sampled_from(EVAL_FLAGS if command == "eval" else GEN_FLAGS), max_size=3, unique=True))
    args = [command, MODEL]
    args += ["--text", TEXT, "--windows", "1", "--seq-len", "32", "--json"] if command == "eval" else ["--prompt", "Once"]
    args += ["--max-new-tokens", "4"] if command == "generate" else []
    for flag in flags:  # later flags override the defaults above (argparse keeps the last)
        args += [flag, str(draw(flag_values[flag]))]
    if command == "generate" and draw(st.booleans()):
        args.append("--no-bos")
    return args


@FUZZ
@example(args=["eval", MODEL, "--text", TEXT, "--windows", "1", "--seq-len", "32", "--json", "--batch-size", "7"])
@example(args=["generate", MODEL, "--prompt", "Once", "--max-new-tokens", "4", "--temperature", "0.7"])
@given(args=cli_args())
def test_fuzz_cli_arguments_give_clear_error_or_sane_result(args, tmp_path_factory, capsys, monkeypatch):
    root = tmp_path_factory.mktemp("fuzzcli")
    monkeypatch.chdir(root)
    rc, out, err = run(capsys, *args, "--calib", CALIB)
    assert list(root.iterdir()) == [], "eval/generate wrote files"
    if rc == 2:
        assert_one_line_error(rc, err)
        return
    assert rc == 0, err
    if args[0] == "eval":
        row = json.loads(out)["rows"][0]
        assert math.isfinite(row["ppl"]) and row["ppl"] > 1 and row["extra"]["tokens"] > 0
    else:
        prompt = args[len(args) - 1 - args[::-1].index("--prompt") + 1]
        assert out.startswith(prompt) and "\ufffd" not in out[len(prompt):len(prompt) + 1]
