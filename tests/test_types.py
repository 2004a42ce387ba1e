"""ir/ and passes/ stay mypy-clean (STYLE.md: type hints everywhere), with the [tool.mypy] config of
pyproject.toml."""

from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_ir_and_passes_are_mypy_clean() -> None:
    stdout, stderr, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"),
        str(ROOT / "octopipe" / "ir"),
        str(ROOT / "octopipe" / "passes"),
    ])
    assert status == 0, f"mypy found type errors in octopipe/ir or octopipe/passes:\n{stdout}{stderr}"
