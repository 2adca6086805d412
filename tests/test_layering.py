"""The import layering (pyproject.toml [tool.importlinter]) holds, and breaks when a module
imports a layer above it: the contracts are checked, not hoped for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed "
                                "(pip install -e '.[test]')")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), "--no-logo", "--no-cache", "--config",
                           str(ROOT / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    for folder in ("graphdist", "kernels"):        # kernels/: a root package of the contracts
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_tree_keeps_every_contract(tmp_path):
    done = _lint(_copy(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout


@pytest.mark.parametrize("module, bad", [
    ("ops/state.py", "from graphdist.runtime import executable"),      # ops -> runtime
    ("ir/types.py", "from graphdist.ops import core"),                 # ir -> ops
    ("passes/dce.py", "import graphdist.pipeline"),                    # passes -> pipeline
    ("viz/dot.py", "from graphdist.passes import schedule"),           # viz -> passes
])
def test_an_upward_import_breaks_the_contracts(tmp_path, module, bad):
    tree = _copy(tmp_path)
    path = tree / "graphdist" / module
    path.write_text(path.read_text() + f"\n\ndef _wrong():\n    {bad}\n")
    done = _lint(tree)
    assert done.returncode != 0
    importer = "graphdist." + module.removesuffix(".py").replace("/", ".")
    assert "BROKEN" in done.stdout and importer in done.stdout, done.stdout
