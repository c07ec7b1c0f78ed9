"""End to end through the `llmeq` command (subprocesses) on the real stories260K model."""

import json
import math
import os
import stat
import subprocess
import sys

import pytest

from tests.shared_data import shared_data_path

MODEL = str(shared_data_path("stories260K.gguf"))
TEXT = str(shared_data_path("wikitext2_test.txt"))


def llmeq(*args, check=True):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "llmeq_jax.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmeq {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def w8_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "w8"
    info = json.loads(llmeq("quantize", MODEL, "--recipe", "rtn-w8", "--out", str(out), "--json").stdout)
    assert info["recipe"] == "rtn-w8" and info["disk_bytes"] > 0 and info["quantize_s"] >= 0
    return out, info


def _eval(model):
    proc = llmeq("eval", model, "--text", TEXT, "--seq-len", "128", "--windows", "4", "--json")
    return json.loads(proc.stdout)


def test_quantize_inspect_eval_generate(w8_checkpoint):
    out, info = w8_checkpoint
    leaves = json.loads(llmeq("inspect", str(out), "--json").stdout)["leaves"]
    q = [r for r in leaves if r["kind"] == "qarray"]
    assert q and all(r["bits"] == 8 and r["grid"] == "uniform" and r["granularity"].startswith("per-channel") for r in q)
    # rtn-w8 quantizes the kernels and the token table (int8 per vocabulary row), nothing else.
    assert all(r["kind"] == "float" for r in leaves if not r["path"].endswith("/kernel") and r["path"] != "embed/embedding")
    assert any(r["path"] == "embed/embedding" and r["kind"] == "qarray" for r in leaves)
    assert "per-channel" in llmeq("inspect", str(out)).stdout

    fp, w8 = _eval(MODEL), _eval(str(out))
    for rep in (fp, w8):
        row = rep["rows"][0]
        assert rep["seq_len"] == 128 and rep["n_windows"] == 4 and row["extra"]["tokens"] == 4 * 127
        assert math.isfinite(row["ppl"]) and row["param_bytes"] > 0
        assert {"protocol", "machine", "versions", "peak_host_mb"} <= set(rep)
    assert w8["rows"][0]["param_bytes"] < 0.5 * fp["rows"][0]["param_bytes"]
    assert w8["rows"][0]["ppl"] < 1.1 * fp["rows"][0]["ppl"]

    text = llmeq("generate", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "12").stdout
    assert text.startswith("Once upon a time") and len(text.strip()) > len("Once upon a time")
    fast = llmeq("generate", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "12",
                 "--prompt-activation-bits", "8").stdout
    assert fast.startswith("Once upon a time") and len(fast.strip()) > len("Once upon a time")
    bad = llmeq("generate", str(out), "--prompt", "x", "--prompt-activation-bits", "4", check=False)
    assert bad.returncode == 2 and "--prompt-activation-bits" in bad.stderr


