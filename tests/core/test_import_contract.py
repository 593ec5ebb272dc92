"""The package map's import directions (.importlinter, docs/design.md#package-map) are a checked
contract: lint-imports passes on the tree, and fails when a stage imports another stage or a
shared package imports upward, so a sideways import cannot land."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    return subprocess.run(cmd + ["--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_tree_keeps_the_import_contract():
    res = lint_imports(REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Contracts: 1 kept, 0 broken." in res.stdout


@pytest.mark.parametrize("importer, imported, broken", [
    ("common/evaluate/stage.py", "common.data.generate", "common.evaluate is not allowed to import common.data"),  # 05 -> 01b
    ("common/train/trainer.py", "common.extract.stage", "common.train is not allowed to import common.extract"),  # 04 -> 02
    ("common/core/config.py", "common.train.trainer", "common.core is not allowed to import common.train"),  # upward
    ("common/extract/stage.py", "common.demo.tiny_target", "common.extract is not allowed to import common.demo"),
])
def test_a_wrong_import_breaks_the_contract(tmp_path, importer, imported, broken):
    shutil.copytree(REPO / "common", tmp_path / "common", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    with open(tmp_path / importer, "a", encoding="utf-8") as f:
        f.write(f"\nimport {imported}  # the wrong import under test\n")
    res = lint_imports(tmp_path)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Contracts: 0 kept, 1 broken." in res.stdout
    assert broken in res.stdout, res.stdout[-3000:]
