"""A failure that reports an exception -- the wrong one, one that does not say what it is, one
raised where the contract is success -- is an ``error`` (contracts/severity.py: "the wrong
exception where a clear one is the contract"), not the check's default: J.6's second thread
refused with a message that does not say it is a concurrent call was reported as wrong output.
A static sweep holds every ``fail()`` of contracts/checks/ whose message reports an exception to
a stated severity, or a check whose default is already ``error``."""

from __future__ import annotations

import ast
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import load_catalogue, run_checks
from offload_ref.contracts.severity import default_for
from offload_ref.contracts.simple_offloader import SimpleOffloader
from offload_ref.fixtures import get_spec

THREADS = "check_second_thread_gets_a_clear_error_or_exact_output"
CHECKS = Path(__file__).resolve().parents[1] / "contracts" / "checks"


class _BusyWithoutSaying(SimpleOffloader):
    """Refuses a second caller with a message that does not say why (no word of a thread)."""

    def _enter(self, unit: Any, args: Any, kwargs: Any) -> None:
        me = threading.get_ident()
        if any(n for t, n in self._inside.items() if t != me):
            raise RuntimeError("BusyWithoutSaying: try again later")
        super()._enter(unit, args, kwargs)


def busy_without_saying(device: torch.device, strategy: str) -> SimpleOffloader:
    return _BusyWithoutSaying(device, strategy)


def test_a_second_thread_refused_without_saying_why_is_an_error() -> None:
    impl = offloader_implementation(busy_without_saying, name="tests:busy_without_saying",
                                    validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([get_spec("flux2")], checks=[THREADS],
                             strategies=("model_level", "layer_wise"), include_global=False,
                             impl=impl)
    assert len(results) == 2
    for r in results:
        assert r.outcome == "failed", (r.outcome, r.message)
        assert "does not say it is a concurrent call" in r.message, r.message
        assert "BusyWithoutSaying: try again later" in r.message
        assert r.severity == "error", (r.id.strategy, r.severity)


#: A fail() message that reports an exception: one raised ("raised X", "got X: ..."), one that
#: does not say what to do or what it is, one that does not chain its cause.
_REPORTS_AN_EXCEPTION = re.compile(
    r"raised (\{type\(|\{got|\{out|\{obs)|got \{type\(exc|resolve: \{exc|refused without saying|"
    r"does not say it is|does not chain|the error does not mention|names no way out|"
    r"resolution failed: \{type|was rejected: \{type|not hashable: |refused after gradients|"
    r"generation failed: ")


def test_every_failure_reporting_an_exception_states_its_severity() -> None:
    catalogue = load_catalogue()
    missing = []
    for path in sorted(CHECKS.glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fail"):
                continue
            text = " ".join((ast.get_source_segment(source, node) or "").split())
            text = text.replace('" f"', "").replace('" "', "")
            if not _REPORTS_AN_EXCEPTION.search(text):
                continue
            if any(k.arg == "severity" for k in node.keywords):
                continue
            owner = max((f for f in functions if f.lineno <= node.lineno <= f.end_lineno),
                        key=lambda f: f.lineno, default=None)
            if owner is not None and owner.name in catalogue and \
                    default_for(owner.name).value == "error":
                continue
            missing.append(f"{path.name}:{node.lineno}: {text[:100]}")
    assert not missing, "\n".join(missing)


def test_the_sweep_sees_the_failures_it_is_about() -> None:
    """The sweep's pattern finds the sites it must (so the test above cannot pass vacuously)."""
    found = 0
    for path in sorted(CHECKS.glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fail":
                text = " ".join((ast.get_source_segment(source, node) or "").split())
                text = text.replace('" f"', "").replace('" "', "")
                found += bool(_REPORTS_AN_EXCEPTION.search(text))
    assert found >= 15, found
