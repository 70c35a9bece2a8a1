"""The shape of the code: no import cycle in the library or the kit, and no module so long that a
newcomer cannot hold it.

The graph is read from the source (``ast``), so an import written inside a function counts as
much as one at the top: a cycle hidden behind a function-level import is still a cycle, it only
fails later and more confusingly.  An edge goes to the module an import names; ``from pkg import
name`` goes to ``pkg.name`` when that is a module and to ``pkg`` (its ``__init__``) otherwise.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The installed package names and the folders they come from (pyproject's ``package-dir``).
PACKAGES = {
    "offload_ref": ROOT / "offload_ref",
    "offload_ref.contracts": ROOT / "contracts",
    "offload_ref.fixtures": ROOT / "fixtures",
}
MAX_LINES = 1000


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom,
             modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    found = []
    for target in named:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(target)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {target for node in ast.walk(tree)
                       if isinstance(node, (ast.Import, ast.ImportFrom))
                       for target in _targets(name, path, node, modules)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


def test_the_library_and_the_kit_have_no_import_cycle() -> None:
    graph = import_graph(_modules())
    found = cycles(graph)
    assert not found, "import cycles (cut each by moving what both sides need below them): " + \
        " | ".join(_describe(c, graph) for c in found)


def test_no_module_reaches_a_thousand_lines() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not long, (f"modules of {MAX_LINES} lines or more (split each by concept): "
                      + ", ".join(f"{name} ({n})" for name, n in sorted(long.items())))


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
])
def test_the_cycle_finder_finds_exactly_the_cycles(edges, expected) -> None:
    assert sorted(cycles(edges)) == expected


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom ..a import f\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py",
               "pkg.sub": pkg / "sub" / "__init__.py", "pkg.sub.b": pkg / "sub" / "b.py"}
    graph = import_graph(modules)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
