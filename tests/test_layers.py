"""Imports point down: a package never imports one above it, and no modules import each other
in a cycle. The layers, bottom to top (docs/ARCHITECTURE.md, "Packages"):

    net, config, local_cache  <  kv  <  scheduler  <  replica  <  cluster  <  ops  <  cli

Every import counts, at module level or inside a function, and under TYPE_CHECKING too: a
lazy import is still a dependency a reader must know about.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tokenflow"
LAYERS = [("net", "config", "local_cache"), ("kv",), ("scheduler",), ("replica",), ("cluster",), ("ops",),
          ("cli",)]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported tokenflow module, whether at module level) for every import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            # `from tokenflow.x import y` may import the module tokenflow.x.y
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, id(node) in top_level) for name in names
                  if name.startswith("tokenflow.")]
    return found


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> str:
    return module.split(".")[1]


def test_every_package_has_a_layer():
    assert {layer_of(m) for m in MODULES if m != "tokenflow"} <= set(RANK)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    if module == "tokenflow":
        return
    mine = layer_of(module)
    upward = sorted({name for name, _ in imports_of(MODULES[module])
                     if RANK[layer_of(name)] > RANK[mine]})
    assert not upward, f"{module} ({mine}) imports from a layer above it: {upward}"


def test_no_import_cycles_between_modules():
    graph = {module: {name for name, top in imports_of(path) if top and name in MODULES}
             for module, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_an_upward_import(tmp_path):
    """The test above can fail: an upward import in a module is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tokenflow.cluster.server import LLMServer\n")
    assert ("tokenflow.cluster.server", False) in imports_of(bad)
