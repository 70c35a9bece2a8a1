"""``Transport`` is a complete, declared interface (issue 39): the ring and the backends call
only what it declares, never probe a transport with ``getattr``/``hasattr``/``isinstance``, and
one owner records a slot's ready event (Note [Slots] in offload_ref/backends/slots.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from offload_ref.backends.transports import Transport

BACKENDS = Path(__file__).resolve().parent.parent / "offload_ref" / "backends"
PROBES = ("getattr", "hasattr", "isinstance")


def _mentions_transport(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Attribute) and "transport" in n.attr.lower())
               or (isinstance(n, ast.Name) and "transport" in n.id.lower())
               for n in ast.walk(node))


def _probes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, probe) of every getattr/hasattr/isinstance whose first argument is a transport."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in PROBES and node.args and _mentions_transport(node.args[0])):
            out.append((node.lineno, node.func.id))
    return out


def _transport_calls(tree: ast.AST) -> set[str]:
    """Every ``<...>.transport.NAME`` the code reads."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "transport"}


def _ready_records(tree: ast.AST) -> list[int]:
    """Lines of every ``<...>.ready.record(...)``."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "record" and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "ready"]


MODULES = sorted(BACKENDS.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_backend_module_probes_a_transport(path: Path) -> None:
    probes = _probes(ast.parse(path.read_text(encoding="utf-8")))
    assert not probes, f"{path.name} probes a transport (declare it on Transport): {probes}"


def test_transport_declares_everything_the_backends_call_on_one() -> None:
    called: dict[str, set[str]] = {}
    for path in MODULES:
        for name in _transport_calls(ast.parse(path.read_text(encoding="utf-8"))):
            called.setdefault(name, set()).add(path.name)
    assert "fill" in called and "maps_files" in called  # the scan sees the ring's calls
    missing = {n: sorted(where) for n, where in called.items() if not hasattr(Transport, n)}
    assert not missing, f"called on a transport but not declared on Transport: {missing}"


def test_only_the_ring_records_a_slots_ready_event() -> None:
    where = {path.name: lines for path in MODULES
             if (lines := _ready_records(ast.parse(path.read_text(encoding="utf-8"))))}
    assert set(where) == {"ring.py"}, where


def test_the_scans_see_what_they_look_for() -> None:
    probe = ast.parse("if getattr(ring.transport, 'maps_files', False):\n"
                      "    isinstance(self.transport, X)\n"
                      "ring.transport.shards\n"
                      "slot.ready.record(stream)\n")
    assert [p for _, p in _probes(probe)] == ["getattr", "isinstance"]
    assert _transport_calls(probe) == {"shards"}
    assert _ready_records(probe) == [4]
