"""The mutants reach the implementation through its documented seams only.

A mutant is the real implementation with one defect (contracts/mutants/).  It may subclass a
library class and override its public methods (the seams Note [Seams] in docs/architecture.md
lists: a ``Transport``, a ``Platform`` wrapper, a ``Transaction`` subclass, the resolver's named
hooks, the backends' named hooks and policy classes), replace fields of the kit's
``Implementation``, or replace a pipeline's factory.  It may not override a ``_``-prefixed name of
a library class, read or write a library object's ``_``-prefixed attribute, import a library's
``_``-prefixed name, or patch anything in place: a ring refactor then never needs a mutant edited,
and a mutant cannot silently stop applying when a private name is renamed.
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

import pytest

from offload_ref.contracts.mutants import MUTANTS, Mutant

MUTANTS_DIR = Path(inspect.getfile(MUTANTS[0].__class__)).parent
PACKAGE = "offload_ref.contracts.mutants"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith(PACKAGE)


def _reachable_classes(root: object) -> list[type]:
    """The classes defined in the mutants package that ``root`` reaches: through functions
    (closure cells, the globals their code names), classes (their attributes and bases) and
    containers."""
    seen: set[int] = set()
    found: list[type] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            if _ours(obj):
                found.append(obj)
                todo.extend(vars(obj).values())
                todo.extend(obj.__bases__)
        elif isinstance(obj, (types.FunctionType, types.MethodType)):
            func = getattr(obj, "__func__", obj)
            if not _ours(func):
                continue
            todo.extend(c.cell_contents for c in func.__closure__ or () if _has_contents(c))
            codes = [func.__code__]
            while codes:
                code = codes.pop()
                todo.extend(func.__globals__[n] for n in code.co_names if n in func.__globals__)
                codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, (classmethod, staticmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
    return found


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def private_overrides(mutant) -> list[str]:
    """``Base.name`` for every private name of a library class that a class of the mutant
    redefines."""
    impl = mutant.impl
    roots = [getattr(impl, f) for f in impl.__dataclass_fields__] + [mutant.factory]
    found = []
    for cls in _reachable_classes(roots):
        library = [b for b in cls.__mro__[1:] if not _ours(b) and b is not object]
        for name in vars(cls):
            if not _is_private(name):
                continue
            owner = next((b for b in library if name in vars(b)), None)
            if owner is not None:
                found.append(f"{cls.__qualname__} overrides {owner.__qualname__}.{name}")
    return found


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_overrides_no_private_name(mutant) -> None:
    problems = private_overrides(mutant)
    assert not problems, f"{mutant.name}: " + "; ".join(problems)


def test_a_mutant_cannot_patch_anything_in_place() -> None:
    """A mutant is its ``impl`` and ``factory``: there is no hook that would run code around its
    run (a patch of a module global or a class attribute would be one)."""
    fields = set(Mutant.__dataclass_fields__)
    assert fields == {"name", "defect", "impl", "pipelines", "sections", "strategies", "kills",
                      "factory", "placement_kills", "only"}, fields


def _names_defined_here(trees: list[ast.AST]) -> set[str]:
    """Private names the mutants package defines itself (its own helpers and attributes)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name)
    return {n for n in names if _is_private(n)}


def private_reaches() -> list[str]:
    """Every private library name the mutants' source imports or reads: ``from lib import _x``,
    and ``obj._x`` where ``_x`` is no name of the mutants package's own."""
    files = sorted(MUTANTS_DIR.glob("*.py"))
    trees = [ast.parse(f.read_text(), filename=str(f)) for f in files]
    ours = _names_defined_here(trees)
    found = []
    for path, tree in zip(files, trees):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                if node.attr not in ours:
                    found.append(f"{path.name}:{node.lineno} reaches .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("setattr", "delattr") and node.args
                  and _names_an_import(node.args[0], tree)):
                found.append(f"{path.name}:{node.lineno} patches with {node.func.id}()")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) \
                    else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and _names_an_import(target.value, tree):
                        found.append(f"{path.name}:{node.lineno} patches "
                                     f"{ast.unparse(target)}")
    return found


def _names_an_import(node: ast.AST, tree: ast.AST) -> bool:
    """Whether ``node`` is a name the module imported (a library module or class: writing an
    attribute of it patches the library for everyone)."""
    if not isinstance(node, ast.Name):
        return False
    imported = {alias.asname or alias.name.partition(".")[0]
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for alias in n.names}
    return node.id in imported


def test_mutants_reach_no_private_library_name() -> None:
    found = private_reaches()
    assert not found, "mutants reaching private library names (use a seam): " + "; ".join(found)


# -- the detectors themselves fail where they should -------------------------------------------


def test_the_override_detector_sees_a_private_override(monkeypatch) -> None:
    import dataclasses

    from offload_ref.backends.ring import BlockRing
    from offload_ref.contracts.mutants import _declare

    broken = type("_PrivateRing", (BlockRing,), {"_issue_copy": lambda self, k, s: None,
                                                  "__module__": f"{PACKAGE}.probe"})
    mutant = dataclasses.replace(
        MUTANTS[0], impl=MUTANTS[0].impl.replace(
            make_backend=_declare.backend_with(LayerWiseOffloadBackend=_declare.with_ring(broken))))
    assert any("overrides BlockRing._issue_copy" in p for p in private_overrides(mutant))


def test_the_source_scan_sees_a_private_read(tmp_path, monkeypatch) -> None:
    (tmp_path / "probe.py").write_text("from offload_ref.plan import _predict\n"
                                       "from offload_ref import host\n"
                                       "from offload_ref.split import ComponentGroups\n"
                                       "setattr(host, 'region_bytes', None)\n"
                                       "ComponentGroups.check_name = None\n"
                                       "def f(ring):\n    return ring._slot_flats\n")
    monkeypatch.setattr(sys.modules[__name__], "MUTANTS_DIR", tmp_path)
    found = private_reaches()
    assert any("imports offload_ref.plan._predict" in f for f in found), found
    assert any("reaches ._slot_flats" in f for f in found), found
    assert any("patches with setattr()" in f for f in found), found
    assert any("patches ComponentGroups.check_name" in f for f in found), found
