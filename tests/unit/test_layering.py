"""The import graph of the package: no cycles (lazy imports inside functions
count too), and each layer imports only the layers ``ALLOWED`` lists for it:
the runner (the composition root) sits on top and imports everything it
composes; server, worker and models sit below it; config imports only the
kernels' capability table; ``engine/`` imports nothing of ours but
``sampling_params`` and no torch. Only the entry points (runner, the
offline LLM, the CLI, benchmarks) import the runner."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"appliance": ROOT / "appliance"}


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = path
    return mods


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every appliance module ``name`` imports, at any depth of its code
    (``if TYPE_CHECKING:`` blocks excepted: they never run)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


GRAPH = {n: imports_of(n, p, set(module_files())) for n, p in module_files().items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer(module: str) -> str:
    if module.startswith("appliance.kernels"):
        return "kernels"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "appliance"


# What each layer may import besides itself.
ALLOWED = {
    "errors": set(),
    "version": set(),
    "kernels": {"errors"},
    "sampling_params": set(),
    "engine": {"sampling_params", "errors"},
    "structured_output": {"sampling_params"},
    "config": {"errors", "kernels"},
    "models": {"config", "kernels", "errors"},
    "worker": {"engine", "models", "kernels", "sampling_params", "errors"},
    "server": {"config", "engine", "models", "sampling_params", "structured_output", "errors", "version"},
    "runner": {"config", "engine", "worker", "models", "kernels", "server", "structured_output", "errors"},
}


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_each_layer_imports_only_below_it(name):
    uses = defaultdict(set)
    for module, deps in GRAPH.items():
        if layer(module) == name:
            for dep in deps:
                if layer(dep) not in ALLOWED[name] | {name}:
                    uses[layer(dep)].add(f"{module} -> {dep}")
    assert not uses, dict(uses)


def test_config_uses_only_the_kernels_capability_table():
    reaching = {f"{m} -> {d}" for m, deps in GRAPH.items() if layer(m) == "config"
                for d in deps if layer(d) == "kernels" and d not in ("appliance.kernels", "appliance.kernels.registry")}
    assert not reaching


def test_the_engine_is_torch_free():
    for name, path in module_files().items():
        if layer(name) == "engine":
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    node.body = []
            roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert "torch" not in roots and "numpy" not in roots, name
