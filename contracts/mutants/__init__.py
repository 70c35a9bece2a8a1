"""Deliberately broken offloaders: the kit proves each check can fail.

Every mutant is the real implementation with one defect that other offloaders have shipped (see
``shared/reference``).  ``tests/test_mutants.py`` runs the catalogue against each one and asserts
exactly which checks fail; a check that no mutant kills is itself a failing test.

Each module holds the mutants whose checks are in the checks module of the same name
(``plan.py``: ``checks/plan.py``, ...; ``protocol.py``: offloaders judged through the public
protocol alone), each mutant declared once, next to its defect, with its scope and the exact
checks it fails (``_declare.declare``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..case import Implementation
from ._declare import Mutant, declared

# Importing a module declares its mutants: MUTANTS lists them in this order.
from . import (  # noqa: F401
    plan, lifecycle, aliases, split, residency, misuse, distributed, protocol,
)

# tests/test_kit_diagnosis.py builds its broken backends with these.
from ._declare import _backend_with, _layerwise  # noqa: F401

__all__ = ["MUTANTS", "Mutant", "in_rank"]

MUTANTS: tuple[Mutant, ...] = declared()


def in_rank(name: str) -> tuple[Implementation, Any]:
    """The mutant ``name``'s implementation and patch context, in a spawned rank
    (``Implementation.in_rank``)."""
    mutant = next(m for m in MUTANTS if m.name == name)
    return mutant.impl, (mutant.patch() if mutant.patch else contextlib.nullcontext())
