"""The layer contract of pyproject.toml ([tool.importlinter]) holds: autopar imports only downward.

import-linter parses every import statement of the package (function-local and TYPE_CHECKING
ones included), so this fails on any import against ARCHITECTURE.md's order. ``autopar/passes``
and ``autopar/cost_models`` are committed links to ``passes/`` and ``cost_models/`` (what
pyproject's package-dir installs there), so ``lint-imports`` run in the repository sees the package
as installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="the layer check needs import-linter (pip install -e '.[test]')")

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"passes": REPO / "passes", "cost_models": REPO / "cost_models"}  # autopar/<name> links here


def _mirror(root: Path, replace: dict[str, str]) -> None:
    """``root/autopar``: links to the package's entries, but ``replace``'s files (relative to
    autopar/) with other text."""
    pkg = root / "autopar"
    pkg.mkdir()
    for entry in (REPO / "autopar").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    for rel, text in replace.items():
        (pkg / rel).unlink()
        (pkg / rel).write_text(text)


def _lint(root: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(REPO / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_imports_follow_the_layers():
    run = _lint(REPO)  # the repository itself, as a user's `lint-imports` sees it
    assert run.returncode == 0, f"an import breaks pyproject.toml's layer contract:\n{run.stdout}\n{run.stderr}"


def test_a_function_local_upward_import_breaks_the_contract(tmp_path):
    """The check sees imports inside functions: one from the lowest layer up to the runtime fails it."""
    errors = (REPO / "autopar" / "errors.py").read_text()
    probe = errors + "\n\ndef _probe():\n    from autopar.runtime.launch import launch\n    return launch\n"
    _mirror(tmp_path, replace={"errors.py": probe})
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "autopar.errors -> autopar.runtime.launch" in run.stdout, run.stdout


def _private_imports() -> list[str]:
    """``from autopar... import _name`` statements in the package (function-local ones included)."""
    import ast

    found = []
    for root in [REPO / "autopar", *MAPPED.values()]:
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(REPO / "autopar") and any(p.name in MAPPED for p in path.parents):
                continue  # the mapped subpackages' links, walked as themselves
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autopar"):
                    found += [f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_crosses_modules():
    """A name another module needs is public: no module imports another's ``_name``."""
    assert _private_imports() == []
