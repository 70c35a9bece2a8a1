"""Coordination for distributed offload: store-based agreement before any collective.

* :class:`Rendezvous` -- rounds of value exchange through the c10d store, with a timeout, where a
  rank that fails makes every rank raise :class:`RankFailedError` naming it;
* :class:`WaveRunner` -- data-parallel waves (one request per rank) that agree on the step count
  first (:class:`WaveMismatchError`);
* :func:`run_ranks` -- run a function on N local spawned ranks (tests, the conformance kit).

Importing this package initializes nothing (and imports no torch): names load on first use.
See docs/distributed-coordination.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LaunchError",
    "RankDisagreementError",
    "RankError",
    "RankFailedError",
    "Rendezvous",
    "WaveMismatchError",
    "WaveRunner",
    "run_ranks",
    "run_wave",
]

_WHERE = {
    "Rendezvous": ".rendezvous",
    "RankFailedError": ".rendezvous",
    "RankDisagreementError": ".rendezvous",
    "WaveRunner": ".waves",
    "WaveMismatchError": ".waves",
    "run_wave": ".waves",
    "run_ranks": ".launch",
    "LaunchError": ".launch",
    "RankError": ".launch",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