def test_dtype_bfloat16_loads_quantizes_and_evaluates_a_model_not_a_checkpoint(w8_checkpoint, tmp_path):
    """--dtype bfloat16: the float weights load in bf16 (about half the bytes, the perplexity within 1 %), a recipe
    quantizes them and the checkpoint loads as saved; --dtype on a checkpoint is one clear error."""
    fp = _eval(MODEL)
    bf = json.loads(llmeq("eval", MODEL, "--dtype", "bfloat16", "--text", TEXT, "--seq-len", "128", "--windows", "4",
                          "--json").stdout)
    assert 0.45 < bf["rows"][0]["param_bytes"] / fp["rows"][0]["param_bytes"] < 0.6
    assert bf["rows"][0]["ppl"] == pytest.approx(fp["rows"][0]["ppl"], rel=0.01)
    assert any("bfloat16 (--dtype)" in note for note in bf["notes"])
    out = tmp_path / "w8-bf16"
    llmeq("quantize", MODEL, "--recipe", "rtn-w8", "--dtype", "bfloat16", "--out", str(out), "--json")
    w8 = _eval(str(out))
    assert w8["rows"][0]["ppl"] == pytest.approx(bf["rows"][0]["ppl"], rel=0.05)
    proc = llmeq("eval", str(w8_checkpoint[0]), "--dtype", "bfloat16", "--text", TEXT, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "is a checkpoint" in lines[0], proc.stderr


def test_compare_writes_report_and_plots(tmp_path):
    out = tmp_path / "cmp"
    again = tmp_path / "again.txt"  # the evaluation text once more, as an extra text: the same perplexity
    again.write_text(open(TEXT).read())
    proc = llmeq("compare", MODEL, "--recipes", "fp32", "rtn-w4-g128", "--text", TEXT, "--seq-len", "128",
                 "--windows", "2", "--out-dir", str(out), "--json", "--extra-text", "pydoc-topics", str(again))
    rep = json.loads(proc.stdout)
    assert [r["recipe"] for r in rep["rows"]] == ["fp32", "rtn-w4-g128"]
    fp, w4 = rep["rows"]
    assert w4["param_bytes"] < fp["param_bytes"] and w4["disk_bytes"] < fp["disk_bytes"]
    assert math.isfinite(w4["ppl"]) and fp["ppl"] <= w4["ppl"] < 3 * fp["ppl"]
    assert w4["decode_tok_s"] > 0 and w4["prefill_tok_s"] > 0
    for name in ("report.json", "report.md", "ppl_vs_size.png", "time_breakdown.png", "weight_hist.png"):
        assert (out / name).stat().st_size > 0, name
    # Extra texts: a column each; the repeated text gives the main text's perplexity, the held-out one another.
    assert rep["extra_texts"] == ["pydoc-topics", "again"]
    for row in rep["rows"]:
        texts = row["extra"]["texts"]
        assert texts["again"]["ppl"] == pytest.approx(row["ppl"], rel=1e-6)
        assert math.isfinite(texts["pydoc-topics"]["ppl"]) and texts["pydoc-topics"]["ppl"] != row["ppl"]
        assert texts["pydoc-topics"]["tokens"] == 2 * 127
    header = (out / "report.md").read_text()
    assert "| ppl pydoc-topics | Δ% pydoc-topics | ppl again | Δ% again |" in header


@pytest.mark.parametrize(
    "args,msg",
    [
        (["eval", "/nonexistent/model.gguf", "--text", TEXT], "/nonexistent/model.gguf"),
        (["eval", MODEL, "--text", "/nonexistent.txt"], "evaluation text file '/nonexistent.txt' does not exist"),
        (["quantize", MODEL, "--recipe", "/nonexistent.yaml", "--out", "x"], "recipe file"),
        (["compare", MODEL, "--recipes", "fp32", "--extra-text", "nope.txt", "--out-dir", "x"],
         "--extra-text 'nope.txt' is neither a file nor the built-in held-out text 'pydoc-topics'"),
    ],
)
def test_bad_input_one_clear_error(args, msg, tmp_path):
    proc = llmeq(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], proc.stderr


def test_bad_recipe_and_unwritable_out_leave_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - pattern: '.*/kernel'\n    weight: {bits: 9}\n")
    out = tmp_path / "never"
    proc = llmeq("quantize", MODEL, "--recipe", str(bad), "--out", str(out), check=False)
    assert proc.returncode == 2 and "bits=9" in proc.stderr and not out.exists()

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions; a file in the way is unwritable for everyone
            blocker = tmp_path / "blocker"
            blocker.write_text("")
            target = blocker / "ckpt"
        else:
            target = locked / "ckpt"
        proc = llmeq("quantize", MODEL, "--recipe", "rtn-w8", "--out", str(target), check=False)
        assert proc.returncode == 2 and "error" in proc.stderr
        assert not target.exists()
        assert not [p for p in tmp_path.rglob(".*tmp*")]
    finally:
        locked.chmod(stat.S_IRWXU)


def test_xla_flag_runs_the_command_with_kernels_off(monkeypatch):
    from llmeq_jax import cli
    from pallas_kernels import config

    seen = []
    monkeypatch.setattr(cli, "cmd_inspect", lambda args: seen.append(config.kernels_available()) or 0)
    with config.interpret(True):  # kernels available here, as on a GPU
        assert cli.main(["--xla", "inspect", "somewhere"]) == 0
        assert cli.main(["inspect", "somewhere"]) == 0
        assert cli.main(["inspect", "somewhere", "--xla"]) == 0  # after the subcommand too
    assert seen == [False, True, False]


def test_help_names_defaults_positionals_and_the_main_recipes(capsys):
    from llmeq_jax import cli

    assert cli.main(["main", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(r in text for r in cli.MAIN_RECIPES)
    assert "windows to evaluate, 0 = all (default 16)" in text and "registry name" in text
    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--prompt PROMPT the text", "--max-new-tokens MAX_NEW_TOKENS >=", "--seed SEED sampling",
                 "--json print"):
        assert flag in text, flag
    assert cli.build_parser().parse_args(["convert", "a", "b", "--json"]).json


def test_generate_refuses_int8_prompt_activations_with_online_scales(tmp_path):
    """An act_ema recipe runs its own prefill (EMA state), which has no int8 prompt path: one clear error."""
    out = tmp_path / "online"
    llmeq("quantize", MODEL, "--recipe", "rtn-w8a8-online", "--out", str(out))
    bad = llmeq("generate", str(out), "--prompt", "Once", "--prompt-activation-bits", "8", check=False)
    assert bad.returncode == 2 and "act_ema" in bad.stderr and "--prompt-activation-bits" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
