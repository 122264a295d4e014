"""The product never imports the evaluation harness (design.md's house rule; issue 11).

Each product entry point is imported in a fresh interpreter, and its `sys.modules` is inspected:
no `controller.evaluation` module, and none of the harness's own third-party imports (tqdm,
matplotlib) that the sidecar image does not install.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

HARNESS_ONLY = ("tqdm", "matplotlib")


def _modules_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


PRODUCT = sorted(f"controller.{p.stem}" for p in (ROOT / "controller").glob("*.py") if p.stem != "__main__")


@pytest.mark.parametrize("statement", [
    "import controller.loop", "import controller.cli", "import controller.status",
    "import " + ", ".join(PRODUCT),        # every module of the product at once
], ids=["loop", "cli", "status", "every-product-module"])
def test_the_product_imports_nothing_from_the_harness(statement):
    loaded = _modules_after(statement)
    assert set(statement.removeprefix("import ").split(", ")) <= set(loaded)
    assert [m for m in loaded if m == "controller.evaluation" or m.startswith("controller.evaluation.")] == []
    assert [m for m in loaded if m.split(".")[0] in HARNESS_ONLY] == []


def test_the_check_would_see_a_harness_import():
    """The inspection itself works: importing a harness module shows up."""
    loaded = _modules_after("import controller.evaluation.sweep")
    assert "controller.evaluation.sweep" in loaded and "controller.evaluation.loadgen" in loaded
