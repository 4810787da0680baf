"""The import graph of the project's packages (pyproject.toml's [tool.importlinter] root_packages)
has no cycle between modules, imports inside functions included; `lint-imports` checks the layers
and contracts, this the cycles within a layer that no contract sees. And the one upward dependency
that is a string, not an import (a Serve config file's application builder, deploy.ray_serve.BUILDER),
names something that exists."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import grimp
import tomllib  # Python 3.11, as lint-imports

ROOT = Path(__file__).resolve().parent.parent


def root_packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["root_packages"]


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively), each
    sorted, then by their first module."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """A cycle of the component, as its imports with their lines."""
    first, members = component[0], set(component)
    for other in component[1:]:
        there = graph.find_shortest_chain(first, other)
        back = graph.find_shortest_chain(other, first)
        if there and back and set(there) | set(back) <= members:
            chain = list(there) + list(back[1:])
            break
    else:
        chain = [first]
    steps = []
    for importer, imported in zip(chain, chain[1:], strict=False):
        lines = sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})
        steps.append(f"{importer} -> {imported} (line {', '.join(map(str, lines))})")
    return f"{', '.join(component)}: " + "; ".join(steps)


def test_graph_finds_a_cycle_of_imports_in_functions(tmp_path, monkeypatch):
    """The check itself: two modules that import each other, one only inside a function."""
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from cyclic import high\n\n    return high\n")
    (package / "high.py").write_text("from cyclic import low\n")
    (package / "other.py").write_text("from cyclic import low\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        graph = grimp.build_graph("cyclic", include_external_packages=False, cache_dir=None)
    finally:
        sys.modules.pop("cyclic", None)
    assert cycles(graph) == [["cyclic.high", "cyclic.low"]]
    assert "cyclic.low -> cyclic.high (line 2)" in describe(graph, ["cyclic.high", "cyclic.low"])


def test_no_import_cycles():
    graph = grimp.build_graph(*root_packages(), include_external_packages=False, cache_dir=None)
    found = cycles(graph)
    assert not found, "import cycles between modules:\n" + "\n".join(describe(graph, c) for c in found)


def test_serve_config_files_builder_resolves():
    """deploy.ray_serve writes a Serve config file whose application Serve builds from the import
    path BUILDER (a layer above deploy, named as a string: no import contract sees it)."""
    from deploy import ray_serve

    module, _, attr = ray_serve.BUILDER.partition(":")
    assert module and attr, ray_serve.BUILDER
    assert callable(getattr(importlib.import_module(module), attr)), ray_serve.BUILDER
