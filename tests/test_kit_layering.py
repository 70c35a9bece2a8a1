"""The kit's layering (issue 39): ``contracts/facts.py`` and ``contracts/observe.py`` are a floor
below the checks, ``contracts/case.py`` imports nothing from ``contracts/checks/``, and no check
module imports a ``_``-prefixed name of another kit module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent.parent / "contracts"


def _kit_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module as written, names) of every import of a kit module in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.level or module.startswith(("contracts", "offload_ref.contracts")):
                out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def _from_checks(path: Path, module: str) -> bool:
    """Whether ``module`` (as written in ``path``) is ``contracts/checks/`` or one of its modules."""
    if module.startswith(("contracts.checks", "offload_ref.contracts.checks")):
        return True
    level = len(module) - len(module.lstrip("."))
    base = path.parent
    for _ in range(level - 1):
        base = base.parent
    target = base.joinpath(*module.lstrip(".").split(".")) if module.lstrip(".") else base
    return target == KIT / "checks" or KIT / "checks" in target.parents


@pytest.mark.parametrize("path", sorted((KIT / "checks").glob("*.py")), ids=lambda p: p.name)
def test_no_check_module_imports_a_private_name_of_the_kit(path: Path) -> None:
    private = [(line, module, [n for n in names if n.startswith("_")])
               for line, module, names in _kit_imports(path)]
    private = [p for p in private if p[2]]
    assert not private, f"{path.name} imports private names: {private}"


@pytest.mark.parametrize("name", ["case.py", "facts.py", "observe.py"])
def test_the_floor_and_the_case_import_nothing_from_the_checks(name: str) -> None:
    path = KIT / name
    upward = [(line, module) for line, module, _ in _kit_imports(path)
              if _from_checks(path, module)]
    assert not upward, f"{name} imports from contracts/checks/: {upward}"


def test_the_rules_see_a_broken_module(tmp_path: Path) -> None:
    # the scans themselves: a private import and an upward import are both found
    fake = KIT / "checks" / "fake.py"
    source = "from ..facts import _hidden\nfrom .plan import with_plan\n"
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    names = [n for _, _, ns in _kit_imports(probe) for n in ns]
    assert "_hidden" in names
    assert _from_checks(fake, ".plan") and not _from_checks(fake, "..facts")
    assert _from_checks(KIT / "case.py", ".checks.plan") and not _from_checks(KIT / "case.py",
                                                                              ".facts")
