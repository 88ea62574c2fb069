"""The package's shape, as docs/architecture.md promises it: no import cycle among
tiered_kv's modules (imports inside functions and under TYPE_CHECKING count: a deferred
import hides a cycle, it does not remove one), no module over 600 lines, one public
class per name, and every module says in its docstring what it is."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tiered_kv"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` lands in: itself, or the package that defines it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path] = MODULES) -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target.startswith("tiered_kv"):
                    resolved = _resolve(target, modules)
                    if resolved and resolved != module:
                        graph.add_edge(module, resolved)
    return graph


def test_the_checker_finds_a_deferred_cycle(tmp_path):
    """The check itself can fail: two modules importing each other, one of them inside a
    function, form a cycle."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import tiered_kv.b\n")
    b.write_text("def f():\n    from tiered_kv import a\n")
    graph = import_graph({"tiered_kv.a": a, "tiered_kv.b": b})
    assert list(nx.simple_cycles(graph)) != []


def test_no_import_cycle():
    graph = import_graph()
    cycles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size_and_docstring(module):
    path = MODULES[module]
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)}: {lines} lines, at most {MAX_LINES}"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(PACKAGE.parent)} has no module docstring"


def test_one_public_class_per_name():
    where = defaultdict(list)
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(module)
    twice = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not twice, f"classes defined in more than one module: {twice}"
