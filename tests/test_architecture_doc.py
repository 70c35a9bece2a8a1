"""docs/architecture.md matches the code: its module tables name every module of the library and
the kit (and nothing that does not exist), and every name its vocabulary and seams tables give
"in the code" is defined there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _rows(section: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines()
            if line.startswith("| `")]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _module_files() -> list[str]:
    """Every module, as the tables write it: relative to ``offload_ref/``, or ``contracts/...``."""
    found = [str(p.relative_to(ROOT / "offload_ref"))
             for p in (ROOT / "offload_ref").rglob("*.py")]
    found += [str(p.relative_to(ROOT)) for p in (ROOT / "contracts").rglob("*.py")]
    return sorted(found)


def _named_paths() -> set[str]:
    return {name for row in _rows(_section("Modules")) for name in _ticked(row[0])}


def test_every_module_is_in_a_module_table() -> None:
    named = _named_paths()
    missing = []
    for module in _module_files():
        parts = module.split("/")
        folders = {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}
        if module not in named and not folders & named:
            missing.append(module)
    assert not missing, f"docs/architecture.md's module tables do not name: {missing}"


def test_every_module_the_tables_name_exists() -> None:
    gone = []
    for name in _named_paths():
        base = ROOT if name.startswith("contracts/") else ROOT / "offload_ref"
        if not (base / name).exists():
            gone.append(name)
    assert not gone, f"docs/architecture.md names modules that do not exist: {sorted(gone)}"


def _defined_names() -> set[str]:
    """Every class, function, method, attribute and field name the library and the kit define."""
    names: set[str] = set()
    for folder in ("offload_ref", "contracts", "fixtures"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
    return names


@pytest.mark.parametrize("title, column", [("Vocabulary", 2), ("Seams", 1)])
def test_every_name_the_tables_give_is_defined(title: str, column: int) -> None:
    defined = _defined_names()
    unknown = []
    for row in _rows(_section(title)):
        for ticked in _ticked(row[column]):
            if "/" in ticked or ticked.endswith(".py"):
                continue  # a file: the module tests check those
            for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", ticked):
                if word not in defined:
                    unknown.append(f"{ticked} ({word})")
    assert not unknown, f"docs/architecture.md's {title} table names what the code lacks: {unknown}"


def test_the_vocabulary_opens_the_document() -> None:
    text = DOC.read_text()
    assert text.index("## Vocabulary") < text.index("## Modules")
    words = {row[0] for row in _rows(_section("Vocabulary"))} | {
        line.split("|")[1].strip() for line in _section("Vocabulary").splitlines()
        if line.startswith("| ") and not line.startswith("| `") and "---" not in line}
    for word in ("ring", "block", "slot", "slot image", "host side", "fill", "placeholder",
                 "swap group"):
        assert word in words, word


def test_the_how_to_add_lists_name_existing_files_and_say_how_many() -> None:
    """Each "How to add" subsection says how many files the change touches and lists them, one
    bullet each, starting with the file's path from the repository root."""
    section = _section("How to add a strategy, a transport, a platform or a check")
    parts = re.split(r"\n### ", section)[1:]
    assert len(parts) == 4, [p.splitlines()[0] for p in parts]
    for part in parts:
        title, body = part.split("\n", 1)
        count = re.search(r"\((\d+) files", title)
        assert count, f"{title!r} does not say how many files"
        paths = re.findall(r"^- `([^`]+)`:", body, flags=re.M)
        assert len(paths) == int(count.group(1)), (title, paths)
        missing = [p for p in paths if not (ROOT / p).is_file()]
        assert not missing, f"{title!r} names files that do not exist: {missing}"
