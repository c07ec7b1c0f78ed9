"""The package's public API (llmeq_jax/__init__.py), the README's core-API snippet, and the shipped recipes."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import llmeq_jax
from llmeq_jax import pipeline
from llmeq_jax.errors import UsageError
from tests.shared_data import SHARED_DATA, shared_data_path

REPO = Path(__file__).resolve().parents[1]


def readme_core_api_snippet() -> str:
    """The first Python block of the README's "Core API" section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Core API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_core_api_snippet_runs_on_stories260k(tmp_path, monkeypatch):
    shared_data_path("stories260K.gguf")
    code = readme_core_api_snippet()
    assert "import llmeq_jax as lq" in code and "../shared/data/" in code
    code = code.replace("../shared/data/", f"{SHARED_DATA}/")
    monkeypatch.chdir(tmp_path)  # the snippet writes out/w8a8
    ns: dict = {}
    exec(compile(code, "README.md (Core API)", "exec"), ns)
    assert math.isfinite(ns["ppl"]) and ns["ppl"] > 1
    assert ns["new_ids"].shape == (1, 20)
    assert ns["recipe_dict"]["name"] == "smoothquant-w8a8"
    assert (tmp_path / "out" / "w8a8").is_dir()
    import jax

    from llmeq_jax.core.qarray import QArray

    reloaded = jax.tree.leaves(ns["qparams"], is_leaf=lambda x: isinstance(x, QArray))  # from load_checkpoint
    assert any(isinstance(x, QArray) and x.bits == 8 for x in reloaded)
    assert ns["info"]["calib_samples"] == 8


def test_public_names_resolve_and_import_stays_cheap():
    for name in llmeq_jax.__all__:
        assert getattr(llmeq_jax, name) is not None, name
    assert llmeq_jax.quantize_model.__module__ == "llmeq_jax.methods"
    with pytest.raises(AttributeError):
        llmeq_jax.no_such_name  # noqa: B018
    code = "import sys, llmeq_jax; print(sorted(m for m in ('jax', 'transformers', 'numpy') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_recipe_lookup_by_name_uses_package_resources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the name must come from the package
    names = pipeline.recipe_names()
    assert set(pipeline.MAIN_RECIPES) <= set(names) and "gptq-w4-g128" in names
    path = pipeline.recipe_path("rtn-w8")
    assert Path(str(path)).resolve().parent == Path(llmeq_jax.__file__).resolve().parent / "configs"
    recipe = pipeline.read_recipe("rtn-w8")
    assert recipe.name == "rtn-w8" and recipe.method == "rtn"
    assert llmeq_jax.read_recipe("kv4").kv is not None
    # a file of that name in the working directory wins over the shipped recipe
    (tmp_path / "mine.yaml").write_text((Path(str(path))).read_text().replace("name: rtn-w8", "name: mine"))
    assert pipeline.read_recipe("mine.yaml").name == "mine"
    with pytest.raises(UsageError, match="rtn-w8"):
        pipeline.recipe_path("no-such-recipe")


def test_every_shipped_recipe_loads_and_is_declared_package_data():
    configs = Path(llmeq_jax.__file__).resolve().parent / "configs"
    files = sorted(configs.glob("*.yaml"))
    assert len(files) == len(pipeline.recipe_names()) > 20
    for f in files:
        assert pipeline.read_recipe(f.stem).name  # every one parses
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llmeq_jax"]
    assert any(sorted(configs.glob(pattern.removeprefix("configs/"))) == files for pattern in data)
    assert "recursive-include llmeq_jax/configs *.yaml" in (REPO / "MANIFEST.in").read_text()
    assert not (REPO / "configs").exists()  # one home for the recipes
