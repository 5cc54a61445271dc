"""The linters the suite runs: ruff over the whole tree (the rule set in
pyproject.toml's ``[tool.ruff.lint]``), mypy over the whole package
(``[tool.mypy]``), no ``Any`` parameter in the engine's functions, and
sizes a reader can hold: every module of the package under
``MAX_MODULE_LINES``, every function under ``MAX_FUNCTION_LINES``."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    r = run("ruff", "check", "--no-cache", "appliance", "tests", "scripts")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_engine_type_checks():
    r = run("mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def any_parameters(folder: Path) -> list[str]:
    """Parameters annotated with ``Any`` (alone or inside another type) in the functions under ``folder``
    (paths relative to it)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                    if arg.annotation is not None and "Any" in {n.id for n in ast.walk(arg.annotation)
                                                                if isinstance(n, ast.Name)}:
                        found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_the_engines_functions_take_no_any(tmp_path):
    assert any_parameters(ROOT / "appliance" / "engine") == []
    (tmp_path / "m.py").write_text("from typing import Any\ndef f(a: int, *b: dict[str, Any]) -> None: ...\n")
    assert any_parameters(tmp_path) == ["m.py:2 f(b)"]


def oversized(folder: Path) -> list[str]:
    """Modules of ``MAX_MODULE_LINES`` lines or more and functions of ``MAX_FUNCTION_LINES`` or more under
    ``folder`` (paths relative to it)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines >= MAX_MODULE_LINES:
            found.append(f"{path.relative_to(folder)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size >= MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name}: {size} lines")
    return found


def test_modules_and_functions_stay_small(tmp_path):
    assert oversized(ROOT / "appliance") == []
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert oversized(tmp_path) == [f"m.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
