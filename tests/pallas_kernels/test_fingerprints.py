"""A kernel checked on a GPU lowers as it did there, or the record says what changed since
(``pallas_kernels.fingerprints``, ``pallas_kernels/hardware_fingerprints.json``)."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from pallas_kernels import config, fingerprints, hardware_checked, int8_f16, settings


def test_every_checked_kernel_lowers_as_its_gpu_run_or_as_recorded_unrun():
    """The guard: a change to a checked kernel's lowering fails here until it is run on a GPU and recorded, or
    recorded as not yet run (its gpu cases then go first in the next GPU session)."""
    record = fingerprints.read()
    for kernel in record:
        odd = fingerprints.unexpected(kernel, record)
        assert not odd, (
            f"{kernel} lowers otherwise than when its gpu cases passed on {record[kernel]['run']}: {', '.join(odd)}. "
            f"Run its gpu cases on a GPU and record the run (python -m pallas_kernels.fingerprints --run 'GPU, date' "
            f"{kernel}), or record the change as not yet run (--unrun 'commit: what changed' {kernel}), or keep it "
            f"behind a switch that is off on a GPU until it has run there")


def test_the_record_is_the_checked_list_and_names_every_kernels_gpu_cases():
    record = fingerprints.read()
    assert hardware_checked.CHECKED == {kernel: entry["run"] for kernel, entry in record.items()}
    repo = Path(__file__).resolve().parents[2]  # installed with the package, or a GPU would run no kernel by itself
    data = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert fingerprints.RECORD.name in data["pallas_kernels"]
    assert f"include pallas_kernels/{fingerprints.RECORD.name}" in (repo / "MANIFEST.in").read_text()
    assert set(hardware_checked.CHECKED).isdisjoint(hardware_checked.UNCHECKED)
    assert set(hardware_checked.CHECKED) | set(hardware_checked.UNCHECKED) == set(hardware_checked.GPU_CASES)
    for kernel, entry in record.items():
        assert entry["digests"] or not fingerprints.cases(kernel), f"{kernel}: checked, with no lowering recorded as run"
        labels = {case.label for case in fingerprints.cases(kernel)}
        assert set(entry["digests"]) | set(entry["unrun"]) <= labels, kernel
        assert all(item["why"] and item["digest"] != entry["digests"].get(label)
                   for label, item in entry["unrun"].items()), kernel


def test_a_kernel_not_yet_run_can_be_recorded_once_its_gpu_cases_pass():
    """Every kernel a GPU might take by itself has canonical lowerings (cuDNN's attention: none of ours), so the run
    that passes its gpu cases records it with one command."""
    for kernel in hardware_checked.UNCHECKED:
        digests = fingerprints.current(kernel)
        assert all(len(d) == 16 for d in digests.values()), kernel
        assert bool(digests) == (kernel != "cudnn_attention"), kernel


def test_the_unrun_lowerings_gpu_cases_are_one_pytest_expression(capsys):
    record = fingerprints.read()
    expected = [case for kernel, entry in record.items() if entry["unrun"] for case in hardware_checked.GPU_CASES[kernel]]
    assert hardware_checked.unrun_cases() == " or ".join(expected)
    assert "store_decode" in expected  # the KV kernel changed since its run of 2026-11-28 (record)
    hardware_checked.main(["--unrun-cases"])
    assert capsys.readouterr().out.strip() == " or ".join(expected)


def test_a_changed_kernel_shows_until_recorded_as_unrun_then_as_run(tmp_path):
    path = tmp_path / "record.json"
    shutil.copy(fingerprints.RECORD, path)
    record = fingerprints.read(path)
    label = next(iter(record["int4_words"]["digests"]))
    record["int4_words"]["digests"][label] = "0" * 16  # what ran differs from this checkout's lowering
    path.write_text(json.dumps(record))
    assert list(fingerprints.unexpected("int4_words", fingerprints.read(path))) == [label]

    fingerprints.record_unrun(["int4_words"], "abc1234: a change", path)
    unrun = fingerprints.read(path)["int4_words"]["unrun"]
    assert list(unrun) == [label] and unrun[label]["why"] == "abc1234: a change"
    assert not fingerprints.unexpected("int4_words", fingerprints.read(path))
    fingerprints.record_unrun(["int4_words"], "another word", path)  # the same lowering keeps its first why
    assert fingerprints.read(path)["int4_words"]["unrun"][label]["why"] == "abc1234: a change"

    fingerprints.record_run(["int4_words"], "H100, 2026-12-10", path)
    entry = fingerprints.read(path)["int4_words"]
    assert entry["run"] == "H100, 2026-12-10" and entry["unrun"] == {}
    assert entry["digests"] == fingerprints.current("int4_words")
    with pytest.raises(ValueError, match="'rms_norm' has no GPU run recorded"):
        fingerprints.record_unrun(["rms_norm"], "why", path)
    with pytest.raises(ValueError, match="no canonical lowerings for 'gemv'"):
        fingerprints.cases("gemv")
    with pytest.raises(FileNotFoundError, match="record of kernels checked on a GPU is missing"):
        fingerprints.read(tmp_path / "none.json")  # an install without it would gate every kernel on a GPU
    assert fingerprints.read(tmp_path / "none.json", missing_ok=True) == {}


def test_the_int8_kernel_takes_the_run_ones_x_on_a_gpu_until_the_norm_kernel_may_run(monkeypatch):
    """On a GPU the float16-operand kernel gets its x from XLA (the way its gpu cases passed) while the norm kernel is
    unchecked; with the norm kernel on, or a setting, it converts x itself, a lowering the record does not hold."""
    monkeypatch.delenv(hardware_checked.ENV, raising=False)
    assert not int8_f16.converts_in_xla(1)  # no GPU: interpret mode converts in the kernel
    label = "bfloat16 x, M=1, K-major"
    as_run = fingerprints.read()["int8_f16"]["digests"][label]
    with config.compiling_for(fingerprints.GPU):
        assert int8_f16.converts_in_xla(1) and int8_f16.converts_in_xla(4096)
        with settings.override("int8_f16", convert="kernel"):
            assert not int8_f16.converts_in_xla(1)
        monkeypatch.setenv(hardware_checked.ENV, "rms_norm")
        assert not int8_f16.converts_in_xla(1)
    in_kernel = fingerprints.digest(next(c for c in fingerprints.cases("int8_f16") if c.label == label))
    assert in_kernel != as_run  # the digest tells the two lowerings apart
    monkeypatch.delenv(hardware_checked.ENV)
    assert fingerprints.digest(next(c for c in fingerprints.cases("int8_f16") if c.label == label)) == as_run
