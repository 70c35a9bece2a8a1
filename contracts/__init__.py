"""The offload-ref conformance kit (installed as ``offload_ref.contracts``).

Public API: :class:`PipelineSpec`, :func:`run_checks`, :func:`parametrize_with_checks`,
:data:`CATALOGUE` (check id -> :class:`CheckInfo`), :class:`CheckFailure`.  Imports are lazy so
that the pytest plugin module loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CATALOGUE",
    "CheckFailure",
    "CheckInfo",
    "CheckResult",
    "Implementation",
    "PipelineSpec",
    "iter_cases",
    "parametrize_with_checks",
    "run_checks",
]

_WHERE = {
    "PipelineSpec": ".spec",
    "CheckFailure": ".registry",
    "CheckInfo": ".registry",
    "Implementation": ".case",
    "CheckResult": ".runner",
    "iter_cases": ".runner",
    "run_checks": ".runner",
    "parametrize_with_checks": ".pytest_support",
}


def __getattr__(name: str) -> Any:
    if name == "CATALOGUE":
        from .runner import load_catalogue

        return load_catalogue()
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
